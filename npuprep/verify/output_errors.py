"""Graph outputs of a candidate against the FP32 reference: Inf/NaN, max abs error, rel L2,
and, for outputs the user judges by their decision (`top_k`), top-K agreement.

A recogniser's or classifier's probabilities can be off by several percent in FP16 while
every decision stays the same: the error of an ill-conditioned softmax is FP16's precision
accumulated through the network, and no range remedy changes it. Polygraphy compares such
outputs by their indices (`--compare-func indices`); here an output named in `top_k` also
passes when its top-K classes along the last axis agree at every position on every sample
where the reference decides. Its rel L2 and max abs error are still measured and reported.

A position where the FP32 model's K-th and (K+1)-th values differ by no more than the
tolerance (`tie_rtol`, convert's rtol) of the larger is a tie, not a decision: an error the
user accepted (rel L2 within rtol) can reorder it, so a flip there is counted as a tie
flipped and fails nothing (a CTC recogniser whose 0.457 / 0.454 position swaps in FP16).

A search that fits its scales to a few samples accepts a decision with a margin (`margin`):
each decided position must keep its top-K with the candidate's error scaled by `margin`
(`top_k_agreement_at_margin`), since unseen samples err more than those the scales fit and
a decision that held by a hair there flips on them (ddddocr_ocr's CTC head in FP8: every
top-1 of the 8 calibration samples held, 4 of their 134 positions flip at twice the error,
and a held-out position flipped).

A CTC recogniser's output (time steps x classes, a blank class between characters) is read
by its greedy decoding: the argmax per step, repeats merged, blanks dropped. An output whose
K is CTC_TEXT (`--top-k OUTPUT:ctc`) is judged by that text per sequence, which holds where a
character's peak moves by one step (ppocr_rec INT8, held-out: steps 1 and 2 trade a 0.99
character and a 1.0 blank, every text the same); a step that is a tie keeps the reference's
class, as a tie flipped fails nothing above. Steps come first in torch's CTC layout (steps x
batch x classes: ddddocr_ocr's 20 x 1 x 8210): an output of that rank with one sequence per
sample is read so (`ctc_sequences`), as its one step per sequence otherwise holds no text.

A detector (`--detect`, npuprep.detections) is judged by its detections: a score output
passes when every (position, class) entry FP32 decides (its score further than the tolerance,
`tie_rtol` x max(1, |threshold|), from the threshold: probabilities compared on their own 0..1
scale, a 0.5 threshold +- 0.05 at the 8-bit rtol) stays on the same side of it (with the error
scaled by `margin` too: `detect_agreement_at_margin`); a box output tied to it by its rel L2
at the positions FP32 detects there, background left out (its error scaled by the margin is
the rel L2 times the margin: the search's rtol already holds it). A detector's detections are
counted over all its score outputs; one with no detection on the samples judges nothing, so
its outputs fall back to rel L2 and the row says so (`detect_fallback`).

Where the error sits tells the two apart: the worst sample's share of squared error at its
worst 1% of positions (every index but the last axis), and the FP32 model's top two values
at the worst position. An error concentrated at a few positions where the reference is
undecided (top two 0.50 / 0.49) is the model's conditioning there, not the conversion.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from npuprep.detections import Decision, Detection
from npuprep.errors import NpuprepError
from npuprep.verify.detection_odds import (
    FEW_FLIPS,
    MORE_LIKELY_THAN_NOT,
    NEAR_ENOUGH,
    NearThreshold,
)

# The share of the worst positions whose squared error is summed ("the worst 1%").
WORST_POSITIONS = 0.01
# The K of an output judged by its greedy CTC decoding rather than each step's top-K.
CTC_TEXT = 0
# The class a CTC decoding drops (PaddleOCR's blank, and torch's CTCLoss default).
CTC_BLANK = 0


def rule_said(rule: Decision) -> str:
    """A decided output's rule in words: `top-1`, `CTC text`, a detector's rule."""
    return rule.said() if isinstance(rule, Detection) else (
        "CTC text" if rule == CTC_TEXT else f"top-{rule}")


def output_passes(errors: Mapping[str, Any], rtol: float, *, at_margin: bool = False) -> bool:
    """The gate of one output's errors (as `OutputErrors` measures them): no Inf/NaN, and rel
    L2 within `rtol` or, when judged by top-K, every decision the same (`at_margin`: the same
    with the error scaled by the margin it was measured at, where it was). An output judged by
    a detector's detections passes by them alone: every decided score on its side of the
    threshold, a box output's rel L2 at the detections within `rtol`; `at_margin`, each also
    at the margin, or held with so little error near the threshold (measured on NEAR_ENOUGH
    entries at least) that a redraw of the samples should flip none (FEW_FLIPS: the margin
    asks every decided score for twice its own draw of the error, the odds ask it of the
    error's spread)."""
    if errors["nonfinite"]:
        return False
    if "rel_l2_at_detections" in errors:
        return errors["rel_l2_at_detections"] <= rtol
    if "detect_agreement" in errors:
        if errors["detect_agreement"] != 1.0:
            return False
        return (not at_margin or errors.get("detect_agreement_at_margin", 1.0) == 1.0
                or (errors.get("detect_near_entries", 0) >= NEAR_ENOUGH
                    and errors.get("detect_expected_flips", math.inf) <= FEW_FLIPS))
    agreement = errors.get("top_k_agreement_at_margin" if at_margin and
                           "top_k_agreement_at_margin" in errors else "top_k_agreement")
    return errors["rel_l2"] <= rtol or agreement == 1.0


@dataclass
class OutputErrors:
    """Accumulates per-output errors over samples; `top_k` maps an output to the rule of its
    decisions (K, CTC_TEXT or a Detection); `tie_rtol` is the reference's relative margin at or
    below which a position is a tie; `margin` (> 1): the decisions are also counted with the
    error scaled by it."""

    top_k: Mapping[str, Decision] = field(default_factory=dict)
    tie_rtol: float = 0.0
    margin: float = 1.0
    _acc: dict[str, dict[str, Any]] = field(default_factory=dict)
    _worst: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Per score output and sample: the positions FP32 detects (a box output is judged there).
    _detected: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)
    # Box outputs' samples added before their score output's: (box output, sample, ref, cand).
    _pending: dict[str, list[tuple[str, int, np.ndarray, np.ndarray]]] = field(default_factory=dict)

    def add(self, name: str, reference: np.ndarray, candidate: np.ndarray) -> None:
        ref = np.asarray(reference, dtype=np.float64)
        cand = np.asarray(candidate, dtype=np.float64)
        a = self._acc.setdefault(name, {"nonfinite": 0, "err2": 0.0, "ref2": 0.0,
                                        "max_abs_error": 0.0, "agree": 0, "positions": 0,
                                        "agree_at_margin": 0,
                                        "ties": 0, "ties_flipped": 0, "samples": 0, "top1": 0,
                                        "rows": 0, "top1_ties": 0, "probabilities": 1})
        bad, ref_bad, diff, err2, ref2 = _squared_errors(ref, cand)
        a["nonfinite"] += int(bad.sum())
        a["reference_nonfinite"] = a.get("reference_nonfinite", 0) + int(ref_bad.sum())
        a["err2"] += err2
        a["ref2"] += ref2
        rel = rel_l2(err2, ref2)
        if ref.shape == cand.shape and ref.ndim >= 1 and ref.shape[-1] >= 2 and err2 > 0 and (
                name not in self._worst or rel > self._worst[name]["rel_l2"]):
            self._worst[name] = {"sample": int(a["samples"]), "rel_l2": rel,
                                 **_concentration(ref, diff)}
        a["samples"] += 1
        a["max_abs_error"] = max(a["max_abs_error"], float(np.abs(diff).max(initial=0.0)))
        if ref.shape == cand.shape and ref.ndim >= 1 and ref.shape[-1] >= 2:
            # Probabilities along the last axis (a softmax's output): their decisions are
            # worth counting even when the user did not ask for --top-k.
            a["probabilities"] &= int(bool(ref.min() >= 0) and bool(np.allclose(ref.sum(-1), 1, atol=1e-3)))
            decided = _decided(ref, 1, self.tie_rtol)
            a["top1"] += int(_same_top_k(ref, cand, 1)[decided].sum())
            a["rows"] += int(decided.sum())
            a["top1_ties"] += int((~decided).sum())
        k = self.top_k.get(name)
        if isinstance(k, Detection):
            if k.scores is None:
                self._add_scores(name, k, ref, cand, a["samples"] - 1)
            else:
                self._add_boxes(name, k.scores, ref, cand, a["samples"] - 1)
            return
        if k == CTC_TEXT:
            self._add_texts(a, ctc_sequences(ref), ctc_sequences(cand))
        if k and ref.ndim >= 1 and ref.shape[-1] <= k:
            # A symbolic last axis smaller than K: no position could ever be judged.
            raise NpuprepError(f"--top-k {name}:{k}: output '{name}' has {ref.shape[-1]} classes along its "
                               "last axis on these samples; K must be smaller")
        steps = ctc_sequences(ref)
        if k == 1 and steps.ndim >= 2 and steps.shape[-2] > 1 and ref.shape == cand.shape:
            # Steps x classes judged step by step: whether each sequence's greedy CTC text
            # held too, for the hint a failing step-wise judge gives (npuprep.pipeline.verdict).
            held = _same_text(steps, ctc_sequences(cand), _decided(steps, 1, self.tie_rtol))
            a["texts_held"] = a.get("texts_held", 0) + int(held.sum())
            a["texts"] = a.get("texts", 0) + int(held.size)
        if k and ref.ndim >= 1 and ref.shape == cand.shape and ref.shape[-1] >= k:
            decided, same = _decided(ref, k, self.tie_rtol), _same_top_k(ref, cand, k)
            a["agree"] += int(same[decided].sum())
            if self.margin != 1.0:
                with np.errstate(invalid="ignore", over="ignore"):
                    scaled = ref + self.margin * (cand - ref)
                a["agree_at_margin"] += int(_same_top_k(ref, scaled, k)[decided].sum())
            a["positions"] += int(decided.sum())
            a["ties"] += int((~decided).sum())
            a["ties_flipped"] += int((~same[~decided]).sum())

    def _add_texts(self, a: dict[str, float], ref: np.ndarray, cand: np.ndarray) -> None:
        """One CTC output's sequences (every axis but the last two): texts the same, and the
        same with the error scaled by the margin; steps that are ties, and those flipped."""
        if ref.ndim < 2 or ref.shape != cand.shape:
            raise NpuprepError(f"--top-k ...:ctc needs steps x classes on the last two axes; the "
                               f"output has shape {ref.shape}")
        decided = _decided(ref, 1, self.tie_rtol)
        held = _same_text(ref, cand, decided)
        a["agree"] += int(held.sum())
        if self.margin != 1.0:
            with np.errstate(invalid="ignore", over="ignore"):
                scaled = ref + self.margin * (cand - ref)
            # Held at both: a text is not monotonic in the error as one step's top-1 is (a
            # peak half moved loses its character at 1x and is whole again at 2x: ppocr_rec
            # FP8, a trial passing at 2x whose model lost a text of 8 at 1x).
            a["agree_at_margin"] += int((held & _same_text(ref, scaled, decided)).sum())
        a["positions"] += int(np.prod(ref.shape[:-2]))
        a["ties"] += int((~decided).sum())
        a["ties_flipped"] += int((~_same_top_k(ref, cand, 1)[~decided]).sum())

    def _add_scores(self, name: str, rule: Detection, ref: np.ndarray, cand: np.ndarray,
                    sample: int) -> None:
        """One score output's entries on one sample: those FP32 decides (further than the tie
        band from the threshold) on the same side, at 1x and at the margin; its detections
        (decided and above) per sample, and the positions they sit at for its box outputs."""
        if ref.shape != cand.shape or ref.ndim < 1:
            raise NpuprepError(f"--detect: output '{name}' has shape {cand.shape} in the candidate "
                               f"and {ref.shape} in FP32; a score output is positions x classes")
        a, t = self._acc[name], rule.threshold
        ref, cand = rule.read(ref, name), rule.read(cand, name)
        with np.errstate(invalid="ignore", over="ignore"):
            above = ref > t
            decided = np.abs(ref - t) > detection_band(t, self.tie_rtol)  # NaN: undecided
            same = (np.nan_to_num(cand, nan=-np.inf) > t) == above
            scaled = np.nan_to_num(ref + self.margin * (cand - ref), nan=-np.inf)
        detected = decided & above
        a["agree"] += int(same[decided].sum())
        a["agree_at_margin"] += int(((scaled > t) == above)[decided].sum())
        a["positions"] += int(decided.sum())
        a["ties"] += int((~decided).sum())
        a["ties_flipped"] += int((~same[~decided]).sum())
        a.setdefault("near", NearThreshold(detection_band(t, self.tie_rtol))).add(ref, cand, t)
        a.setdefault("detections", {})[sample] = int(detected.sum())
        at = self._detected.setdefault(name, {})[sample] = detected.any(axis=-1)
        for box, i, r, c in [p for p in self._pending.get(name, []) if p[1] == sample]:
            self._judge_boxes(box, name, at, r, c, i)
        self._pending[name] = [p for p in self._pending.get(name, []) if p[1] != sample]

    def _add_boxes(self, name: str, scores: str, ref: np.ndarray, cand: np.ndarray,
                   sample: int) -> None:
        at = self._detected.get(scores, {}).get(sample)
        if at is None:  # its score output's sample comes later
            self._pending.setdefault(scores, []).append((name, sample, ref, cand))
            return
        self._judge_boxes(name, scores, at, ref, cand, sample)

    def _judge_boxes(self, name: str, scores: str, at: np.ndarray, ref: np.ndarray,
                     cand: np.ndarray, sample: int) -> None:
        """One box output's error on one sample at the positions `at` its score output detects."""
        if ref.shape[:-1] != at.shape or ref.shape != cand.shape:
            raise NpuprepError(f"--detect {scores}={name}: the box output's positions "
                               f"{ref.shape[:-1]} are not the score output's {at.shape} (every "
                               "axis but the last must match)")
        a = self._acc[name]
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.where(np.isfinite(cand) & np.isfinite(ref), cand - ref, 0.0)[at]
        a["err2_at"] = a.get("err2_at", 0.0) + float((diff ** 2).sum())
        a["ref2_at"] = a.get("ref2_at", 0.0) + float((np.nan_to_num(ref[at]) ** 2).sum())
        a["max_abs_at"] = max(a.get("max_abs_at", 0.0), float(np.abs(diff).max(initial=0.0)))
        a.setdefault("detections", {})[sample] = int(at.sum())

    def _detector_totals(self) -> dict[tuple[str, ...], int]:
        """Each detector's detections over all its score outputs and samples."""
        totals: dict[tuple[str, ...], int] = {}
        for name, rule in self.top_k.items():
            if isinstance(rule, Detection) and rule.scores is None and name in self._acc:
                totals[rule.detector] = (totals.get(rule.detector, 0)
                                         + sum(self._acc[name].get("detections", {}).values()))
        return totals

    def _detection_row(self, a: dict[str, Any], rule: Detection,
                       total: int) -> dict[str, Any]:
        per_sample = a.get("detections", {})
        row: dict[str, Any] = {"detect": rule.to_dict(), "detector_detections": total,
                               "detections": [per_sample.get(i, 0) for i in range(a["samples"])]}
        if not total:
            row["detect_fallback"] = (f"no detection at {rule.passing()} on these samples "
                                      f"(detector {', '.join(rule.detector)}): judged by rel L2")
            return row
        if rule.scores is not None and len(self._detected.get(rule.scores, {})) < a["samples"]:
            # A box output judged where its score output was never measured would judge nothing.
            row["detect_fallback"] = (f"its score output {rule.scores} was not measured on every "
                                      "sample: judged by rel L2")
            return row
        if rule.scores is not None:
            row["rel_l2_at_detections"] = rel_l2(a.get("err2_at", 0.0), a.get("ref2_at", 0.0))
            row["max_abs_error_at_detections"] = a.get("max_abs_at", 0.0)
            return row
        row["detect_agreement"] = a["agree"] / a["positions"] if a["positions"] else 1.0
        row["detect_entries"] = a["positions"]
        row["detect_ties"], row["detect_ties_flipped"] = a["ties"], a["ties_flipped"]
        # Which decided score met which error is chance: the flips a redraw of it would give.
        row["detect_near_rms"] = a["near"].rms()
        row["detect_near_entries"] = a["near"].count
        row["detect_expected_flips"] = a["near"].expected_flips()
        row["detect_held_by_chance"] = (row["detect_agreement"] == 1.0 and
                                        row["detect_expected_flips"] > MORE_LIKELY_THAN_NOT)
        if self.margin != 1.0:
            row["detect_margin"] = self.margin
            row["detect_agreement_at_margin"] = (a["agree_at_margin"] / a["positions"]
                                                 if a["positions"] else 1.0)
        return row

    def result(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        totals = self._detector_totals()
        for name, a in self._acc.items():
            row: dict[str, Any] = {
                "nonfinite": a["nonfinite"], "max_abs_error": a["max_abs_error"],
                "rel_l2": rel_l2(a["err2"], a["ref2"]),
            }
            if a.get("reference_nonfinite"):
                row["reference_nonfinite"] = a["reference_nonfinite"]
            rule = self.top_k.get(name)
            if isinstance(rule, Detection):
                row |= self._detection_row(a, rule, totals.get(rule.detector, 0))
            elif name in self.top_k:
                row["top_k"] = self.top_k[name]
                if self.top_k[name] == CTC_TEXT:
                    row["ctc_text"] = True  # agreement: sequences whose text held
                row["top_k_agreement"] = (a["agree"] / a["positions"] if a["positions"]
                                          else float(a["ties"] > 0))
                row["top_k_positions"] = a["positions"]
                row["top_k_ties"] = a["ties"]
                row["top_k_ties_flipped"] = a["ties_flipped"]
                if a.get("texts") and row["top_k_agreement"] < 1:
                    row["ctc_text_agreement"] = a["texts_held"] / a["texts"]
                if self.margin != 1.0:
                    row["top_k_margin"] = self.margin
                    row["top_k_agreement_at_margin"] = (
                        a["agree_at_margin"] / a["positions"] if a["positions"]
                        else row["top_k_agreement"])
            if name in self._worst:
                row["worst_sample"] = dict(self._worst[name])
            if a["rows"] and a["probabilities"]:
                row["top1_agreement"] = a["top1"] / a["rows"]
                row["top1_positions"] = a["rows"]
                row["top1_ties"] = a["top1_ties"]
            out[name] = row
        return out


def detection_band(threshold: float, rtol: float) -> float:
    """How far from `threshold` a score must lie to be a decision rather than a tie: `rtol` of
    the larger of 1 and the threshold. Scores are probabilities in most detectors (0..1, the
    threshold inside): relative to a threshold of 0.1 the band would be 0.005, finer than
    their error at any format; a detector whose scores are larger keeps the relative band."""
    return rtol * max(1.0, abs(threshold))


def rel_l2(err2: float, ref2: float) -> float:
    """sqrt(sum of squared errors / sum of squared references); against an all-zero reference
    the error's own L2 norm (a gate then reads it as an absolute error)."""
    return math.sqrt(err2 / ref2) if ref2 > 0 else math.sqrt(err2)


def worst_pooled_rel_l2(got: Sequence[Mapping[str, Any]],
                        expected: Sequence[Mapping[str, Any]]) -> float:
    """The worst float output's rel L2 of `got` against `expected`, pooled over the samples
    (their squared errors summed over their squared references): the one number that ranks
    candidates by their outputs' error. An Inf/NaN output is the largest error there is."""
    # The sums OutputErrors.add pools, alone: its decisions and concentration are not read
    # here and cost twice the sums or more (4 samples of ppocr_det's 320x320 map: 6.6 against
    # 2.2 ms; of a 640x640 one 41 against 19 ms; bench/bench_eight_bit_kernels.py).
    sums = PooledSums()
    for values, want in zip(got, expected, strict=True):
        sums.add(values, want)
    return sums.worst()


class PooledSums:
    """worst_pooled_rel_l2's sums, a sample at a time: per float output the squared errors,
    the squared references and the Inf/NaN count, summed in the order the samples come.
    `worst(references)` with the squared references of every sample (`reference_squares`)
    before all are added is a lower bound of the final worst: the errors still to come only
    add (a trial known to err past a bound can stop)."""

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}

    def add(self, values: Mapping[str, Any], want: Mapping[str, Any]) -> None:
        for name, value in want.items():
            if np.issubdtype(np.asarray(value).dtype, np.floating):
                bad, _, _, err2, ref2 = _squared_errors(np.asarray(value, dtype=np.float64),
                                                        np.asarray(values[name], dtype=np.float64))
                pooled = self.sums.setdefault(name, [0.0, 0.0, 0.0])
                pooled[0] += err2
                pooled[1] += ref2
                pooled[2] += float(bad.sum())

    def worst(self, references: Mapping[str, float] | None = None) -> float:
        return max(self.lows(references).values(), default=0.0)

    def lows(self, references: Mapping[str, float] | None = None) -> dict[str, float]:
        """Per output, its pooled rel L2 (Inf where it held Inf/NaN); a lower bound of the
        final one with every sample's squared `references`."""
        return {name: math.inf if bad else rel_l2(err2, ref2 if references is None
                                                  else references[name])
                for name, (err2, ref2, bad) in self.sums.items()}


