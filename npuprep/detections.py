"""A detector's outputs judged by its detections (`--detect`): the rule as data.

A detector's user reads its score maps through a threshold (every (position, class) whose
score passes it is a detection, NMS after) and reads a box map only where something was
detected; nobody reads the rel L2 of background scores. `--detect` names one detector:

    --detect 'SCORES[=BOXES],SCORES[=BOXES],...:THRESHOLD'
    --detect 'cls8=reg8,cls16=reg16,cls32=reg32:0.5'    (a multi-scale head, one threshold)
    --detect 'classificators=regressors:sigmoid(0.5)'   (logits the user reads as sigmoid > 0.5)
    --detect 'softmax[1]=conv2d_4:0.6'                  (only class 1 of a softmax detects)

Each SCORES output is judged by its detections at THRESHOLD, and each BOXES output at the
positions (every index but the last axis) its SCORES output detects. The score outputs of
one `--detect` are one detector: its detections are counted together (a stride whose map
holds only background is judged by keeping it so, while the other strides detect). Output
names may contain ':' (the threshold is after the last one), not ',' or '='.

`SCORES[K]` (or `[K:]`, `[K:L]`) reads only those classes of the score output's last axis:
a softmax over background and face (MTCNN's first stage: `[..., 1] > 0.6`) or an SSD head whose
class 0 is the background detects by its other classes alone; its background column is never
thresholded, and its box output is judged where those classes detect.

`sigmoid(T)` says the score outputs are logits the user's post-processing turns into
probabilities before the threshold (MediaPipe's BlazeFace: sigmoid, then 0.5): they are judged
as those probabilities, as a graph that ends in the Sigmoid is. The tie band around the
threshold is a share of the scale the scores are read on (npuprep.verify.output_errors): read
as logits, 0.05 around 0 is p = 0.4875..0.5125, four times narrower than the same rule on the
probabilities the user thresholds.

How the rule is measured (sides of the threshold, ties, the margin) is
npuprep.verify.output_errors; this module is the spec, its parsing and its JSON form
(the conversion record keeps it: npuprep.provenance.Gates).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from npuprep.errors import NpuprepError

SPEC = "SCORES[=BOXES],...:THRESHOLD"
_SIGMOID = re.compile(r"sigmoid\((.*)\)")
_CLASSES = re.compile(r"(.+)\[(\d+)(:(\d*))?\]")


@dataclass(frozen=True)
class Detection:
    """One output of a detector: a score map (`scores` None) judged by its (position, class)
    entries above `threshold`, or a box map judged at the positions its score map `scores`
    detects. `detector`: every score output of the detector (detections counted together).
    `sigmoid`: the scores are logits, read as their sigmoid (the threshold a probability).
    `classes`: the score output's classes (last axis, start and end, end None: to the last)
    that detect; None: every class."""

    threshold: float
    detector: tuple[str, ...]
    scores: str | None = None
    sigmoid: bool = False
    classes: tuple[int, int | None] | None = None

    def read(self, scores: np.ndarray, name: str) -> np.ndarray:
        """Score output `name`'s values as the user thresholds them: its detecting classes,
        as their sigmoid where `sigmoid` (NaN stays NaN)."""
        if self.classes is not None:
            self.check_classes(scores.shape[-1] if scores.ndim else 0, name)
            scores = scores[..., self.classes[0]:self.classes[1]]
        if not self.sigmoid:
            return scores
        with np.errstate(over="ignore"):
            return 1.0 / (1.0 + np.exp(-np.asarray(scores, np.float64)))

    def check_classes(self, count: int, name: str) -> None:
        """Refuses, in one line, classes that score output `name`'s `count` classes lack."""
        if self.classes is not None:
            start, end = self.classes
            if count < (start + 1 if end is None else end):
                raise NpuprepError(f"--detect: output '{name}' has {count} classes on its last "
                                   f"axis, fewer than {self.said_classes()} needs")

    def said_classes(self) -> str:
        """'[1]', '[1:]', '[1:3]', or '' for every class."""
        if self.classes is None:
            return ""
        start, end = self.classes
        return f"[{start}]" if end == start + 1 else f"[{start}:{'' if end is None else end}]"

    def passing(self) -> str:
        """What a detection passes, in words: '> 0.5', 'sigmoid > 0.5', '[1] > 0.6'."""
        read = f"sigmoid{self.said_classes()}" if self.sigmoid else self.said_classes()
        return f"{read} > {self.threshold:g}".lstrip()

    @property
    def is_boxes(self) -> bool:
        return self.scores is not None

    def said(self) -> str:
        """The rule in words: 'detections at 0.5' / 'rel L2 at the detections of cls8'."""
        if self.scores is not None:
            return f"rel L2 at the detections of {self.scores} ({self.passing()})"
        return f"detections at {self.passing()}"

    def to_dict(self) -> dict[str, Any]:
        return {"detect": self.threshold, "detector": list(self.detector),
                **({"scores": self.scores} if self.scores is not None else {}),
                **({"sigmoid": True} if self.sigmoid else {}),
                **({"classes": list(self.classes)} if self.classes is not None else {})}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Detection:
        return cls(threshold=float(data["detect"]), detector=tuple(map(str, data["detector"])),
                   scores=None if data.get("scores") is None else str(data["scores"]),
                   sigmoid=bool(data.get("sigmoid", False)),
                   classes=None if data.get("classes") is None else (
                       int(data["classes"][0]),
                       None if data["classes"][1] is None else int(data["classes"][1])))


