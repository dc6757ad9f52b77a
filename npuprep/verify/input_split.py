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
from npuprep.calibrate.stats import CalibrationStats, RangeStats
from npuprep.data import Feed
from npuprep.graph import node_scopes
from npuprep.ops import QUANTISED_MAC_OPS
from npuprep.plan.layer_precision import RESIDUAL_OF, LayerPrecision, activation_inputs
from npuprep.rewrite.input_split import split_input
from npuprep.rewrite.qdq_weights import WeightStore
from npuprep.scale_rules import ScaleRule
from npuprep.verify.qdq_model import activation_scale
from npuprep.verify.qdq_trials import RunsFactory, Variant, errors_alone_each

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


@dataclass(frozen=True)
class _Candidate:
    """An 8-bit layer whose one activation input spreads past LEVEL_SPREAD: that input's
    stats, its per-sample abs-max, and the samples read for it (its loudest and quietest)."""

    layer: str
    tensor: str
    stats: RangeStats
    spread: float
    extremes: tuple[int, ...]


def split_wide_inputs(reference: onnx.ModelProto, model: onnx.ModelProto,
                      layers: Sequence[LayerPrecision], stats: CalibrationStats,
                      samples: Sequence[Feed], variants: Sequence[Variant], *, aim: float,
                      tensor_scales: Mapping[str, float], weights: WeightStore, path: str = "",
                      runs: RunsFactory | None = None) -> Splits:
    """The 8-bit `layers` of `model` whose input spreads past LEVEL_SPREAD and that err past
    `aim` alone in each of `variants` (the target's 8-bit formats) on their input's loudest
    and quietest samples, split into two INT8 passes where the pair alone errs less there.
    Every candidate is measured in one session per sample and format (its trials' groups)."""
    int8 = next((v for v in variants if not v.fmt.is_float), None)
    found = _candidates(model, layers, stats, samples, {v.fmt.name for v in variants})
    if int8 is None or not found:
        return Splits(model, stats, {}, {})

    def worst(m: onnx.ModelProto, s: CalibrationStats, cands: Sequence[_Candidate],
              groups: list[list[str]], v: Variant) -> list[float]:
        """Each group alone in `v`: its candidate's worst sample, each sample read alone."""
        read = sorted({i for c in cands for i in c.extremes})
        each = errors_alone_each(reference, m, groups, s, v, [samples[i] for i in read],
                                 tensor_scales=tensor_scales, weights=weights, runs=runs)
        at = {i: k for k, i in enumerate(read)}
        return [max(each[k][at[i]] for i in c.extremes) for k, c in enumerate(cands)]

    by_format = {v.fmt.name: worst(model, stats, found, [[c.layer] for c in found], v)
                 for v in variants}
    own = [{f: errors[k] for f, errors in by_format.items()} for k in range(len(found))]
    wide = [c for c, o in zip(found, own, strict=True) if min(o.values()) > aim]
    if not wide:
        return Splits(model, stats, {}, {})
    # Abs-max scales for the pairs: a clip below it cuts the loud samples measured here.
    exact = Variant(int8.fmt, (ScaleRule.ABSMAX,), True, int8.headroom)
    split = _split(model, wide, stats, samples, int8, tensor_scales, path)
    pairs = dict(zip((c.layer for c in wide), worst(
        split.model, split.stats, wide, [[c.layer, split.residuals[c.layer].node] for c in wide],
        exact), strict=True))
    errors = {c.layer: o for c, o in zip(found, own, strict=True)}
    kept = [c for c in wide if pairs[c.layer] < min(errors[c.layer].values())]
    notes = []
    for c in wide:
        said = ", ".join(f"{f} {e:.3g}" for f, e in errors[c.layer].items())
        notes.append(f"{c.layer}: its input spans {c.spread:.0f}x between samples, more than one "
                     f"8-bit scale holds (alone on its loudest and quietest: {said}); as two "
                     f"INT8 passes, the input rounded and its residual: {pairs[c.layer]:.3g}"
                     + ("" if c in kept else ": not split"))
    if len(kept) < len(wide):
        split = _split(model, kept, stats, samples, int8, tensor_scales, path) if kept else (
            Splits(model, stats, {}, {}))
    return replace(split, notes=tuple(notes))


