"""Held-out samples by default: `--data D` (8 samples) -> calibrate on 6, verify on 6 and on 2 held out.

A conversion verified only on the samples it was calibrated and planned on can overfit them
(a timestep embedding that passes on its calibration timesteps and fails on others). Unless
the user names held-out samples, one in every HOLDOUT_EVERY samples of `--data` is held
out (at least one when there are two or more), spread over the set rather than taken from
its end, so that an ordered set (timesteps, file names by date) is sampled throughout.

A held-out check on samples the plan has seen is not one: `--holdout` samples that are also
`--data` samples, or that the `--stats` were calibrated on, are refused (`overlap`,
`seen_by_stats` find them); held-out samples the given `--stats` saw are not held out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from npuprep.data import Feed, SampleSet

HOLDOUT_EVERY = 4


@dataclass(frozen=True)
class Split:
    """The calibration part (a SampleSet where the source allows it, else a list of feeds),
    the held-out feeds, and one sentence saying how many of which were held out."""

    calibration: Any
    held_out: list[Feed]
    said: str
    held_out_ids: tuple[str, ...] = ()


def held_out_positions(count: int, every: int = HOLDOUT_EVERY) -> list[int]:
    """Indices held out of `count` samples: every `every`-th, the last of each group; at
    least one when `count` >= 2; none of a single sample."""
    if count < 2:
        return []
    picked = list(range(every - 1, count, every))
    return picked or [count - 1]


def split_holdout(samples: SampleSet, every: int = HOLDOUT_EVERY, *, stats_given: bool = False) -> Split:
    """`samples` split into calibration and held-out parts (see held_out_positions).
    `stats_given`: the plan comes from statistics given by the user, not from calibrating on
    the part kept (the sentence says so)."""
    held = set(held_out_positions(len(samples), every))
    if not held:
        return Split(samples, [], f"{samples.count} sample: nothing held out, verified on the "
                                  f"sample it was {'planned' if stats_given else 'calibrated'} on")
    feeds = list(samples)
    kept = [f for i, f in enumerate(feeds) if i not in held]
    calibration: Any = kept
    if samples.kind in ("npz", "dir"):
        # A file set stays a SampleSet, so calibration can still run on several processes.
        files = tuple(f for i, f in enumerate(samples.files) if i not in held)
        calibration = replace(samples, files=files, count=len(files))
    used = (f"verified on the other {len(kept)} too, planned on the --stats given" if stats_given
            else f"calibrated and planned on the other {len(kept)}")
    said = (f"held out {len(held)} of {len(feeds)} --data samples (1 in {every}, spread over "
            f"the set) to verify on; {used} (--holdout names others, --no-holdout verifies on all)")
    ids = samples.sample_ids()
    return Split(calibration, [feeds[i] for i in sorted(held)], said,
                 tuple(str(ids[i]) for i in sorted(held)))


def sample_keys(samples: SampleSet) -> list[str]:
    """One key per sample, in order, that two sets share exactly when they hold the same
    sample: the resolved file of an .npz, else the resolved source (a synthetic set: its
    seed) and the index in it."""
    if samples.kind in ("npz", "dir"):
        return [str(Path(f).resolve()) for f in samples.files]
    where = samples.seed if samples.synthetic else Path(samples.source).resolve()
    return [f"{samples.kind}:{where}[{i}]" for i in samples.sample_ids()]


def overlap(data: SampleSet, holdout: SampleSet) -> list[str]:
    """The ids of the `holdout` samples that are `data` samples too."""
    shared = set(sample_keys(data))
    return [str(i) for i, key in zip(holdout.sample_ids(), sample_keys(holdout), strict=True)
            if key in shared]


def same_feeds(data: Iterable[Feed], holdout: Iterable[Feed]) -> list[int]:
    """The positions of the `holdout` feeds whose every array equals a `data` feed's: a
    copied file, or feeds in memory, which have no file to compare."""
    shared = {_digest(f) for f in data}
    return [i for i, f in enumerate(holdout) if _digest(f) in shared]


def _digest(feed: Feed) -> str:
    h = hashlib.sha256()
    for name in sorted(feed):
        value = np.ascontiguousarray(feed[name])
        h.update(f"{name}:{value.dtype}:{value.shape};".encode())
        h.update(value.tobytes())
    return h.hexdigest()


def seen_by_stats(stats_source: Mapping[str, Any], stats_ids: Iterable[str | int],
                  samples: SampleSet) -> list[str]:
    """The ids of the `samples` that statistics calibrated on `stats_source`
    (CalibrationStats.source) with `stats_ids` saw: the same file, or the same index of the
    same source. Statistics that do not say where their samples came from saw none that
    can be named."""
    kind, source = stats_source.get("kind"), str(stats_source.get("source") or "")
    if not source:
        return []
    if kind == "dir":
        seen = {str((Path(source) / str(i)).resolve()) for i in stats_ids}
    elif kind == "npz":
        seen = {str(Path(source).resolve())}
    else:
        where = stats_source.get("seed") if kind == "synthetic" else Path(source).resolve()
        seen = {f"{kind}:{where}[{i}]" for i in stats_ids}
    return [str(i) for i, key in zip(samples.sample_ids(), sample_keys(samples), strict=True)
            if key in seen]


# Held-out inputs past this many times the calibration samples' largest |value| are named
# when the held-out check fails: scales planned on quieter samples clip louder ones.
LOUDER = 2.0


def louder_inputs(calibration: Iterable[Mapping[str, Any]],
                  held_out: Iterable[Mapping[str, Any]]) -> dict[str, tuple[float, float]]:
    """Float inputs whose held-out samples reach over LOUDER x the calibration samples'
    largest |value|: input -> (calibration's largest |value|, held-out's), loudest first."""
    def peaks(feeds: Iterable[Mapping[str, Any]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for feed in feeds:
            for name, value in feed.items():
                a = np.asarray(value)
                if np.issubdtype(a.dtype, np.floating) and a.size:
                    out[name] = max(out.get(name, 0.0), float(np.max(np.abs(a))))
        return out

    seen, held = peaks(calibration), peaks(held_out)
    louder = {n: (seen.get(n, 0.0), h) for n, h in held.items() if h > LOUDER * seen.get(n, 0.0)}
    return dict(sorted(louder.items(), key=lambda kv: -kv[1][1] / max(kv[1][0], 1e-30)))
