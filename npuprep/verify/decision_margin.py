"""The 8-bit search's error for outputs judged by their decisions: the share of the decided
positions' margin that the error eats, in the gate's units.

An output the user judges by its top-K classes or its CTC text (`--top-k`) passes the gate
while its rel L2 is far over the tolerance (ppocr_rec FP8: 0.17, every text held). Ranking
its layers and widening steps by rel L2 then spends the budget on error nobody reads: the
blank steps at 1.0 carry most of the squared error and no decision. Here each decided
position's margin (the reference's top class over each class that would change the
decision) is set against what the error takes off it: eaten = max over those classes of
(d_j - d_top) / (r_top - r_j), with d the candidate's deviation. A decision flips at
eaten >= 1; the search's margin (DECISION_MARGIN) flips it at 1 / margin. For a CTC output
a class that leaves the step's text the same (the blank, or the character of a step beside
it: a peak moved by one step) is no decision.

`decision_error` gives each output min(rel L2, aim x margin x worst eaten): at or under the
aim exactly where the output passes by its rel L2 or its decisions hold at the margin (to
first order in each position), so the search compares trials in the units of the gate it
meets. Deviations of layers add in it as in rel L2 (each position's eaten is linear in d).

A detector's outputs (`--detect`, npuprep.detections) pass by their detections alone: a score
output's error is aim x margin x the largest share of a decided score's distance to the
threshold that the error takes towards it; a box output's is its rel L2 at the positions FP32
detects (the gate's own number). A detector with no detection on the samples falls back to
rel L2, as the gate does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np

from npuprep.detections import Decision, Detection
from npuprep.verify.output_errors import (
    CTC_BLANK,
    CTC_TEXT,
    ctc_sequences,
    ctc_text,
    detection_band,
    rel_l2,
)

_T = TypeVar("_T")


class ReferenceScores:
    """What decision_error reads of the reference's outputs, worked out once for every trial
    scored against them (ppocr_rec's search: a third of its CPU time went to the reference's
    CTC texts and top classes, worked out again for each trial's four samples). Keyed by the
    reference's arrays, which it holds: no id is reused while it is here."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, object, float], tuple[np.ndarray, object]] = {}

    def get(self, value: np.ndarray, key: object, tie_rtol: float, make: Callable[[], _T]) -> _T:
        slot = (id(value), key, tie_rtol)
        found = self._known.get(slot)
        if found is None or found[0] is not value:
            found = self._known[slot] = (value, make())
        return found[1]  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._known)


def decision_error(got: Sequence[Mapping[str, np.ndarray]],
                   expected: Sequence[Mapping[str, np.ndarray]], *,
                   top_k: Mapping[str, Decision],
                   aim: float, margin: float, tie_rtol: float,
                   known: ReferenceScores | None = None) -> float:
    """The worst float output's error pooled over the samples: its rel L2, or for an output
    of `top_k` the smaller of that and `aim * margin` times the largest share of a decided
    margin the error eats (Inf for an Inf/NaN output). `known`: what earlier calls worked out
    of these reference arrays (the same number, sooner)."""
    known = known if known is not None else ReferenceScores()
    pooled: dict[str, list[float]] = {}  # output -> [squared error, squared reference]
    eaten: dict[str, float] = {}
    detected: dict[tuple[str, ...], int] = {}  # a detector's detections, all its score outputs
    at_detections: dict[str, list[float]] = {}  # a box output's sums where FP32 detects
    for values, want in zip(got, expected, strict=True):
        for name, value in want.items():
            if not np.issubdtype(np.asarray(value).dtype, np.floating):
                continue
            ref = known.get(value, "ref", 0.0, lambda value=value: _Reference(value))
            cand = np.asarray(values[name], dtype=np.float64)
            if not np.isfinite(cand).all():
                return math.inf
            sums = pooled.setdefault(name, [0.0, 0.0])
            sums[0] += ref.squared_error(cand)
            sums[1] += ref.squared
            k = top_k.get(name)
            if isinstance(k, Detection):
                _add_detection(name, k, ref.values, cand, want, tie_rtol, detected, eaten,
                               at_detections)
                continue
            # No classes to decide between (the gate reads its rel L2 alone): no margin.
            if k is not None and ref.values.shape == cand.shape and ref.values.ndim >= 1 \
                    and ref.values.shape[-1] >= 2:
                decided = known.get(value, k, tie_rtol,
                                    lambda ref=ref, k=k: DecidedMargins(ref.values, k, tie_rtol))
                eaten[name] = max(eaten.get(name, 0.0), decided.finite_eaten(cand))
    worst = 0.0
    for name, (err2, ref2) in pooled.items():
        error = rel_l2(err2, ref2)
        rule = top_k.get(name)
        if isinstance(rule, Detection):
            if detected.get(rule.detector):  # else none judged: rel L2, as the gate falls back
                error = (rel_l2(*at_detections.get(name, [0.0, 0.0])) if rule.scores is not None
                         else aim * margin * eaten.get(name, 0.0))
        elif name in eaten:
            error = min(error, aim * margin * eaten[name])
        worst = max(worst, error)
    return worst


class _Reference:
    """A reference output in float64, where it is defined (FP32 itself Inf/NaN defines no
    error, as OutputErrors counts it), and its sum of squares there."""

    def __init__(self, value: np.ndarray) -> None:
        self.values = np.asarray(value, dtype=np.float64)
        self.defined = np.isfinite(self.values)
        self.everywhere = bool(self.defined.all())
        self.squared = float(np.square(np.where(self.defined, self.values, 0.0)).sum())

    def squared_error(self, cand: np.ndarray) -> float:
        d = cand - self.values
        return float(np.square(d if self.everywhere else np.where(self.defined, d, 0.0)).sum())


