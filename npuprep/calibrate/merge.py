"""shard_1.json + ... + shard_n.json -> all.json: stats over disjoint samples merged exactly.

Every statistic of a stats file is a max, a min or a sum over its samples, or a list with one
entry per sample, so stats over disjoint samples of one model merge into the stats of one run
over all of them: max of max, min of min, sum of counts (NaN/Inf counts, counts above each
format's max, exponent histograms), per-sample abs-max lists joined in sample order. The
result is field for field what `calibrate` gives over the union of the samples.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from npuprep.calibrate.stats import CalibrationStats, RangeStats
from npuprep.data import describe_samples
from npuprep.errors import NpuprepError


def merge_stats(parts: Sequence[tuple[str, CalibrationStats]]) -> CalibrationStats:
    """The stats of all of `parts` ((name, stats) pairs, names for messages) together.

    Refuses, naming the file: stats of another model (fingerprint), of another detail
    setting, from another sample source, with other tensors, or sharing a sample with an
    earlier file."""
    if not parts:
        raise NpuprepError("stats merge: no stats to merge")
    first_name, first = parts[0]
    owner: dict[str | int, str] = {}
    for name, s in parts:
        _check_same(name, s, first_name, first)
        for sid in s.sample_ids:
            if sid in owner:
                raise NpuprepError(f"{name}: sample {sid!r} is also in {owner[sid]}; "
                                   "merged stats must come from disjoint samples")
            owner[sid] = name
    # In sample order: np.fmax/fmin keep the first of equal values (0.0 and -0.0), as one
    # run that folds the samples in order does.
    parts = sorted(parts, key=lambda p: p[1].sample_ids[0])
    ids = tuple(sorted(owner))  # type: ignore[type-var]
    position = {sid: i for i, sid in enumerate(ids)}
    tensors = {
        key: _merge_rows([(s.tensors[key], s.sample_ids) for _, s in parts], position)
        for key in first.tensors
    }
    source = first.source
    return CalibrationStats(
        fingerprint=first.fingerprint,
        samples=describe_samples(str(source["kind"]), str(source["source"]), len(ids), int(source.get("seed", 0))),
        synthetic=first.synthetic, sample_count=len(ids), detail=first.detail, tensors=tensors,
        unobserved=dict(first.unobserved), sample_ids=ids, source=dict(source),
    )


def _check_same(name: str, s: CalibrationStats, first_name: str, first: CalibrationStats) -> None:
    if s.fingerprint != first.fingerprint:
        raise NpuprepError(f"{name}: stats of another model (fingerprint {s.fingerprint}, "
                           f"{first_name} has {first.fingerprint})")
    if s.detail != first.detail:
        raise NpuprepError(f"{name}: detail {s.detail!r}, {first_name} has {first.detail!r}; "
                           "merged stats must use the same --detail")
    if not s.source or not s.sample_ids or len(s.sample_ids) != s.sample_count:
        raise NpuprepError(f"{name}: no sample ids (not written by npuprep calibrate?)")
    if not {"kind", "source"} <= set(s.source):
        raise NpuprepError(f"{name}: sample_source lacks 'kind' or 'source' (not written by npuprep calibrate?)")
    if s.source != first.source:
        raise NpuprepError(f"{name}: samples from {_where(s)}, {first_name}'s from {_where(first)}; "
                           "merged stats must come from one source")
    if set(s.tensors) != set(first.tensors) or s.unobserved != first.unobserved:
        other = sorted(set(s.tensors) ^ set(first.tensors)) or sorted(set(s.unobserved) ^ set(first.unobserved))
        raise NpuprepError(f"{name}: other tensors than {first_name} ({', '.join(other[:3]) or 'unobserved ones'})")
    for key, row in s.tensors.items():
        _check_row(name, key, row, len(s.sample_ids), first.tensors[key])


def _check_row(name: str, key: str, row: RangeStats, samples: int, first: RangeStats) -> None:
    """One entry per sample the tensor was seen in, and the formats of the first file."""
    seen = range(samples) if row.seen_in is None else row.seen_in
    if len(row.per_sample_absmax) != len(seen) or any(not 0 <= int(j) < samples for j in seen):
        raise NpuprepError(f"{name}: tensors.{key}: per_sample_absmax has {len(row.per_sample_absmax)} "
                           f"entries for {len(seen)} samples of {samples} (an edited file?)")
    if set(row.over) != set(first.over) or set(row.under) != set(first.under):
        raise NpuprepError(f"{name}: tensors.{key}: other formats in over/under than the first file")


def _where(s: CalibrationStats) -> str:
    seed = f", seed {s.source['seed']}" if "seed" in s.source else ""
    return f"{s.source['source']} ({s.source['kind']}{seed})"


def _merge_rows(rows: list[tuple[RangeStats, tuple[str | int, ...]]], position: dict[str | int, int]) -> RangeStats:
    """One tensor's rows from disjoint samples (each with its file's sample ids), merged."""
    mx, mn = -math.inf, math.inf
    count = nan = 0
    hist: Counter[int] = Counter()
    seen: list[tuple[int, float]] = []
    for r, ids in rows:
        # A row with no value (count 0, or only NaN) records NaN, which fmax/fmin skip.
        mx, mn = float(np.fmax(mx, r.max)), float(np.fmin(mn, r.min))
        count, nan = count + r.count, nan + r.nan_count
        hist.update(r.exp_hist)
        at = range(len(ids)) if r.seen_in is None else r.seen_in
        seen.extend((position[ids[j]], v) for j, v in zip(at, r.per_sample_absmax, strict=True))
    if count == 0 or count == nan:
        mx = mn = math.nan
    seen.sort()
    base = rows[0][0]
    return RangeStats(
        tensor=base.tensor, scope=base.scope, node=base.node, min=mn, max=mx,
        absmax=max(mx, -mn) if not math.isnan(mx) else math.nan,
        count=count, nan_count=nan, inf_count=sum(r.inf_count for r, _ in rows),
        zero_count=sum(r.zero_count for r, _ in rows), exp_hist=dict(hist),
        over=_sum_maps([r.over for r, _ in rows]), under=_sum_maps([r.under for r, _ in rows]),
        per_sample_absmax=tuple(v for _, v in seen), detailed_count=sum(r.detailed_count for r, _ in rows),
        seen_in=None if len(seen) == len(position) else tuple(j for j, _ in seen),
        ordinary_hi=base.ordinary_hi,
    )


def _sum_maps(maps: list[dict[str, int]]) -> dict[str, int]:
    return {k: sum(m[k] for m in maps) for k in maps[0]}
