"""INT8 layer inputs whose channels sit off zero, centred where that measures better:
`Conv(x, W, b)` -> `Conv(x - c, W, b + W.c)` (npuprep.rewrite.shift).

Kept per tensor by the error of its readers quantised alone, on the calibration samples
neither the centres nor the clips were fitted to, against the tensor as it was with clips
fitted on the same samples: MTCNN's PNet on a target without zero points (its PReLU outputs
reach -0.24 to -0.41 of their tops, each channel about its own centre) kept its two widest
layers FP16 at 78% INT8 uncentred.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import onnx

from npuprep.calibrate.scales import stored_as
from npuprep.calibrate.stats import CalibrationStats, RangeStats
from npuprep.data import Feed
from npuprep.graph import node_label
from npuprep.numerics import EightBitFormat
from npuprep.rewrite.shift import shift, shiftable
from npuprep.verify.qdq_model import calibrated

# A tensor is worth measuring where centring its channels narrows what one INT8 scale spans
# (or, stored symmetric, its median channel's reach) by at least this: a quarter of a bit.
MIN_GAIN = 1.25
# Nor where more than this share of its values are exactly zero (a ReLU's, a hard-swish's):
# zero is on every INT8 grid, -c is not, and each of those values would round alike, an
# error the same at every position that no bias correction sees.
MAX_ZEROS = 0.01
# The outputs' error with every layer in INT8, as the gate judges them, must fall by at least
# 5% for any centring to stay: ppocr_rec's hard-swish outputs, each reader erring less alone
# and the rel L2 of all in INT8 less (0.070 against 0.092), cost decided CTC margins, and its
# search ended at 74.5% INT8 where it had kept 99.8%.
WHOLE_GAIN = 0.95

# (model, its stats, groups of layers, samples, bounds, layer -> its input's centre) -> the
# outputs' error with each group alone in 8 bits (npuprep.verify.qdq_trials.errors_alone).
CentredErrors = Callable[[onnx.ModelProto, CalibrationStats, list[list[str]], Sequence[Feed],
                          Sequence[float] | None, Mapping[str, np.ndarray]], list[float]]
# (model, its stats, samples, layer -> its centred input's mean) -> the outputs' error with
# every INT8 layer in INT8, as the gate judges them (a CTC text's decisions, a top-1's).
WholeError = Callable[[onnx.ModelProto, CalibrationStats, Sequence[Feed],
                       Mapping[str, np.ndarray]], float]


@dataclass(frozen=True)
class Centred:
    """The model with the kept tensors centred, its stats (the centred tensors' too), and
    each kept tensor -> (the tensor its readers now read, the span's gain); `means`: each
    reader -> its centred input's mean per channel (its 8-bit bias follows its 8-bit weight
    by it: quantise's `centred_means`);
    `errors`: each kept tensor's readers' error alone on the unfitted samples, (uncentred,
    centred); `reason`: why nothing was kept; `unseen_raise`: each centred tensor whose clip
    keeps the headroom a left-out sample showed -> that factor (RangeStats.unseen_raise)."""

    model: onnx.ModelProto
    stats: CalibrationStats
    tensors: dict[str, tuple[str, float]] = field(default_factory=dict)
    means: dict[str, np.ndarray] = field(default_factory=dict)
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)
    reason: str = ""
    unseen_raise: dict[str, float] = field(default_factory=dict)


def stored_symmetric(r: RangeStats, fmt: EightBitFormat) -> bool:
    """Whether INT8 stores x symmetric about zero (no zero point: the target takes none, or
    x reaches far below zero)."""
    return not stored_as(r, max(float(r.absmax), 1e-30), 1.0, fmt)[1]


def span_gain(low: np.ndarray, high: np.ndarray, fitted: slice, check: slice) -> float:
    """How much narrower symmetric INT8's range of x gets with each channel centred, on the
    samples `check` with the centres of the samples `fitted` (`low`, `high`: [samples,
    channels]): its tensor's reach, or its median channel's, whichever narrows more. A
    channel about zero whose extremes differ by chance (a heavy tail's) has a midpoint the
    other samples do not share, and gains nothing there."""
    centre = (low[fitted].min(axis=0) + high[fitted].max(axis=0)) / 2
    lo, hi = low[check].min(axis=0), high[check].max(axis=0)
    reach = np.maximum(np.abs(lo), np.abs(hi))
    centred = np.maximum(np.maximum(hi - centre, centre - lo), 1e-30)
    return max(float(reach.max() / centred.max()), float(np.median(reach / centred)))


def centre_skewed_inputs(model: onnx.ModelProto, nodes: Sequence[str], stats: CalibrationStats,
                         samples: Sequence[Feed], fmt: EightBitFormat, *, measure: CentredErrors,
                         whole: WholeError,
                         left_alone: Collection[str], path: str = "") -> Centred:
    """The INT8 layers among `nodes` that can take a shift read their input centred per
    channel where span_gain is at least MIN_GAIN and their error alone (`measure`) on the
    odd calibration samples falls with centres and clips fitted on the even ones; kept
    tensors are fitted again on every sample, where `whole` (every INT8 layer at once, as the
    gate judges the outputs) falls by WHOLE_GAIN too. `left_alone`: tensors the plan
    rescaled."""
    from npuprep.calibrate.channels import channel_extremes, channel_means

    g = model.graph
    wanted = set(nodes)
    readers: dict[str, list[str]] = {}
    kinds: dict[str, set[str]] = {}
    for node in g.node:
        x = node.input[0] if node.input else ""
        if node_label(node) in wanted and shiftable(g, node) and x in stats.tensors \
                and x not in left_alone and stored_symmetric(stats.tensors[x], fmt) \
                and stats.tensors[x].zero_count <= MAX_ZEROS * stats.tensors[x].detailed_count:
            readers.setdefault(x, []).append(node_label(node))
            kinds.setdefault(x, set()).add(node.op_type)
    # A tensor read both as a Conv's channels (axis 1) and a MatMul's (last) has no one centre.
    readers = {x: r for x, r in readers.items() if len(kinds[x]) == 1}
    if not readers:
        return Centred(model, stats, reason=f"no INT8 Conv without padding or MatMul reads an "
                                            f"activation stored symmetric with at most "
                                            f"{MAX_ZEROS:.0%} of its values at zero")
    extremes: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for kind, axis in (("Conv", 1), ("MatMul", -1)):
        extremes.update(channel_extremes(model, [x for x in readers if kind in kinds[x]],
                                         samples, axis=axis))
    fitted, odd = (slice(0, None, 2), slice(1, None, 2)) if len(samples) > 1 else (
        slice(None), slice(None))
    check = list(samples)[odd]
    gains = {x: span_gain(lo, hi, fitted, odd) for x, (lo, hi, _) in extremes.items()}
    zeros = {x: float(z.mean()) for x, (_, _, z) in extremes.items()}
    tensors = [x for x in readers if gains[x] >= MIN_GAIN and zeros[x] <= MAX_ZEROS]
    if not tensors:
        return Centred(model, stats, reason=f"no INT8 layer input's channels sit far enough "
                                            f"off zero (span gain under {MIN_GAIN}x on samples "
                                            f"the centres were not fitted to) without values at "
                                            f"zero itself (over {MAX_ZEROS:.0%})")

    def centred(rows: slice, chosen: Sequence[str], raised: Collection[str] = ()
                ) -> tuple[onnx.ModelProto, CalibrationStats, dict[str, str],
                           dict[str, np.ndarray]]:
        """The model with `chosen` centred as samples[rows] give them; of those `raised`,
        the clip keeps the headroom a sample left out of the fit shows."""
        centres = {x: (extremes[x][0][rows].min(axis=0) + extremes[x][1][rows].max(axis=0)) / 2
                   for x in chosen}
        done = shift(model, centres, {x: readers[x] for x in chosen})
        if not done:
            return model, stats, {}, {}
        read = dict(done.details["centred"])
        feeds = list(samples)[rows]
        again = calibrated(done.model, path, "centred", feeds, list(read.values()))
        for x in set(raised) & set(read):
            again[read[x]] = replace(again[read[x]], unseen_raise=centred_raise(
                extremes[x][0][rows], extremes[x][1][rows]))
        means = channel_means(done.model, {xc: 1 if "Conv" in kinds[x] else -1
                                           for x, xc in read.items()}, feeds)
        return (done.model, replace(stats, tensors={**stats.tensors, **again}), read,
                {layer: means[read[x]] for x in read for layer in readers[x]})

    # Each tensor's readers alone on the samples neither the centres nor the clips were
    # fitted to: uncentred, centred, and centred with the headroom a left-out sample shows
    # (a channel's bottom had the whole of -max below it uncentred; centred, a sample
    # reaching below the calibration's bottom clips).
    groups = [readers[x] for x in tensors]
    shifted, plain, read, by_reader = centred(fitted, tensors)
    lifted = replace(plain, tensors={**plain.tensors, **{read[x]: replace(
        plain.tensors[read[x]], unseen_raise=centred_raise(extremes[x][0][fitted],
                                                           extremes[x][1][fitted]))
        for x in read}})
    after_plain = measure(shifted, plain, groups, check, None, by_reader)
    after_lifted = measure(shifted, lifted, groups, check, None, by_reader)
    after = [min(a, b) for a, b in zip(after_plain, after_lifted, strict=True)]
    raised = [x for x, a, b in zip(tensors, after_plain, after_lifted, strict=True) if b <= a]
    unfitted = replace(stats, tensors={**stats.tensors, **calibrated(
        model, path, "uncentred", list(samples)[fitted], tensors)})
    before = measure(model, unfitted, groups, check, after, {})
    chosen = replace(plain, tensors={**plain.tensors, **{
        read[x]: lifted.tensors[read[x]] for x in raised}})
    every = (whole(model, unfitted, check, {}), whole(shifted, chosen, check, by_reader))
    if every[1] > WHOLE_GAIN * every[0]:
        return Centred(model, stats, reason=f"centring took less than {1 - WHOLE_GAIN:.0%} off "
                                            f"the outputs' error with every layer in INT8 "
                                            f"({every[0]:.3g} -> {every[1]:.3g})")
    kept = [x for x, a, b in zip(tensors, after, before, strict=True) if a < b]
    if not kept:
        return Centred(model, stats, reason="centring erred no less on the samples its centres "
                                            "were not fitted to")
    done, done_stats, read, by_reader = centred(slice(None), kept, raised)
    errors = {x: (b, a) for x, a, b in zip(tensors, after, before, strict=True) if x in read}
    return Centred(done, done_stats, {x: (xc, gains[x]) for x, xc in read.items()}, by_reader,
                   errors, unseen_raise={
                       xc: r.unseen_raise for xc in read.values()
                       if (r := done_stats.tensors.get(xc)) is not None and r.unseen_raise > 1.0})


def centred_raise(low: np.ndarray, high: np.ndarray) -> float:
    """How far an unseen sample passes the clip of a tensor centred per channel: each sample
    of `low`/`high` ([samples, channels]) left out in turn, the centres and the clip from the
    others, and its reach from those centres over the clip; the largest, at least 1."""
    if low.shape[0] < 3:
        return 1.0  # fewer samples give no spread worth extrapolating from
    worst = 1.0
    for k in range(low.shape[0]):
        lo, hi = np.delete(low, k, axis=0).min(axis=0), np.delete(high, k, axis=0).max(axis=0)
        centre = (lo + hi) / 2
        clip = float(((hi - lo) / 2).max())
        if clip > 0:
            worst = max(worst, float(np.maximum(high[k] - centre, centre - low[k]).max()) / clip)
    return worst