def reference_squares(expected: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per float output, its squared references summed over `expected` as PooledSums sums them."""
    sums = PooledSums()
    for want in expected:
        sums.add(want, want)
    return {name: ref2 for name, (_, ref2, _) in sums.sums.items()}


def _squared_errors(ref: np.ndarray, cand: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    """`cand`'s Inf/NaN positions, `ref`'s, the difference where both are finite (0 elsewhere),
    its sum of squares and `ref`'s (where FP32 itself is Inf/NaN, an Inf in the model or the
    samples, no error is defined)."""
    bad, ref_bad = ~np.isfinite(cand), ~np.isfinite(ref)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(bad | ref_bad, 0.0, cand - ref)
        return (bad, ref_bad, diff, float((diff ** 2).sum()),
                float((np.where(ref_bad, 0.0, ref) ** 2).sum()))


def _concentration(ref: np.ndarray, diff: np.ndarray) -> dict[str, Any]:
    """Where one sample's squared error sits: the share at its worst 1% of positions, and
    the reference's top two values at the worst position (whether the decision held there)."""
    per_position = (diff ** 2).reshape(-1, ref.shape[-1]).sum(axis=1)
    rows = ref.reshape(-1, ref.shape[-1])
    n = per_position.size
    top = max(1, int(np.ceil(WORST_POSITIONS * n)))
    worst = np.argpartition(-per_position, top - 1)[:top]
    at = int(worst[np.argmax(per_position[worst])])
    two = np.sort(rows[at])[-2:][::-1]
    moved = rows[at] + diff.reshape(-1, ref.shape[-1])[at]
    return {"share": float(per_position[worst].sum() / per_position.sum()), "positions": top,
            "of": n, "position": at, "reference_top2": [float(two[0]), float(two[1])],
            "same_decision": bool(np.argmax(moved) == np.argmax(rows[at]))}