# How an output is judged by the decisions read from it: K >= 1 (top-K classes along the
# last axis), npuprep.verify.output_errors.CTC_TEXT (greedy CTC text), or a Detection.
Decision = int | Detection


def decision_to_json(rule: Decision) -> int | dict[str, Any]:
    return rule.to_dict() if isinstance(rule, Detection) else int(rule)


def decision_from_json(data: int | dict[str, Any]) -> Decision:
    return Detection.from_dict(data) if isinstance(data, dict) else int(data)


def parse_detect(items: list[str]) -> dict[str, Detection]:
    """`--detect` specs -> {output: Detection}; a malformed spec, or an output named twice,
    is refused in one line."""
    found: dict[str, Detection] = {}
    for item in items:
        pairs, _, number = item.rpartition(":")
        wrapped = _SIGMOID.fullmatch(number.strip())
        try:
            threshold = float(wrapped.group(1) if wrapped else number)
        except ValueError:
            threshold = math.nan
        if not pairs or not math.isfinite(threshold):
            raise NpuprepError(f"--detect {item}: expected {SPEC} with THRESHOLD a finite number "
                               "(the score a detection passes) or sigmoid(P) (logits read as "
                               "probabilities, P between 0 and 1)")
        if wrapped and not 0.0 < threshold < 1.0:
            raise NpuprepError(f"--detect {item}: sigmoid({threshold:g}) is no probability a "
                               "sigmoid reaches; P must be between 0 and 1")
        tied = [p.partition("=") for p in pairs.split(",")]
        if any(not s or (eq and not b) or "=" in b for s, eq, b in tied):
            raise NpuprepError(f"--detect {item}: expected {SPEC}; each item is a score output, "
                               "or SCORES=BOXES with one box output")
        classes = dict(_classes_of(s, item) for s, _, _ in tied)
        scores = tuple(classes)
        sigmoid = wrapped is not None
        rules = {s: Detection(threshold, scores, sigmoid=sigmoid, classes=classes[s])
                 for s in scores}
        for s, _, b in tied:
            s = _classes_of(s, item)[0]
            if b and (b in rules or b in scores):
                raise NpuprepError(f"--detect {item}: '{b}' is named twice (a score output is "
                                   "not its own box output)")
            if b:
                rules[b] = Detection(threshold, scores, scores=s, sigmoid=sigmoid,
                                     classes=classes[s])
        for name in rules:
            if name in found:
                raise NpuprepError(f"--detect {item}: output '{name}' is already judged by "
                                   "another --detect")
        found |= rules
    return found


def _classes_of(item: str, spec: str) -> tuple[str, tuple[int, int | None] | None]:
    """'softmax[1]' -> ('softmax', (1, 2)); '[1:]' -> (1, None); no brackets -> every class."""
    found = _CLASSES.fullmatch(item)
    if found is None:
        return item, None
    name, start, ranged, end = found.groups()
    first = int(start)
    last = first + 1 if ranged is None else (int(end) if end else None)
    if last is not None and last <= first:
        raise NpuprepError(f"--detect {spec}: {item} reads no class (the end comes before the "
                           "start)")
    return name, (first, last)