def _add_detection(name: str, rule: Detection, ref: np.ndarray, cand: np.ndarray,
                   want: Mapping[str, np.ndarray], tie_rtol: float,
                   detected: dict[tuple[str, ...], int], eaten: dict[str, float],
                   at_detections: dict[str, list[float]]) -> None:
    """One sample of a detector's output: a score output's share of its decided scores'
    distance to the threshold the error takes towards it, or a box output's sums at the
    positions its score output detects."""
    read_from = rule.scores if rule.scores is not None else name
    scores = rule.read(np.asarray(want[read_from], np.float64), read_from)
    t = rule.threshold
    with np.errstate(invalid="ignore"):
        decided = np.abs(scores - t) > detection_band(t, tie_rtol)
    if rule.scores is not None:
        at = (decided & (scores > t)).any(axis=-1)
        if ref.shape[:-1] == at.shape:
            sums = at_detections.setdefault(name, [0.0, 0.0])
            sums[0] += float(np.square((cand - ref)[at]).sum())
            sums[1] += float(np.square(ref[at]).sum())
        return
    ref, cand = rule.read(ref, name), rule.read(cand, name)
    detected[rule.detector] = detected.get(rule.detector, 0) + int((decided & (ref > t)).sum())
    # Towards the threshold: down for a score above it, up for one below.
    towards = np.where(ref > t, ref - cand, cand - ref)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(decided, np.maximum(towards, 0.0) / np.abs(ref - t), 0.0)
    eaten[name] = max(eaten.get(name, 0.0), float(share.max(initial=0.0)))


def margin_eaten(ref: np.ndarray, cand: np.ndarray, k: int, tie_rtol: float) -> float:
    """The largest share of a decided position's margin the error takes (0 where nothing is
    decided; Inf where the candidate is not finite). `ref` and `cand`: the same shape, classes
    along the last axis (at least 2). `k`: the top-K judged, or CTC_TEXT."""
    return DecidedMargins(ref, k, tie_rtol).eaten(cand)


class DecidedMargins:
    """A reference output's decided positions (classes along the last axis) and, for each of
    its top K classes there, its margin over every class that would change the decision:
    margin_eaten's reference side, for any number of candidates."""

    def __init__(self, ref: np.ndarray, k: int, tie_rtol: float) -> None:
        self.k = k
        if k == CTC_TEXT:
            ref = ctc_sequences(ref)
        classes = ref.shape[-1]
        self.ref = ref
        r = ref.reshape(-1, classes)
        top = 1 if k == CTC_TEXT else min(k, classes - 1)
        # The top K + 1 classes of each position, in order (a partition: 6625 classes per step).
        part = np.argpartition(-r, top, axis=-1)[:, :top + 1]
        values = np.take_along_axis(r, part, axis=-1)
        by_value = np.argsort(-values, axis=-1)
        order = np.take_along_axis(part, by_value, axis=-1)
        ranked = np.take_along_axis(values, by_value, axis=-1)
        # A position whose K-th and (K+1)-th reference values tie decides nothing (the gate's
        # rule).
        larger = np.maximum(np.abs(ranked[:, top - 1]), np.abs(ranked[:, top]))
        decided = (ranked[:, top - 1] - ranked[:, top]) > tie_rtol * larger
        inside = np.zeros(r.shape, dtype=bool)
        np.put_along_axis(inside, order[:, :top], True, axis=-1)
        harmless = _ctc_harmless(ref) if k == CTC_TEXT else inside
        self.rows = np.flatnonzero(decided)
        # Per top class i: the class kept at each decided row, its margin over every class
        # and where no margin is read (a harmless class, or none to lose).
        self.kept = [order[self.rows, i] for i in range(top)]
        self.gaps = [r[self.rows, kept][:, None] - r[self.rows] for kept in self.kept]
        self.ignored = [harmless[self.rows] | (gap <= 0) for gap in self.gaps]

    def eaten(self, cand: np.ndarray) -> float:
        """margin_eaten of `cand` against this reference."""
        return self.finite_eaten(cand) if np.isfinite(cand).all() else math.inf

    def finite_eaten(self, cand: np.ndarray) -> float:
        """eaten of a `cand` known to be finite."""
        if self.k == CTC_TEXT:
            cand = ctc_sequences(cand)
        d = (cand - self.ref).reshape(-1, self.ref.shape[-1])
        worst = 0.0
        for kept, gap, ignored in zip(self.kept, self.gaps, self.ignored, strict=True):
            taken = d[self.rows] - d[self.rows, kept][:, None]
            with np.errstate(divide="ignore", invalid="ignore"):
                share = np.where(ignored, 0.0, taken / gap)
            if share.size:
                worst = max(worst, float(share.max()))
        return worst


def _ctc_harmless(ref: np.ndarray) -> np.ndarray:
    """Per step and class of a CTC output (sequences x steps x classes, flattened to steps):
    True where putting that class at that step alone leaves the sequence's greedy text as
    it is (the step's own class, the blank, or a neighbour's character)."""
    steps, classes = ref.shape[-2], ref.shape[-1]
    paths = ref.reshape(-1, steps, classes).argmax(axis=-1)
    harmless = np.zeros((paths.shape[0], steps, classes), dtype=bool)
    for s, path in enumerate(paths):
        text = ctc_text(path)
        for t in range(steps):
            for c in {int(path[t]), CTC_BLANK, *(int(path[u]) for u in (t - 1, t + 1)
                                                if 0 <= u < steps)}:
                moved = path.copy()
                moved[t] = c
                harmless[s, t, c] = ctc_text(moved) == text
    return harmless.reshape(-1, classes)