def _decided(ref: np.ndarray, k: int, tie_rtol: float) -> np.ndarray:
    """Per position: the reference's K-th value leads its (K+1)-th by more than `tie_rtol`
    of the larger magnitude (a decision), rather than a tie."""
    if ref.shape[-1] <= k:
        return np.ones(ref.shape[:-1], dtype=bool)
    two = -np.partition(-ref, (k - 1, k), axis=-1)[..., k - 1:k + 1]
    larger = np.maximum(np.abs(two[..., 0]), np.abs(two[..., 1]))
    with np.errstate(invalid="ignore"):  # Inf - Inf where FP32 itself overflowed: undecided
        return (two[..., 0] - two[..., 1]) > tie_rtol * larger


def ctc_sequences(a: np.ndarray) -> np.ndarray:
    """A CTC output as sequences x steps x classes: steps x 1 x classes (torch's layout, steps
    first, one sequence) turned so; any other shape as it is."""
    return a.transpose(1, 0, 2) if a.ndim == 3 and a.shape[1] == 1 and a.shape[0] > 1 else a


def ctc_text(path: np.ndarray) -> list[int]:
    """The greedy CTC decoding of one sequence of class ids: repeats merged, blanks dropped."""
    kept = np.ones(path.shape, dtype=bool)
    kept[1:] = path[1:] != path[:-1]
    return [int(c) for c in path[kept & (path != CTC_BLANK)]]


def _same_text(ref: np.ndarray, cand: np.ndarray, decided: np.ndarray) -> np.ndarray:
    """Per sequence: the candidate's greedy CTC text (the reference's class at the steps
    that are ties) is the reference's."""
    want = ref.argmax(axis=-1)
    got = np.where(decided, np.nan_to_num(cand, nan=-np.inf).argmax(axis=-1), want)
    steps = ref.shape[-2]
    want, got = want.reshape(-1, steps), got.reshape(-1, steps)
    return np.array([ctc_text(w) == ctc_text(g) for w, g in zip(want, got, strict=True)])


def _same_top_k(ref: np.ndarray, cand: np.ndarray, k: int) -> np.ndarray:
    """Per position (every index but the last axis): the same set of top-K classes."""
    if k == 1:
        return ref.argmax(axis=-1) == np.nan_to_num(cand, nan=-np.inf).argmax(axis=-1)
    top_ref = np.sort(np.argpartition(-ref, k - 1, axis=-1)[..., :k], axis=-1)
    top_cand = np.sort(np.argpartition(-np.nan_to_num(cand, nan=-np.inf), k - 1, axis=-1)[..., :k], axis=-1)
    return (top_ref == top_cand).all(axis=-1)
