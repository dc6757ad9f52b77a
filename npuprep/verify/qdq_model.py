"""The QDQ model the plan's 8-bit decisions give (`quantise`), and `Sensitivity`: what
keeping one 8-bit layer wider gains, every other layer quantised (npuprep.verify.qdq_trials
measures it on one session).

Leaving one layer out of the full 8-bit model, rather than quantising it alone, sees errors
that cancel: the two branches of a classifier-free guidance err alike, and keeping only one
of them wider undoes the cancellation (alone, each looks like the worst layer). Also here:
the INT8 activation scales (symmetric, or uint8 with a zero point for a skewed tensor), the
outlier channels balanced into weights and Conv inputs' channels equalised into their
producers where that measures better, and the QDQ model as the
board computes it (`on_target`: the wider layers in FP16).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx

from npuprep.calibrate.scales import clip_for, clip_raise_factor, stored_as
from npuprep.calibrate.stats import CalibrationStats, RangeStats
from npuprep.data import Feed
from npuprep.graph import attribute, constant_value, node_label, node_scopes, walk_graphs
from npuprep.numerics import EightBitFormat, NumberFormat
from npuprep.opsets import model_opset, upgrade_opset
from npuprep.plan.layer_precision import LayerPrecision, activation_inputs
from npuprep.rewrite.bias_correction import BiasSlot, with_biases
from npuprep.rewrite.equalise import Chain
from npuprep.rewrite.qdq import ActivationScale, dequantised_weight, insert_qdq
from npuprep.rewrite.qdq_weights import WeightStore
from npuprep.rewrite.result import RewriteResult
from npuprep.rewrite.shift import centred_bias
from npuprep.scale_rules import DEFAULT_RULE, ScaleRule
from npuprep.verify.output_errors import worst_pooled_rel_l2

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
# An INT8 MatMul input whose largest channel reaches this many times its median channel has
# outlier channels worth balancing into the weight (npuprep.rewrite.smooth).
OUTLIER_RATIO = 4.0
# Samples each equalisation trial is measured on: it needs an order, not a verdict.
RANK_SAMPLES = 4


@dataclass(frozen=True)
class Sensitivity:
    """One 8-bit layer's weight in the error: the outputs' pooled rel L2 with every other
    ranked layer in 8 bits and this one wider, what that gains over all of them in 8 bits
    (negative where keeping it wider alone undoes a cancellation), and the outputs' rel L2
    with this layer alone in 8 bits (`alone`; None where not measured)."""

    node: str
    rel_l2: float
    gain: float
    alone: float | None = None

    @property
    def cancels(self) -> bool:
        """Keeping it wider alone raises the error by more than half its own error: it
        cancels another layer's (a guidance branch), and widening it first would hurt."""
        return self.gain < 0 and (self.alone is None or -self.gain > self.alone / 2)

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "rel_l2": self.rel_l2, "gain": self.gain, "alone": self.alone}


def eight_bit_nodes(layers: Iterable[LayerPrecision], fmt: EightBitFormat) -> list[str]:
    return [x.node for x in layers if x.precision == fmt.name]


def with_opset(model: onnx.ModelProto, fmt: EightBitFormat) -> onnx.ModelProto:
    """`model` at an opset whose QuantizeLinear takes `fmt` per channel (a copy if upgraded)."""
    if model_opset(model) >= fmt.min_opset:
        return model
    return upgrade_opset(model, fmt.min_opset, why=f"{fmt.name} QDQ needs opset {fmt.min_opset}")


