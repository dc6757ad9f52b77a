"""Held-out samples by default: `--data D` (8 samples) -> calibrate on 6, verify on 6 and on 2 held out.

A conversion verified only on the samples it was calibrated and planned on can overfit them
(a timestep embedding that passes on its calibration timesteps and fails on others). Unless
the user names held-out samples, one in every HOLDOUT_EVERY samples of `--data` is held
out (at least one when there are two or more), spread over the set rather than taken from
its end, so that an ordered set (timesteps, file names by date) is sampled throughout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from npuprep.data import Feed, SampleSet

HOLDOUT_EVERY = 4


@dataclass(frozen=True)
class Split:
    """The calibration part (a SampleSet where the source allows it, else a list of feeds),
    the held-out feeds, and one sentence saying how many of which were held out."""

    calibration: Any
    held_out: list[Feed]
    said: str


def held_out_positions(count: int, every: int = HOLDOUT_EVERY) -> list[int]:
    """Indices held out of `count` samples: every `every`-th, the last of each group; at
    least one when `count` >= 2; none of a single sample."""
    if count < 2:
        return []
    picked = list(range(every - 1, count, every))
    return picked or [count - 1]


def split_holdout(samples: SampleSet, every: int = HOLDOUT_EVERY) -> Split:
    """`samples` split into calibration and held-out parts (see held_out_positions)."""
    held = set(held_out_positions(len(samples), every))
    if not held:
        return Split(samples, [], f"{samples.count} sample: nothing held out, verified on the "
                                  "sample it was calibrated on")
    feeds = list(samples)
    kept = [f for i, f in enumerate(feeds) if i not in held]
    calibration: Any = kept
    if samples.kind in ("npz", "dir"):
        # A file set stays a SampleSet, so calibration can still run on several processes.
        files = tuple(f for i, f in enumerate(samples.files) if i not in held)
        calibration = replace(samples, files=files, count=len(files))
    said = (f"held out {len(held)} of {len(feeds)} --data samples (1 in {every}, spread over "
            f"the set) to verify on; calibrated and planned on the other {len(kept)} "
            "(--holdout names others, --no-holdout verifies on all)")
    return Split(calibration, [feeds[i] for i in sorted(held)], said)
