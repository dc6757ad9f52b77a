"""Which 8-bit layers take their input in two INT8 passes (npuprep.rewrite.input_split).

A layer whose input's level differs between samples by more than one INT8 scale resolves
(LEVEL_SPREAD: its quietest sample would get a few of the 255 levels) and that errs past the
aim alone in every 8-bit format the target runs, on its loudest and quietest samples, is
split where the pair alone in INT8 errs less there. The samples are read one at a time, not
pooled: silero_vad's STFT Conv in FP8 errs 0.175 on its loudest calibration chunk and 0.037
pooled over all 32, which hides it, and its held-out set, half speech, errs 0.09.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import onnx

from npuprep.calibrate.mapping import scaled_stats
from npuprep.calibrate.stats import CalibrationStats
from npuprep.data import Feed
from npuprep.graph import node_scopes
from npuprep.ops import QUANTISED_MAC_OPS
from npuprep.plan.layer_precision import LayerPrecision, activation_inputs
from npuprep.rewrite.input_split import split_input
from npuprep.rewrite.qdq_weights import WeightStore
from npuprep.scale_rules import ScaleRule
from npuprep.verify.qdq_model import activation_scale
from npuprep.verify.qdq_trials import RunsFactory, Variant, errors_alone

# Largest over smallest per-sample abs-max of a layer's input past which one INT8 scale
# leaves the quietest sample at most 127 / 16 = 8 levels.
LEVEL_SPREAD = 16.0
# The loudest and the quietest samples of each candidate's input are measured.
EXTREMES = 2


@dataclass(frozen=True)
class Splits:
    """The model with the chosen layers split, its stats (the new tensors measured), each
    split layer's decision, its residual pass's (by the split layer), and a note per layer
    tried."""

    model: onnx.ModelProto
    stats: CalibrationStats
    layers: dict[str, LayerPrecision]
    residuals: dict[str, LayerPrecision]
    notes: tuple[str, ...] = ()


def split_wide_inputs(reference: onnx.ModelProto, model: onnx.ModelProto,
                      layers: Sequence[LayerPrecision], stats: CalibrationStats,
                      samples: Sequence[Feed], variants: Sequence[Variant], *, aim: float,
                      tensor_scales: Mapping[str, float], weights: WeightStore, path: str = "",
                      runs: RunsFactory | None = None) -> Splits:
    """The 8-bit `layers` of `model` whose input spreads past LEVEL_SPREAD and that err past
    `aim` alone in each of `variants` (the target's 8-bit formats) on their input's loudest
    and quietest samples, split into two INT8 passes where the pair alone errs less there."""
    from npuprep.calibrate.executors import calibrate
    from npuprep.model_io import Model, uses_external_data

    int8 = next((v for v in variants if not v.fmt.is_float), None)
    if int8 is None:
        return Splits(model, stats, {}, {})
    # Abs-max scales for the measurement: a clip below it cuts the loud samples measured here.
    exact = Variant(int8.fmt, (ScaleRule.ABSMAX,), True, int8.headroom)
    scopes = node_scopes(model.graph)
    chosen: dict[str, LayerPrecision] = {}
    residuals: dict[str, LayerPrecision] = {}
    notes: list[str] = []
    for layer in layers:
        if layer.precision not in {v.fmt.name for v in variants} or layer.node not in scopes:
            continue
        node, (g, *outer) = scopes[layer.node]
        inputs = activation_inputs(g, node, outer)
        if node.op_type not in QUANTISED_MAC_OPS or inputs != [node.input[0]]:
            continue
        r = stats.tensors.get(inputs[0])
        # One abs-max per sample (a Loop body's tensor has one per iteration: not read here).
        levels = list(r.per_sample_absmax) if r is not None else []
        if (len(levels) != len(samples) or len(levels) < 2
                or not all(math.isfinite(v) and v > 0 for v in levels)
                or max(levels) < LEVEL_SPREAD * min(levels)):
            continue
        order = sorted(range(len(levels)), key=lambda i: levels[i])
        extremes = [samples[i] for i in sorted({*order[:EXTREMES], *order[-EXTREMES:]})]

        def worst(m: onnx.ModelProto, s: CalibrationStats, group: list[str], v: Variant,
                  feeds: Sequence[Feed] = extremes) -> float:
            return max(errors_alone(reference, m, [group], s, v, [feed],
                                    tensor_scales=tensor_scales, weights=weights, runs=runs)[0]
                       for feed in feeds)

        own = {v.fmt.name: worst(model, stats, [layer.node], v) for v in variants}
        if min(own.values()) <= aim:
            continue
        # The input's values as the rewritten model holds them (a rescaled tensor's stats are
        # those measured, its factor in `tensor_scales`), its abs-max scale as its pair takes it.
        values = scaled_stats(r, tensor_scales.get(inputs[0], 1.0))
        done = split_input(model, layer.node,
                           activation_scale(values, int8.fmt, ScaleRule.ABSMAX, 1.0,
                                            int8.headroom), int8.fmt)
        if not done:
            continue
        rounded, residual = str(done.details["rounded"]), str(done.details["residual"])
        part = str(done.details["layer"])
        home = path if uses_external_data(done.model) else ""
        again = calibrate(Model(done.model, home, "split"), samples, detail="all",
                          tensors=[residual, *done.details["parts"]]).tensors  # type: ignore[misc]
        # The rounded part is on INT8's grid at `scale` already: its own pair must keep that
        # scale (abs-max; no histogram, so no rule clips it).
        new_stats = replace(stats, tensors={
            **stats.tensors, **again,
            rounded: replace(values, tensor=rounded, exp_hist={}, over={}, under={},
                             zero_count=0, detailed_count=0)})
        pair = worst(done.model, new_stats, [layer.node, part], exact)
        said = ", ".join(f"{k} {e:.3g}" for k, e in own.items())
        if pair >= min(own.values()):
            notes.append(f"{layer.node}: its input spans {max(levels) / min(levels):.0f}x "
                         f"between samples; alone on the loudest and quietest: {said}, as two "
                         f"INT8 passes {pair:.3g}: not split")
            continue
        model, stats = done.model, new_stats
        scopes = node_scopes(model.graph)
        why = (f"its input spans {max(levels) / min(levels):.0f}x between samples, more than "
               f"one 8-bit scale holds (alone on the loudest and quietest: {said}): two INT8 "
               f"passes, the input rounded and its residual ({pair:.3g})")
        chosen[layer.node] = LayerPrecision(layer.node, int8.fmt.name, why)
        residuals[layer.node] = LayerPrecision(part, int8.fmt.name,
                                               f"the residual pass of {layer.node}")
        notes.append(f"{layer.node}: {why}")
    return Splits(model, stats, chosen, residuals, tuple(notes))