def quantise(model: onnx.ModelProto, nodes: Sequence[str], stats: CalibrationStats, fmt: EightBitFormat, *,
             saturate: bool, rule: ScaleRule = DEFAULT_RULE,
             tensor_scales: Mapping[str, float] | None = None, headroom: float = 1.0,
             tensor_rules: Mapping[str, ScaleRule] | None = None,
             weights: WeightStore | None = None,
             centred_means: Mapping[str, np.ndarray] | None = None) -> RewriteResult:
    """`model` (at a QDQ opset) with `nodes` quantised: activation scales by `rule` (or the
    tensor's own in `tensor_rules`) from `stats`; a tensor the plan rescaled (`tensor_scales`:
    rewritten = s x measured) gets s x its clip, and every clip is widened by `headroom`
    (values of the quantised model reach past FP32's). `weights`: the conversion's store of
    8-bit weights (npuprep.rewrite.qdq_weights), shared by every model it builds.
    `centred_means`: layer -> the per-channel mean of its input, centred by
    npuprep.rewrite.shift: its bias follows its 8-bit weight (centred_bias)."""
    own = tensor_rules or {}
    rescaled = tensor_scales or {}
    scopes = node_scopes(model.graph)  # a layer of a body reads its weight from outside
    wanted: dict[str, dict[str, ActivationScale]] = {}
    for label in nodes:
        if label not in scopes:
            continue
        node, (g, *outer) = scopes[label]
        wanted[label] = {name: activation_scale(stats.tensors[name], fmt, own.get(name, rule),
                                                rescaled.get(name, 1.0), headroom)
                         for name in activation_inputs(g, node, outer)}
    done = insert_qdq(model, wanted, fmt, saturate=saturate, weights=weights)
    fixes = [fixed for label in wanted if label in (centred_means or {})
             if (fixed := _centred_8bit_bias(model, label, fmt, saturate, weights or WeightStore(),
                                             (centred_means or {})[label])) is not None]
    return replace(done, model=with_biases(done.model, fixes)) if fixes else done


def _centred_8bit_bias(model: onnx.ModelProto, label: str, fmt: EightBitFormat, saturate: bool,
                       weights: WeightStore, centred_mean: np.ndarray
                       ) -> tuple[BiasSlot, np.ndarray] | None:
    node = next((n for n in model.graph.node if node_label(n) == label), None)
    w = None if node is None else constant_value(model.graph, node.input[1])
    if node is None or w is None:
        return None
    return centred_bias(model.graph, node, dequantised_weight(node, w, fmt, saturate=saturate,
                                                              weights=weights), centred_mean)


def activation_scale(r: RangeStats, fmt: EightBitFormat, rule: ScaleRule, rescaled: float = 1.0,
                     headroom: float = 1.0) -> ActivationScale:
    """The scale of activation `r` by `rule`: its clip times the plan's rescale factor
    `rescaled` and the unseen samples' headroom (clip_raise_factor)."""
    factor = rescaled * clip_raise_factor(r, fmt, headroom)
    clip = clip_for(r, fmt, rule).value * factor
    return _activation_scale(r, clip, factor, fmt)


@dataclass(frozen=True)
class Balanced:
    """The model with outlier channels balanced into weights, its stats (with the new tensors),
    the tensors balanced: x -> (x / s, largest / median channel abs-max), and those divided by
    a Mul over the whole tensor, and each tensor of the model that keeps its name with its
    values rescaled -> the factor it was multiplied by (broadcast against it); `unseen_raise`:
    each tensor read balanced whose clip keeps more headroom than its samples' spread gives ->
    that factor (RangeStats.unseen_raise)."""

    model: onnx.ModelProto
    stats: CalibrationStats
    tensors: dict[str, tuple[str, float]]
    whole: tuple[str, ...] = ()
    channel_scales: dict[str, np.ndarray] = field(default_factory=dict)
    unseen_raise: dict[str, float] = field(default_factory=dict)


# (model, its stats, groups of layers, samples, bounds) -> the outputs' error with each group
# alone in 8 bits on those samples (npuprep.verify.qdq_trials.errors_alone: one session for
# every group); past a group's bound (where bounds are given) a lower bound past it will do.
ErrorsAlone = Callable[[onnx.ModelProto, CalibrationStats, list[list[str]], Sequence[Feed],
                        Sequence[float] | None], list[float]]


