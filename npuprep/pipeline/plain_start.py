"""The plain start, kept as it is where it errs well within the gate, or widened plain.

    every decided layer 8-bit, default rule, weights at nearest -> within PLAIN_MARGIN x rtol?
        -> kept (no balancing, rounding or search); within PLAIN_NEAR x rtol? -> its ranking's
        heads kept wider while PLAIN_SHARE stays 8-bit -> within PLAIN_MARGIN x rtol? -> kept;
        else the search

The 8-bit search's stages (outlier and Conv balancing, equalisation, weight rounding, the
rule choice, bias correction) cost tens to hundreds of trial runs. Where the start they would
improve already errs under half the gate on the calibration samples, they buy margin the
conversion does not need, at 5x its time (convnext_t INT8: 136 CPU s with them, its plain
start 0.023 / 0.029 held out in ~20). The search aims at JUDGE_MARGIN x rtol; a start kept
untreated aims lower, as unseen samples err more on a model nothing was fitted to (face_landmark
INT8: 0.023 on calibration, 0.044 held out). A start a little past the gate often errs in one or
two layers: the plain start's own ranking, its heads kept wider (or in the target's other 8-bit
format), costs a ranking and a few checks where the treatments cost hundreds of runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx

from npuprep.calibrate.stats import CalibrationStats
from npuprep.data import Feed
from npuprep.detections import Decision
from npuprep.numerics import EightBitFormat, NumberFormat
from npuprep.pipeline.eight_bit_choice import eight_bit_share
from npuprep.pipeline.trial_sessions import TrialSessions, assigned_formats
from npuprep.pipeline.widen_on import widen_on
from npuprep.plan.layer_precision import LayerPrecision
from npuprep.rewrite.qdq_weights import WeightStore
from npuprep.verify.bounded_trials import errors_within
from npuprep.verify.output_check import OutputCheck, check_output_sets, check_until
from npuprep.verify.output_errors import output_passes
from npuprep.verify.qdq_model import eight_bit_nodes, on_target, quantise
from npuprep.verify.qdq_trials import Variant
from npuprep.verify.widening import CurvePoint, Widening

# The share of rtol under which the plain start is kept as it is (the search aims at 0.8).
PLAIN_MARGIN = 0.5
# A start within this x rtol (a decided output: its decisions held, not at the margin), short
# of the search's aim, is widened plain before anything is treated (ddddocr_ocr INT8: texts
# held, 99.0% in 11 CPU s where the search took 22 for 100%). Not one past the gate: unet_tiny
# INT8 (0.055) spent 44 CPU s ranking and widening its plain start, which 2% of its
# multiply-adds kept wider did not hold ...
PLAIN_NEAR = 1.0
# ... its heads keeping at least this share of the multiply-adds in 8 bits: the treatments
# (--search always) may keep more, so the plain point is kept only within this of all.
PLAIN_SHARE = 0.98


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


def near(check: OutputCheck, rtol: float) -> bool:
    """A start worth widening plain: every output within PLAIN_NEAR x `rtol` (decided
    outputs: their decisions held)."""
    return all(output_passes(o, PLAIN_NEAR * rtol) for o in check.outputs.values())


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


def plain_search(sessions: TrialSessions, start: Sequence[LayerPrecision], check: OutputCheck,
                 fmt: EightBitFormat, alternative: EightBitFormat | None,
                 macs: Mapping[str, int], *, rtol: float, min_share: float,
                 top_k: Mapping[str, Decision], margin: float,
                 stage: Callable[[str], None]) -> tuple[Widening | None, int]:
    """The plain `start` (its `check`, near the gate) widened by its own ranking in
    `sessions` (built on the untreated model, each format's default rule, weights at nearest,
    no bias correction), its heads first in the `alternative` format, while PLAIN_SHARE
    (or `min_share`) of the multiply-adds stays in 8 bits; decisions checked also at
    `margin`. The point where it errs within PLAIN_MARGIN x `rtol` (else None), and the
    trial runs it took; `sessions` closed."""
    aim, floor = PLAIN_MARGIN * rtol, max(min_share, PLAIN_SHARE)

    def passes(c: OutputCheck) -> bool:
        return within(c, aim)

    widening = widen_on(sessions, start, fmt, check, own=True, rules={}, macs=macs, rtol=rtol,
                        top_k=top_k, margin=margin, judged=passes, aim=aim, gate=None,
                        fail_past=aim, min_share=floor, alternative=alternative, stage=stage,
                        of=" of the plain start")
    sessions.close()
    kept = passes(widening.check) and eight_bit_share(widening.layers, macs) >= floor
    return (widening if kept else None), sessions.runs


def plain_note(point: Widening, rtol: float, share: float) -> str:
    """What keeping the plain start (or its plain widening, `share` of the multiply-adds in
    8 bits) means, in a note."""
    wider = (f", but {len(point.widened)} layer(s) kept wider ({', '.join(point.widened[:3])}"
             f"{' ...' if len(point.widened) > 3 else ''})" if point.widened else "")
    moved = (f", {len(point.alternative)} in the other 8-bit format" if point.alternative
             else "")
    worst, gate = point.check.worst_rel_l2, f"{PLAIN_MARGIN:g}x the gate ({rtol:g})"
    held = (f"errs {worst:.3g} on the calibration samples, under {gate}"
            if worst <= PLAIN_MARGIN * rtol else
            f"holds its decisions on the calibration samples at the search's margin (rel L2 "
            f"{worst:.3g}; any output judged by rel L2 alone errs under {gate})")
    return (f"every 8-bit layer at its start{wider}{moved} ({share:.1%} of the multiply-adds), "
            f"at its format's default scale rule with weights rounded to nearest, {held}: kept "
            "as it is, nothing balanced, rounded or searched (--search always runs them)")


def each_in_its_better_format(sessions: TrialSessions, fp8_start: Sequence[LayerPrecision],
                              fp8_check: OutputCheck, int8_held: set[str], *, rtol: float,
                              top_k: Mapping[str, Decision], margin: float,
                              passes: Callable[[OutputCheck], bool], target: str
                              ) -> tuple[tuple[LayerPrecision, ...], str]:
    """An INT8 conversion's start from `fp8_start` (every layer FP8 can hold in FP8, its check
    `fp8_check` meeting the aim): each layer INT8 also holds (`int8_held`) in INT8 where its
    error alone there is no more than in FP8 (one run each per format, untreated, on
    `sessions`), kept where those layers together still `passes`, else every layer in FP8; and
    a note. `sessions` closed."""
    movable = [x.node for x in fp8_start if x.node in int8_held and x.precision == "fp8_e4m3"]
    trials = sessions.checks()
    fp8 = trials.errors([({n: "fp8_e4m3"}, {}) for n in movable])
    # A layer's INT8 run stops once it errs more than in FP8 (dnsmos_p835 moves none back).
    int8 = errors_within(trials, [({n: "int8"}, {}) for n in movable], fp8)
    better = {n for n, a, b in zip(movable, int8, fp8, strict=True) if a <= b}
    mixed = [LayerPrecision(x.node, "int8", x.why) if x.node in better else x for x in fp8_start]
    held = bool(better) and passes(trials.check(assigned_formats(mixed), {}, rtol=rtol,
                                                top_k=top_k, margin=margin))
    sessions.close()
    return tuple(mixed if held else fp8_start), (
        f"every layer in fp8_e4m3 meets the search's aim on the calibration samples "
        f"({fp8_check.worst_rel_l2:.3g}), every layer in int8 errs past the gate: the search "
        f"starts from fp8_e4m3, {len(better) if held else 0} layer(s) back in int8 where each "
        f"errs no more there alone ({target} runs both)")
