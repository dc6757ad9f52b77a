"""The plain start, kept as it is where it errs well within the gate.

    every decided layer 8-bit, default rule, weights at nearest -> within PLAIN_MARGIN x rtol?
        -> kept (no balancing, rounding or search), else the search

The 8-bit search's stages (outlier and Conv balancing, equalisation, weight rounding, the
rule choice, bias correction) cost tens to hundreds of trial runs. Where the start they would
improve already errs under half the gate on the calibration samples, they buy margin the
conversion does not need, at 5x its time (convnext_t INT8: 136 CPU s with them, its plain
start 0.023 / 0.029 held out in ~20). The search aims at JUDGE_MARGIN x rtol; a start kept
untreated aims lower, as unseen samples err more on a model nothing was fitted to (face_landmark
INT8: 0.023 on calibration, 0.044 held out).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx

from npuprep.calibrate.stats import CalibrationStats
from npuprep.data import Feed
from npuprep.detections import Decision
from npuprep.numerics import NumberFormat
from npuprep.pipeline.eight_bit_choice import eight_bit_share
from npuprep.plan.layer_precision import LayerPrecision
from npuprep.rewrite.qdq_weights import WeightStore
from npuprep.verify.output_check import OutputCheck, check_output_sets, check_until
from npuprep.verify.output_errors import output_passes
from npuprep.verify.qdq_model import eight_bit_nodes, on_target, quantise
from npuprep.verify.qdq_trials import Variant
from npuprep.verify.widening import CurvePoint, Widening

# The share of rtol under which the plain start is kept as it is (the search aims at 0.8).
PLAIN_MARGIN = 0.5


def start_check(reference: onnx.ModelProto, base: onnx.ModelProto,
                layers: Sequence[LayerPrecision], stats: CalibrationStats,
                variants: Sequence[Variant], wide: NumberFormat, samples: Sequence[Feed], *,
                pinned: set[str], rtol: float, top_k: Mapping[str, Decision], margin: float,
                tensor_scales: Mapping[str, float], weights: WeightStore,
                wide_saturate: bool, expected: Sequence[dict[str, np.ndarray]],
                stop_past: float | None = None) -> OutputCheck:
    """The outputs' check of `layers` each in its 8-bit format (weights rounded to nearest,
    each format's default rule, no bias correction) on `samples`, decisions also at
    `margin`, against the reference's `expected` outputs on them. `stop_past` (outputs judged
    by rel L2 alone): it stops once an output errs past that for sure (check_until)."""
    built = base
    for v in variants:
        nodes = eight_bit_nodes(layers, v.fmt)
        if nodes:
            built = quantise(built, nodes, stats, v.fmt, saturate=v.saturate, rule=v.rules[0],
                             tensor_scales=tensor_scales, headroom=v.headroom,
                             weights=weights).model
    emulated = on_target(built, wide, pinned, saturate=wide_saturate)
    if stop_past is not None and not top_k:
        return check_until(emulated, samples, expected, rtol=rtol, stop_past=stop_past)
    return check_output_sets(reference, built, wide, [samples], saturate=wide_saturate,
                             rtol=rtol, top_k=top_k, margin=margin, expected=expected,
                             emulated=emulated)[0]


def within(check: OutputCheck, rtol: float) -> bool:
    """Every output within `rtol` (decided outputs: their decisions held at the margin)."""
    return all(output_passes(o, rtol, at_margin=True) for o in check.outputs.values())


def plain_point(starts: Sequence[tuple[Sequence[LayerPrecision], OutputCheck, str]],
                macs: Mapping[str, int], *, rtol: float, min_share: float,
                passes: Callable[[OutputCheck], bool]) -> list[Widening]:
    """The starts (layers, check, their conversion's format) kept as they are: within
    PLAIN_MARGIN x `rtol` with at least `min_share` of the multiply-adds in 8 bits, each a
    point of one trial; `passes(check)` says whether it met the search's aim (for its curve)."""
    kept = []
    for layers, check, fmt in starts:
        share = eight_bit_share(layers, macs)
        if within(check, PLAIN_MARGIN * rtol) and share >= min_share:
            point = CurvePoint(0, fmt, share, check.worst_rel_l2, passes(check))
            kept.append(Widening(list(layers), check, curve=[point]))
    return kept


def plain_note(point: Widening, rtol: float) -> str:
    """What keeping the plain start means, in a note."""
    return (f"every 8-bit layer at its start ({point.curve[0].share:.1%} of the multiply-adds), "
            f"at its format's default scale rule with weights rounded to nearest, errs "
            f"{point.check.worst_rel_l2:.3g} on the calibration samples, under "
            f"{PLAIN_MARGIN:g}x the gate ({rtol:g}): kept as it is, nothing balanced, rounded or "
            "searched (--search always runs them)")