Balancing = Callable[[slice, Iterable[str]], tuple[RewriteResult, CalibrationStats]]


def _kept_where_unfitted_err_less(model: onnx.ModelProto, stats: CalibrationStats,
                                  tensors: list[str], groups: list[list[str]], fitted: slice,
                                  check: Sequence[Feed], balanced: Balancing,
                                  measure: ErrorsAlone) -> tuple[RewriteResult, CalibrationStats]:
    """`balanced` over the `tensors` whose readers (`groups`, quantised alone) err less on the
    `check` samples with factors fitted on the `fitted` ones than without; those kept are
    fitted again on every calibration sample."""
    every, every_stats = balanced(fitted, tensors)
    after = measure(every.model, every_stats, groups, check, None)
    # Without: a group's runs stop once it errs more than balanced (a lower bound will do).
    before = measure(model, stats, groups, check, after)
    return balanced(slice(None), [x for x, a, b in zip(tensors, after, before, strict=True)
                                  if a < b])


def balance_outliers(model: onnx.ModelProto, nodes: Sequence[str], stats: CalibrationStats,
                     samples: Sequence[Feed], *, measure: ErrorsAlone,
                     weights: WeightStore | None = None) -> Balanced:
    """The INT8 MatMuls among `nodes` whose input has outlier channels read it divided by s
    per channel, their weights multiplied by it (npuprep.rewrite.smooth), where that lowers
    the error of those MatMuls quantised alone (`measure`, abs-max scales) on calibration
    samples the factors and scales were not fitted to. A channel whose outliers are a few
    rare values is better served by the clip of the rule, which the balanced tensor (abs-max
    only) cannot place; and factors fitted to the channels a few samples happened to raise
    clip the next sample's other channels (unet_tiny's context: fitted on all 8 calibration
    samples and measured on 4 of them it was kept, and 2 of 4 held-out samples erred
    0.46-0.56 against 0.06 without)."""
    from npuprep.calibrate.channels import channel_absmax
    from npuprep.rewrite.smooth import smooth, smoothable, smoothing_factors

    g = model.graph
    wanted = set(nodes)
    readers: dict[str, list[str]] = {}
    for node in g.node:
        if node_label(node) in wanted and node.op_type == "MatMul" and smoothable(g, node) \
                and node.input[0] in stats.tensors:
            readers.setdefault(node.input[0], []).append(node_label(node))
    per_channel = channel_absmax(model, list(readers), samples)
    by_label = {node_label(n): n for n in g.node}
    outliers = {}
    for x, found in per_channel.items():
        top = found.max(axis=0)
        ratio = float(top.max() / max(float(np.median(top)), 1e-12))
        if ratio >= OUTLIER_RATIO:
            outliers[x] = ratio
    if not outliers:
        return Balanced(model, stats, {})
    place = weights.place if weights is not None else None
    # Fitted on the even calibration samples, factors and abs-max scales alike, and measured
    # on the odd ones, balanced and not: the odd samples stand for unseen ones.
    fitted, check = (slice(0, None, 2), list(samples[1::2])) if len(samples) > 1 else (
        slice(None), list(samples))

    def balanced(rows: slice, tensors: Iterable[str]) -> tuple[RewriteResult, CalibrationStats]:
        # Only these readers' weights, one tensor's at a time: not every 8-bit weight at once.
        factors = {x: smoothing_factors(per_channel[x][rows].max(axis=0),
                                        [constant_value(g, by_label[n].input[1]) for n in readers[x]])
                   for x in tensors}
        done = smooth(model, factors, readers, place=place)
        found = dict(stats.tensors)
        for x, xs in dict(done.details.get("smoothed", {})).items():
            found[xs] = _divided(stats.tensors[x], xs, per_channel[x][rows] / factors[x])
        return done, replace(stats, tensors=found)

    # Each tensor's readers quantised alone, balanced and not: two trial sessions, every
    # tensor's trial a run of them (a session per trial cost MiniLM 12-14 CPU s).
    unbalanced = replace(stats, tensors={**stats.tensors, **{
        x: _divided(stats.tensors[x], x, per_channel[x][fitted]) for x in outliers}})
    done, done_stats = _kept_where_unfitted_err_less(model, unbalanced, list(outliers),
                                                     [readers[x] for x in outliers], fitted,
                                                     check, balanced, measure)
    if not done:
        return Balanced(model, stats, {})
    return Balanced(done.model, done_stats, {x: (xs, outliers[x]) for x, xs in
                                             dict(done.details["smoothed"]).items()},
                    channel_scales=dict(done.details["factors"]))