def _candidates(model: onnx.ModelProto, layers: Sequence[LayerPrecision],
                stats: CalibrationStats, samples: Sequence[Feed],
                formats: set[str]) -> list[_Candidate]:
    scopes = node_scopes(model.graph)
    found = []
    for layer in layers:
        if layer.precision not in formats or layer.node not in scopes:
            continue
        node, (g, *outer) = scopes[layer.node]
        inputs = activation_inputs(g, node, outer)
        if node.op_type not in QUANTISED_MAC_OPS or inputs != [node.input[0]]:
            continue
        r = stats.tensors.get(inputs[0])
        # One abs-max per sample (a Loop body's tensor has one per iteration: not read here).
        levels = list(r.per_sample_absmax) if r is not None else []
        if (r is None or len(levels) != len(samples) or len(levels) < 2
                or not all(math.isfinite(v) and v > 0 for v in levels)
                or max(levels) < LEVEL_SPREAD * min(levels)):
            continue
        order = sorted(range(len(levels)), key=lambda i: levels[i])
        found.append(_Candidate(layer.node, inputs[0], r, max(levels) / min(levels),
                                tuple(sorted({*order[:EXTREMES], *order[-EXTREMES:]}))))
    return found


def _split(model: onnx.ModelProto, chosen: Sequence[_Candidate], stats: CalibrationStats,
           samples: Sequence[Feed], int8: Variant, tensor_scales: Mapping[str, float],
           path: str) -> Splits:
    """`model` with every one of `chosen` split, the new tensors measured (one calibration)."""
    from npuprep.calibrate.executors import calibrate
    from npuprep.model_io import Model, uses_external_data

    decided: dict[str, LayerPrecision] = {}
    residuals: dict[str, LayerPrecision] = {}
    measure: list[str] = []
    rounded: dict[str, RangeStats] = {}
    for c in chosen:
        # The input's values as the rewritten model holds them (a rescaled tensor's stats are
        # those measured, its factor in `tensor_scales`), its abs-max scale as its pair takes it.
        values = scaled_stats(c.stats, tensor_scales.get(c.tensor, 1.0))
        done = split_input(model, c.layer, activation_scale(values, int8.fmt, ScaleRule.ABSMAX,
                                                            1.0, int8.headroom), int8.fmt)
        model = done.model
        name = str(done.details["rounded"])
        # The rounded part is on INT8's grid at that scale: its own pair keeps it (abs-max; no
        # histogram, so no rule clips it).
        rounded[name] = replace(values, tensor=name, exp_hist={}, over={}, under={},
                                zero_count=0, detailed_count=0)
        measure += [str(done.details["residual"]), *done.details["parts"]]  # type: ignore[misc]
        part = str(done.details["layer"])
        decided[c.layer] = LayerPrecision(c.layer, int8.fmt.name, f"its input spans "
                                          f"{c.spread:.0f}x between samples: two INT8 passes, "
                                          f"the input rounded and its residual ({part})")
        residuals[c.layer] = LayerPrecision(part, int8.fmt.name, RESIDUAL_OF + c.layer)
    home = path if uses_external_data(model) else ""
    again = calibrate(Model(model, home, "split"), samples, detail="all", tensors=measure).tensors
    return Splits(model, replace(stats, tensors={**stats.tensors, **again, **rounded}), decided,
                  residuals)


def planned_splits(model: onnx.ModelProto, layers: Sequence[LayerPrecision],
                   stats: CalibrationStats, samples: Sequence[Feed], variants: Sequence[Variant],
                   *, tensor_scales: Mapping[str, float], path: str = "") -> Splits:
    """The splits a given plan records (a residual pass in its `eight_bit` list, as convert
    wrote it), made again without measuring: the plan decided them."""
    int8 = next((v for v in variants if not v.fmt.is_float), None)
    split = {x.why[len(RESIDUAL_OF):] for x in layers if x.why.startswith(RESIDUAL_OF)}
    scopes = node_scopes(model.graph)
    chosen = []
    for layer in split & set(scopes):
        node, _ = scopes[layer]
        r = stats.tensors.get(node.input[0])
        if r is not None:
            chosen.append(_Candidate(layer, node.input[0], r, 0.0, ()))
    if int8 is None or not chosen:
        return Splits(model, stats, {}, {})
    done = _split(model, chosen, stats, samples, int8, tensor_scales, path)
    # The plan's own lines stand (its reasons, as the user left them).
    return replace(done, layers={}, residuals={})
