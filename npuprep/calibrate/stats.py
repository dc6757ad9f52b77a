"""RangeStats per tensor, merged associatively over samples, and the stats.json round trip."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from npuprep import json_io
from npuprep.calibrate.layout import (
    HEADER,
    HI,
    HIST_BINS,
    HIST_OFFSET,
    OVER_FORMATS,
    SCOPES,
    WIDTH,
    Scope,
)
from npuprep.errors import NpuprepError
from npuprep.json_io import json_number as _num
from npuprep.numerics import get_format
from npuprep.output_files import write_text_atomic

# 2: sample ids (file names or indices) and, per tensor, the samples it was seen in, so
# that files over disjoint samples merge exactly (npuprep.calibrate.merge). 1 still loads.
SCHEMA_VERSION = 2
_READABLE = (1, 2)
_COL = {name: i for i, name in enumerate(HEADER)}
_H0 = len(HEADER)


@dataclass(frozen=True)
class RangeStats:
    """What one tensor held over all samples.

    min/max ignore NaN. `count` is every element seen; the detail (zero_count, exp_hist,
    under) covers `detailed_count` of them: all of them with `detail="all"`, and with
    `detail="auto"` every tensor-sample that was not ordinary (see
    npuprep.calibrate.instrument); nan_count, inf_count and `over` are exact either way.
    `exp_hist` maps floor(log2|x|) to a count (zeros apart, Inf/NaN apart); `over` maps a
    format to the count of |x| above its max, for the formats the calibration was exact for
    (its Scope: with detail "fp16", FP16 and BF16 only); `under` to the count of
    0 < |x| < its smallest normal (detailed elements). `ordinary_hi`: the largest abs-max a
    tensor-sample left undetailed may have had (the scope's hi, scaled with the tensor).
    `per_sample_absmax` holds one abs-max per sample
    the tensor was seen in (held elements), in sample order; `seen_in` the positions of
    those samples in CalibrationStats.sample_ids, None when it was seen in every sample.
    `unseen_raise`: where the tensor was rescaled per channel by factors fitted on these
    samples (equalised, balanced), how far a sample left out passed the clip the others gave
    (npuprep.calibrate.channels.leave_one_out_raise); its per-sample abs-maxima no longer
    show it (every sample reaches the top through some channel).
    `channel_bound`: where the tensor is another one rescaled per channel (0 elsewhere), that
    tensor's abs-max times the largest factor: what a channel reaches on a sample where the
    unrescaled tensor stays within its range (a channel quiet in calibration and loud on a
    fresh sample, raised to the others' range, passes this tensor's own abs-max).
    """

    tensor: str
    scope: str
    node: str
    min: float
    max: float
    absmax: float
    count: int
    nan_count: int
    inf_count: int
    zero_count: int
    exp_hist: dict[int, int]
    over: dict[str, int]
    under: dict[str, int]
    per_sample_absmax: tuple[float, ...]
    detailed_count: int
    seen_in: tuple[int, ...] | None = None
    ordinary_hi: float = HI
    unseen_raise: float = 1.0
    channel_bound: float = 0.0

    @property
    def complete(self) -> bool:
        """True when the detail covers every element."""
        return self.detailed_count == self.count

    def top_exponent(self) -> int | None:
        """floor(log2) of the largest finite |x|, None when no value is finite and nonzero.
        From abs-max when it is finite; past an Inf (a -inf mask) from the histogram's
        highest bin, which counts finite values only."""
        if math.isfinite(self.absmax):
            return math.floor(math.log2(self.absmax)) if self.absmax > 0 else None
        return max(self.exp_hist) if self.exp_hist else None

    def fraction_above(self, threshold: float) -> float | None:
        """Share of elements with |x| > threshold (Inf counts, NaN does not).

        Exact when threshold >= abs-max or is a format's max; otherwise read from the
        histogram, counting the bin that holds the threshold as above (a bound from above).
        None when the detail is incomplete and threshold < ordinary_hi (ordinary samples may
        hold values up to it that the histogram did not see).
        """
        if self.count == 0 or not threshold < self.absmax:
            return 0.0
        for fmt, n in self.over.items():
            if threshold == get_format(fmt).max:
                return n / self.count
        if not self.complete and threshold < self.ordinary_hi:
            return None
        above = sum(c for e, c in self.exp_hist.items() if 2.0 ** (e + 1) > threshold)
        return (above + self.inf_count) / self.count

    def fraction_below(self, threshold: float) -> float | None:
        """Share of detailed elements with 0 < |x| < threshold (zeros apart).

        Exact when threshold is a power of two (every format's smallest normal is one);
        otherwise the bin holding the threshold counts as below. None when nothing was
        detailed.
        """
        if self.detailed_count == 0:
            return None
        below = sum(c for e, c in self.exp_hist.items() if 2.0**e < threshold)
        return below / self.detailed_count

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor, "scope": self.scope, "node": self.node,
            "min": _num(self.min), "max": _num(self.max), "absmax": _num(self.absmax),
            "count": self.count, "nan_count": self.nan_count, "inf_count": self.inf_count,
            "zero_count": self.zero_count, "detailed_count": self.detailed_count,
            "exp_hist": {str(k): v for k, v in sorted(self.exp_hist.items())},
            "over": dict(sorted(self.over.items())), "under": dict(sorted(self.under.items())),
            "per_sample_absmax": [_num(v) for v in self.per_sample_absmax],
            "seen_in": None if self.seen_in is None else list(self.seen_in),
            "ordinary_hi": self.ordinary_hi,
            # Only where set: stats files of tensors never rescaled stay as they were.
            **({"unseen_raise": self.unseen_raise} if self.unseen_raise != 1.0 else {}),
            **({"channel_bound": self.channel_bound} if self.channel_bound else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RangeStats:
        return cls(
            tensor=d["tensor"], scope=d["scope"], node=d["node"],
            min=_float(d["min"]), max=_float(d["max"]), absmax=_float(d["absmax"]),
            count=int(d["count"]), nan_count=int(d["nan_count"]), inf_count=int(d["inf_count"]),
            zero_count=int(d["zero_count"]), detailed_count=int(d["detailed_count"]),
            exp_hist={int(k): int(v) for k, v in d["exp_hist"].items()},
            over={k: int(v) for k, v in d["over"].items()},
            under={k: int(v) for k, v in d["under"].items()},
            per_sample_absmax=tuple(_float(v) for v in d["per_sample_absmax"]),
            seen_in=None if d.get("seen_in") is None else tuple(int(v) for v in d["seen_in"]),
            ordinary_hi=float(d.get("ordinary_hi", HI)),
            unseen_raise=float(d.get("unseen_raise", 1.0)),
            channel_bound=float(d.get("channel_bound", 0.0)),
        )


def _float(v: float | str) -> float:
    return float(v)


@dataclass(frozen=True)
class CalibrationStats:
    """Statistics of every observed tensor, and what could not be observed and why.

    `sample_ids` names the samples, in order (file names, or indices into the source);
    `source` says where they come from (SampleSet.source_info)."""

    fingerprint: str
    samples: str
    synthetic: bool
    sample_count: int
    detail: str
    tensors: dict[str, RangeStats]
    unobserved: dict[str, str] = field(default_factory=dict)
    sample_ids: tuple[str | int, ...] = ()
    source: dict[str, Any] = field(default_factory=dict)
    # Set when these stats were measured on a source model and mapped onto its conversion
    # (npuprep.calibrate.mapping): the source fingerprint and the counts of the mapping.
    mapping: dict[str, Any] = field(default_factory=dict)

    @property
    def mapping_note(self) -> str:
        """One line on how stats of a source model were mapped onto this one ("" if not)."""
        m = self.mapping
        if not m:
            return ""
        return (f"stats of the source model {m['source']} mapped onto its conversion: "
                f"{m['by_name']} tensors by name ({m['rescaled']} rescaled), "
                f"{m['through_casts']} through Casts or constant Muls; {m['unmapped']} tensors "
                "the conversion introduced have no stats")

    def to_dict(self) -> dict[str, Any]:
        extra = {"mapping": dict(self.mapping)} if self.mapping else {}
        return {**extra,
            "schema_version": SCHEMA_VERSION,
            "kind": "stats",
            "fingerprint": self.fingerprint,
            "samples": self.samples,
            "sample_source": dict(sorted(self.source.items())),
            "sample_ids": list(self.sample_ids),
            "synthetic": self.synthetic,
            "sample_count": self.sample_count,
            "detail": self.detail,
            "tensors": {k: v.to_dict() for k, v in sorted(self.tensors.items())},
            "unobserved": dict(sorted(self.unobserved.items())),
        }

    def nearest_limits(self, fmt: str = "fp16", n: int = 10) -> list[RangeStats]:
        """Tensors with the highest abs-max relative to the format's max."""
        return sorted(self.tensors.values(), key=lambda s: (-_rank(s.absmax), s.tensor))[:n]


def _rank(v: float) -> float:
    return math.inf if math.isnan(v) else v


def save_stats(stats: CalibrationStats, path: str | Path) -> Path:
    return write_text_atomic(path, dump_stats(stats))


def dump_stats(stats: CalibrationStats) -> str:
    """The text of a stats.json."""
    return json.dumps(stats.to_dict(), indent=1, sort_keys=True) + "\n"


def read_stats_doc(path: str | Path, versions: tuple[int, ...] = _READABLE) -> dict[str, Any]:
    """The JSON of a stats file whose schema_version is one of `versions`."""
    path = Path(path)
    data = json_io.read_json(path, "stats file")
    if not isinstance(data, dict) or data.get("kind") != "stats":
        raise NpuprepError(f"{path}: not a stats file (kind is {data.get('kind') if isinstance(data, dict) else None!r})")
    if data.get("schema_version") not in versions:
        raise NpuprepError(f"{path}: stats schema_version {data.get('schema_version')} is not supported "
                           f"(expected {' or '.join(map(str, versions))})")
    return data


def stats_from_dict(data: dict[str, Any], path: str | Path = "stats") -> CalibrationStats:
    """CalibrationStats from a stats file's JSON (see CalibrationStats.to_dict)."""
    try:
        tensors = {k: RangeStats.from_dict(v) for k, v in data["tensors"].items()}
        return CalibrationStats(
            fingerprint=data["fingerprint"], samples=data["samples"], synthetic=bool(data["synthetic"]),
            sample_count=int(data["sample_count"]), detail=data["detail"], tensors=tensors,
            unobserved=dict(data.get("unobserved", {})),
            sample_ids=tuple(data.get("sample_ids", ())), source=dict(data.get("sample_source", {})),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise NpuprepError(f"{path}: malformed stats file (key {exc})") from None


class Accumulator:
    """Running statistics for k tensor rows: max of max, min of min, sum of counts."""

    def __init__(self, k: int) -> None:
        self.mx = np.full(k, -np.inf, np.float64)
        self.mn = np.full(k, np.inf, np.float64)
        self.counts = np.zeros((k, WIDTH), np.int64)
        self.per_sample: list[list[tuple[int, float]]] = [[] for _ in range(k)]
        self.samples = 0

    def add(self, fx: np.ndarray, fn: np.ndarray, ii: np.ndarray, sample: int) -> None:
        """Fold one sample's FX, FN, I vectors in."""
        rows = ii.reshape(-1, WIDTH)
        self.mx = np.fmax(self.mx, fx)
        self.mn = np.fmin(self.mn, fn)
        self.counts += rows
        seen = rows[:, _COL["count"]] > 0
        am = np.fmax(fx, -fn.astype(np.float64))
        for row in np.flatnonzero(seen):
            self.per_sample[row].append((sample, float(am[row])))
        self.samples += 1

    def merge(self, other: Accumulator) -> None:
        self.mx = np.fmax(self.mx, other.mx)
        self.mn = np.fmin(self.mn, other.mn)
        self.counts += other.counts
        for mine, theirs in zip(self.per_sample, other.per_sample, strict=True):
            mine.extend(theirs)
        self.samples += other.samples

    def row(self, i: int, tensor: str, scope: str, node: str, exact: Scope = SCOPES["auto"],
            narrow: bool = False) -> RangeStats:
        """Row i's RangeStats; `exact`: what the calibration was exact for (its ordinary range,
        the formats whose counts above their max are kept); `narrow`: the row kept the "auto"
        range (npuprep.calibrate.layout.Slot)."""
        c = self.counts[i]
        hist = c[_H0:]
        nan = int(c[_COL["nan"]])
        exp_hist = {b - HIST_OFFSET: int(hist[b]) for b in range(1, HIST_BINS - 1) if hist[b]}
        under = {}
        for fmt in OVER_FORMATS + ("fp32",):
            limit = math.log2(get_format(fmt).min_normal)
            under[fmt] = sum(v for e, v in exp_hist.items() if e < limit)
        count = int(c[_COL["count"]])
        mx, mn = float(self.mx[i]), float(self.mn[i])
        if count == 0 or count == nan:
            mx = mn = math.nan
        absmax = max(mx, -mn) if not math.isnan(mx) else math.nan
        ordered = sorted(self.per_sample[i])
        per_sample = tuple(v for _, v in ordered)
        seen_in = None if len(ordered) == self.samples else tuple(j for j, _ in ordered)
        return RangeStats(
            tensor=tensor, scope=scope, node=node, min=mn, max=mx, absmax=absmax,
            count=count, nan_count=nan, inf_count=int(hist[HIST_BINS - 1]) - nan,
            zero_count=int(hist[0]), exp_hist=exp_hist,
            over={f: int(c[_COL[f"over_{f}"]]) for f in exact.formats},
            under=under, per_sample_absmax=per_sample, detailed_count=int(c[_COL["detailed"]]),
            seen_in=seen_in, ordinary_hi=exact.range_of(narrow)[1],
        )