def balance_conv_inputs(model: onnx.ModelProto, nodes: Sequence[str], stats: CalibrationStats,
                        samples: Sequence[Feed], *, measure: ErrorsAlone,
                        left_alone: Collection[str], path: str = "",
                        weights: WeightStore | None = None,
                        measured: Measured | None = None) -> Balanced:
    """The INT8 Convs among `nodes` read their input divided by s per channel, their weights'
    input channels multiplied by it (npuprep.rewrite.smooth: folded into the op writing the
    input where it multiplies by a constant), where that lowers the error of the tensor's
    readers quantised alone (`measure`, at their rule) on the calibration samples neither the
    factors nor the clips (the unbalanced tensor's too) were fitted to; where the balanced
    tensor with the headroom a sample left out of the fit shows (RangeStats.unseen_raise)
    errs no more there, it keeps that headroom. The tensors it changes are calibrated
    again (every rule reads their own histogram): ddddocr_det's balanced Conv inputs with
    abs-max stats only lost their percentile and MSE clips, held-out 0.054 -> 0.111. The
    tensors `left_alone` (the plan rescaled them, or equalisation took them) stay. `path`: the
    file whose folder holds the weights a light load left external. `measured`: what
    equalisation measured, read where it measured this very model. Balanced.tensors: x -> (what the readers read, largest / median
    channel abs-max); Balanced.whole: those divided by a Mul over the whole of x (its writer
    takes no constant: a SiLU's, or x is read elsewhere), an elementwise pass over x at run
    time."""
    from npuprep.calibrate.channels import channel_absmax, leave_one_out_raise
    from npuprep.flops import tensor_shapes
    from npuprep.rewrite.smooth import conv_smoothing_factors, smooth, smoothable

    g = model.graph
    wanted = set(nodes)
    readers: dict[str, list[str]] = {}
    for node in g.node:
        if node_label(node) in wanted and node.op_type == "Conv" and smoothable(g, node) \
                and node.input[0] in stats.tensors and node.input[0] not in left_alone:
            readers.setdefault(node.input[0], []).append(node_label(node))
    if not readers:
        return Balanced(model, stats, {})
    # What equalisation measured of this model (it kept nothing) is not measured again.
    known = measured if measured is not None and measured.model is model else Measured(model)
    reused = {x: known.channels[x] for x in readers if x in known.channels}
    per_channel = {**reused, **channel_absmax(model, [x for x in readers if x not in reused],
                                              samples, axis=1)}
    by_label = {node_label(n): n for n in g.node}
    place = weights.place if weights is not None else None
    fitted, check = (slice(0, None, 2), list(samples[1::2])) if len(samples) > 1 else (
        slice(None), list(samples))
    shapes = tensor_shapes(model, {k: tuple(np.shape(v)) for k, v in samples[0].items()})
    sizes = {t: int(np.prod(d)) for t, d in shapes.items()}

    def divisor(x: str) -> Callable[[np.ndarray], np.ndarray]:
        weights = [(constant_value(g, by_label[n].input[1]), attribute(by_label[n], "group", 1))
                   for n in readers[x]]
        return lambda top: conv_smoothing_factors(top, weights)

    def lifted(done: RewriteResult, found: CalibrationStats, rows: slice,
               raised: Collection[str]) -> CalibrationStats:
        """`found` where what the readers of the `raised` tensors read keeps the headroom a
        sample left out of the fit (samples[rows]) shows."""
        tensors = dict(found.tensors)
        for x, xs in dict(done.details.get("smoothed", {})).items():
            if xs in tensors and x in raised:
                d = divisor(x)
                tensors[xs] = replace(tensors[xs], unseen_raise=leave_one_out_raise(
                    per_channel[x][rows], lambda top, d=d: 1.0 / d(top)))
        return replace(found, tensors=tensors)

    def balanced(rows: slice, tensors: Iterable[str]) -> tuple[RewriteResult, CalibrationStats]:
        """Balanced by factors and clips fitted on samples[rows]."""
        factors = {x: divisor(x)(per_channel[x][rows].max(axis=0)) for x in tensors}
        done = smooth(model, factors, readers, place=place, sizes=sizes)
        if not done:
            return done, stats
        changed = list(done.details["changed"])
        again = calibrated(done.model, path, "balanced", list(samples)[rows], changed)
        return done, replace(stats, tensors={**stats.tensors, **{t: again[t] for t in changed
                                                                 if t in again}})

    # Each tensor's readers alone on the samples neither the factors nor the clips were
    # fitted to: unbalanced, balanced, and balanced with the left-out headroom (the clips of
    # all 8 samples hid the clipping: face_landmark's depthwise inputs balanced erred less on
    # them, and the held-out crops passed those clips by up to 2.9x: rel L2 0.018 -> 0.087).
    tensors, groups = list(readers), list(readers.values())
    every, plain = balanced(fitted, tensors)
    after_plain = measure(every.model, plain, groups, check, None)
    # Only a tensor the left-out headroom raises is measured again, and only as far as it
    # decides (erring more than balanced alone is enough); the others read the same scales,
    # so their readers err exactly as balanced alone (ddddocr_det: 8 of 24 CPU s).
    raised = lifted(every, plain, fitted, tensors)
    read = dict(every.details.get("smoothed", {}))
    again = [k for k, x in enumerate(tensors)
             if (r := raised.tensors.get(read.get(x, ""))) is not None and r.unseen_raise > 1.0]
    after_lifted = list(after_plain)
    if again:
        found = measure(every.model, raised, [groups[k] for k in again], check,
                        [after_plain[k] for k in again])
        for k, error in zip(again, found, strict=True):
            after_lifted[k] = error
    unfitted = {**{x: known.fitted[x] for x in tensors if x in known.fitted},
                **calibrated(model, path, "unbalanced", list(samples)[fitted],
                              [x for x in tensors if x not in known.fitted])}
    before = measure(model, replace(stats, tensors={**stats.tensors, **unfitted}), groups, check,
                     [min(a, b) for a, b in zip(after_plain, after_lifted, strict=True)])
    kept = [x for x, a, b, c in zip(tensors, after_plain, after_lifted, before, strict=True)
            if min(a, b) < c]
    if not kept:
        return Balanced(model, stats, {})
    done, done_stats = balanced(slice(None), kept)
    if not done:
        return Balanced(model, stats, {})
    done_stats = lifted(done, done_stats, slice(None), [
        x for x, a, b in zip(tensors, after_plain, after_lifted, strict=True) if b <= a])
    top = {x: per_channel[x].max(axis=0) for x in readers}
    read = dict(done.details["smoothed"])
    return Balanced(done.model, done_stats, {
        x: (xs, float(top[x].max() / max(float(np.median(top[x])), 1e-12)))
        for x, xs in read.items()}, tuple(done.details["whole"]),
        dict(done.details["factors"]),
        {xs: r.unseen_raise for xs in read.values()
         if (r := done_stats.tensors.get(xs)) is not None and r.unseen_raise > 1.0})


