"""The flips a detector's decided scores should expect on unseen samples: each decided score met
by an error as large as those its scores near the threshold show.

A check that every decided score keeps its side of the threshold reads one error per score:
which score met which error is chance. The 8-bit search tries many heads of similar error and
keeps the most 8-bit one whose calibration scores all hold, so it keeps a lucky draw (BlazeFace
INT8: the 89% point held its 7163 decided calibration scores while its error near the
threshold, rms 0.085 logits, would flip 1.29 of them on a redraw; 1 of its 3581 held-out
scores flipped). Here the error near the threshold is pooled (its rms over every entry within
NEAR_BANDS tie bands of it, decided or not) and each decided score's distance is set against
it: expected flips = sum over decided scores of P(an N(0, rms) error carries it past the
threshold). It does not depend on which score met which error, so a search cannot select it
by luck. The normal error is an assumption, stated where the number is reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# Entries within this many tie bands of the threshold measure the error there (BlazeFace's
# logits, threshold 0, band 0.05: within 0.2).
NEAR_BANDS = 4.0
# Decided scores' distances are counted in bins this many bands wide, out to MAX_BANDS: one
# further away flips with an error as large as the near ones only past 10 sigma, at the least.
BIN_BANDS = 0.25
MAX_BANDS = 40.0
# Expected flips past which a redraw of the samples more likely than not flips one (Poisson:
# P(none) = exp(-expected) < 1/2).
MORE_LIKELY_THAN_NOT = math.log(2.0)
# Expected flips under which a redraw flips none 9 times in 10 (exp(-0.1) = 0.905): the 8-bit
# search's aim for a detector whose decided scores hold (npuprep.verify.output_errors).
FEW_FLIPS = 0.1
# Entries near the threshold the odds need before they stand in for the margin: fewer measure
# no spread worth trusting (none gives an rms of 0 and no flips, whatever the error elsewhere).
NEAR_ENOUGH = 100


@dataclass
class NearThreshold:
    """One score output's error near its threshold and its decided scores' distances to it,
    accumulated over samples."""

    band: float
    err2: float = 0.0
    count: int = 0
    distances: np.ndarray = field(default_factory=lambda: np.zeros(int(MAX_BANDS / BIN_BANDS)))

    def add(self, ref: np.ndarray, cand: np.ndarray, threshold: float) -> None:
        """One sample's entries (FP32 `ref`, candidate `cand`; NaN in either is skipped)."""
        with np.errstate(invalid="ignore", over="ignore"):
            distance = np.abs(ref - threshold)
            finite = np.isfinite(distance) & np.isfinite(cand)
            near = finite & (distance <= NEAR_BANDS * self.band)
            self.err2 += float(np.square(cand[near] - ref[near]).sum())
        self.count += int(near.sum())
        decided = distance[finite & (distance > self.band)] / self.band
        counts, _ = np.histogram(decided, bins=self.distances.size, range=(0.0, MAX_BANDS))
        self.distances += counts

    def rms(self) -> float:
        """The error's rms over the entries near the threshold (0 where there were none)."""
        return math.sqrt(self.err2 / self.count) if self.count else 0.0

    def expected_flips(self) -> float:
        """Decided scores an N(0, rms) error would carry past the threshold, in expectation (each
        bin at its nearest edge: never fewer than the distances themselves would give)."""
        rms = self.rms()
        if rms <= 0:
            return 0.0
        edges = np.arange(self.distances.size) * BIN_BANDS * self.band
        odds = np.array([0.5 * math.erfc(d / (rms * math.sqrt(2.0))) for d in edges])
        return float((self.distances * odds).sum())