@dataclass(frozen=True)
class Measured:
    """What equalise_channels measured of the model it was handed, for the Conv balancing
    after it where that is still the model (equalisation kept nothing): Conv inputs'
    per-channel abs-max on every sample ([samples, channels]) and 8-bit inputs' statistics
    on the fitted (even) samples. dnsmos_p835 INT8: one calibration and one channel pass."""

    model: onnx.ModelProto
    channels: dict[str, np.ndarray] = field(default_factory=dict)
    fitted: dict[str, RangeStats] = field(default_factory=dict)


@dataclass(frozen=True)
class Equalised:
    """The model with Conv inputs' channels equalised into their producers, its stats (the
    tensors it changed measured again), the chains equalised, and the outputs' rel L2 with
    their readers in INT8 before and after on unfitted samples (0, 0 where none was tried);
    `channel_scales`: each tensor the equalisation rescaled -> its factors (broadcast against
    it); `unseen_raise`: each equalised input whose clip keeps the left-out headroom -> that
    factor (RangeStats.unseen_raise); `measured`: what it measured of the model it was handed.
    """

    model: onnx.ModelProto
    stats: CalibrationStats
    chains: tuple[Chain, ...] = ()
    before: float = 0.0
    after: float = 0.0
    channel_scales: dict[str, np.ndarray] = field(default_factory=dict)
    unseen_raise: dict[str, float] = field(default_factory=dict)
    measured: Measured | None = None
    # True where `before` is a bound from above: the measurement stopped once it declined.
    stopped: bool = False


# The least share of the all-INT8 error an equalisation must take off to be kept. It is measured
# on the samples its factors came from: a smaller gain is within what unseen samples move
# (dnsmos_p835: 0.0516 -> 0.0515 kept, and the search's chosen point then failed held out at
# 0.056; without it, 0.026).
EQUALISE_MIN_GAIN = 0.05


def equalise_channels(reference: onnx.ModelProto, model: onnx.ModelProto, nodes: Sequence[str],
                      stats: CalibrationStats, int8: EightBitFormat, samples: Sequence[Feed], *,
                      rules: Sequence[ScaleRule], tensor_scales: Mapping[str, float],
                      path: str = "", weights: WeightStore | None = None,
                      expected: ReferenceOn | None = None) -> Equalised:
    """The Conv inputs among `nodes` whose producer can take their channels' ranges
    (npuprep.rewrite.equalise), equalised where the outputs with every one of `nodes` in
    INT8 gain, each side at its best of `rules` (one measurement for all chains: with the
    chains' readers alone in INT8 at one rule, ppocr_cls gained 0.026 -> 0.016 and lost
    0.0014 -> 0.0086 once the search chose its rules); the changed tensors are calibrated again, so every
    rule reads their own histogram. The gain is measured on calibration samples neither the
    factors nor the clips were fitted to, equalised as it is and with the headroom a sample
    left out of the fit shows (RangeStats.unseen_raise), the better kept. A tensor the plan
    rescaled is left alone. `path`: the file whose folder holds the weights a light load left
    external; `expected`: the reference's outputs, where the caller holds them."""
    from npuprep.calibrate.channels import channel_absmax, leave_one_out_raise
    from npuprep.rewrite.equalise import chains, equalise, factors

    by_label = {node_label(n): n for n in model.graph.node}

    def touched(c: Chain) -> list[str]:
        return [by_label[c.producer].output[0], *(by_label[b].output[0] for b in c.between)]

    found = [c for c in chains(model.graph, nodes) if c.tensor in stats.tensors
             and not any(t in tensor_scales for t in touched(c))]
    if not found:
        return Equalised(model, stats)
    per_channel = channel_absmax(model, [c.tensor for c in found], samples, axis=1)
    place = weights.place if weights is not None else None
    changed = {t for c in found for t in touched(c)}
    fitted, check = (slice(0, None, 2), list(samples[1::2])) if len(samples) > 1 else (
        slice(None), list(samples))

    def equalised(rows: slice, on: CalibrationStats) -> tuple[
            RewriteResult, CalibrationStats, dict[str, np.ndarray]]:
        """Equalised by factors and clips fitted on samples[rows] (`on`: the other tensors'
        stats)."""
        scales = {c.tensor: factors(per_channel[c.tensor][rows].max(axis=0)) for c in found}
        done = equalise(model, found, scales, place=place)
        if not done:
            return done, on, scales
        again = calibrated(done.model, path, "equalised", list(samples)[rows], changed)
        return done, replace(on, tensors={**on.tensors, **{t: again[t] for t in changed
                                                           if t in again}}), scales

    def lifted(on: CalibrationStats, rows: slice) -> CalibrationStats:
        """`on` where the readers' inputs keep the headroom a sample left out of the fit
        (samples[rows]) shows."""
        return replace(on, tensors={**on.tensors, **{
            c.tensor: replace(on.tensors[c.tensor], unseen_raise=leave_one_out_raise(
                per_channel[c.tensor][rows], factors)) for c in found}})

    # Every 8-bit input's clip fitted on the same samples as the factors, the plan's rescaled
    # ones apart (their stats are the measured tensors', scaled by quantise) and a body's.
    wanted = set(nodes)
    inputs = {name for node in model.graph.node if node_label(node) in wanted
              for name in activation_inputs(model.graph, node)
              if name in stats.tensors and name not in tensor_scales}
    unfitted = calibrated(model, path, "unequalised", list(samples)[fitted], inputs)
    fit_stats = replace(stats, tensors={**stats.tensors, **unfitted})
    measured = Measured(model, per_channel, unfitted)
    fit_done, plain, _ = equalised(fitted, fit_stats)
    if not fit_done:
        return Equalised(model, stats, measured=measured)
    error = model_errors(reference, check, expected)

    def best(m: onnx.ModelProto, found_stats: CalibrationStats,
             declined_by: float | None = None) -> tuple[float, bool]:
        """The least error over `rules` (the search picks each activation's rule later: each
        side at its best rule), and whether it stopped at a rule under which `declined_by`
        (the equalised error) takes less than EQUALISE_MIN_GAIN off: the rest could only
        lower it, the decision stands (the error returned is then a bound from above)."""
        least = math.inf
        for r in rules:
            least = min(least, error(quantise(m, nodes, found_stats, int8, saturate=True, rule=r,
                                              tensor_scales=tensor_scales,
                                              weights=weights).model))
            if declined_by is not None and declined_by > (1.0 - EQUALISE_MIN_GAIN) * least:
                return least, r != rules[-1]
        return least, False

    # The equalised sides first: a declined equalisation then measures the model as it is at
    # one rule where that rule already errs within EQUALISE_MIN_GAIN of them (dnsmos_p835
    # INT8: 9 QDQ sessions of 12).
    (as_is, _), (lift, _) = best(fit_done.model, plain), best(fit_done.model, lifted(plain, fitted))
    after = min(as_is, lift)
    before, stopped = best(model, fit_stats, after)
    if after > (1.0 - EQUALISE_MIN_GAIN) * before:
        return Equalised(model, stats, (), before, after, measured=measured, stopped=stopped)
    done, new_stats, scales = equalised(slice(None), stats)
    if lift <= as_is:
        new_stats = lifted(new_stats, slice(None))
    rescaled = {}
    for c in found:
        w = constant_value(model.graph, by_label[c.producer].input[1])
        assert w is not None, c.producer
        for t in touched(c):
            rescaled[t] = scales[c.tensor].reshape(-1, *[1] * (w.ndim - 2))
    return Equalised(done.model, new_stats, tuple(found), before, after, rescaled,
                     {c.tensor: r.unseen_raise for c in found
                      if (r := new_stats.tensors.get(c.tensor)) is not None and r.unseen_raise > 1})


def calibrated(model: onnx.ModelProto, path: str, label: str, feeds: Sequence[Feed],
                tensors: Collection[str]) -> dict[str, RangeStats]:
    """The statistics of `tensors` of `model` on `feeds`, every rule's detail, the samples
    spread over the cores (calibrate.run.pass_streams); weights a light load left in the
    file `path` are read from beside it, as the conversion's calibration read them."""
    from npuprep.calibrate.executors import calibrate
    from npuprep.calibrate.run import pass_streams
    from npuprep.model_io import Model, uses_external_data

    if not tensors:
        return {}
    return calibrate(Model(model, path if uses_external_data(model) else "", label), list(feeds),
                     detail="all", tensors=tensors, streams=pass_streams(len(feeds))).tensors


# The reference's outputs on some of the calibration samples, where a caller holds them
# (npuprep.verify.qdq_trials.ReferenceOutputs.on: run once per conversion).
ReferenceOn = Callable[[Sequence[Feed]], list[dict[str, np.ndarray]]]


def model_errors(reference: onnx.ModelProto, samples: Sequence[Feed],
                 expected: ReferenceOn | None = None) -> Callable[[onnx.ModelProto], float]:
    """A function: model -> its outputs' pooled rel L2 against `reference` on RANK_SAMPLES
    (the reference's outputs from `expected` where given)."""
    from npuprep.calibrate.run import pass_streams, session_threads
    from npuprep.runtime.session import make_session, run_in_streams

    feeds = list(samples)[:RANK_SAMPLES]
    streams = pass_streams(len(feeds))
    threads = session_threads(streams)
    if expected is not None:
        refs = expected(feeds)
    else:
        ref_session = make_session(reference, prepack=False, threads=threads)
        refs = list(run_in_streams(ref_session, feeds, None, streams))
        del ref_session

    def error(model: onnx.ModelProto) -> float:
        session = make_session(model, prepack=False, threads=threads)
        return worst_pooled_rel_l2(list(run_in_streams(session, feeds, None, streams)), refs)

    return error


def _divided(r: RangeStats, name: str, per_channel: np.ndarray) -> RangeStats:
    """Stats of x / s from x's and the per-sample, per-channel abs-max of x / s: abs-max only
    (no histogram, so a histogram rule reads the abs-max)."""
    per_sample = per_channel.max(axis=1)
    top = float(per_sample.max())
    return replace(r, tensor=name, min=0.0 if r.min >= 0 else -top, max=top, absmax=top,
                   exp_hist={}, over={}, under={}, zero_count=0, detailed_count=0,
                   per_sample_absmax=tuple(float(v) for v in per_sample), seen_in=None)


def on_target(qdq: onnx.ModelProto, wide: NumberFormat, pinned_nodes: Iterable[str], *,
              saturate: bool) -> onnx.ModelProto:
    """What the board computes: the QDQ model with every tensor outside the pinned nodes
    rounded to `wide` (FP16), the 8-bit layers' outputs too; QuantizeLinear/DequantizeLinear
    stay exact (their scales are FP32 constants of the compiler). `qdq` itself where the
    wider format is FP32."""
    from npuprep.verify.emulate import emulate

    if wide.name == "fp32":
        return qdq
    exact = {node_label(n) for scope in walk_graphs(qdq.graph) for n in scope.graph.node
             if n.op_type in QDQ_OPS}
    # FP32 weights are rounded by nodes in the graph, so they stay in their files (not read
    # in and copied rounded: the layers kept wider of a large model hold most of its bytes).
    return emulate(qdq, wide, saturate=saturate, pinned_nodes=exact | set(pinned_nodes),
                   weights_in_graph=True).model


def _activation_scale(r: RangeStats, top: float, factor: float,
                      fmt: EightBitFormat) -> ActivationScale:
    scale, unsigned, zero_point = stored_as(r, top, factor, fmt)
    return ActivationScale(scale, unsigned=unsigned, zero_point=zero_point)
