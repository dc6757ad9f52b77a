"""A speed-up range where the profile lacks a peak or the bandwidth: what the known figures allow.

Measured in time units of one byte at the memory bandwidth, a node costs
`max(flops / (ridge * ratio[fmt] * eff[fmt]), bytes / eff[bandwidth])`, where `ridge` is FP32's ridge
point (peak FLOPs per byte of bandwidth) and `ratio[fmt]` the format's peak over FP32's. The
bandwidth cancels from a speed-up, so a row needs only those two: taken from the published
figures where both are known, else from the profile's `throughput.assumed` ranges (each with
its source). A speed-up may rise or fall along FP32's ridge, so an assumed ridge is swept over
its range; it only rises with a format's ratio, so a ratio's two ends bound it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from npuprep.formatting import number
from npuprep.ledger.roofline import Estimate, NodeCost
from npuprep.profiles import Throughput

RIDGE_STEPS = 13  # log-spaced points of an assumed ridge range (its ends included)


@dataclass(frozen=True)
class End:
    """One end of a range and the figures that give it."""

    speedup: float
    ridge: float
    ratios: tuple[tuple[str, float], ...]
    assumed: tuple[str, ...]  # which of those figures are assumptions, not published

    def because(self) -> str:
        known = "published" if "ridge" not in self.assumed else "assumed"
        parts = [f"FP32 ridge {number(self.ridge)} FLOP/B ({known})"]
        parts += [f"{fmt.upper()} peak {number(r)}x FP32 "
                  f"({'assumed' if fmt in self.assumed else 'published'})" for fmt, r in self.ratios]
        return ", ".join(parts)


@dataclass(frozen=True)
class SpeedupRange:
    low: End
    high: End
    bytes_ratio: float  # FP32 bytes over the row's: the speed-up of an all-memory-bound model

    def to_dict(self) -> dict[str, Any]:
        return {"speedup_range": [self.low.speedup, self.high.speedup],
                "range_low_assumes": self.low.because(), "range_high_assumes": self.high.because(),
                "bytes_ratio": self.bytes_ratio}


def _ridge(tp: Throughput) -> tuple[list[float], bool] | None:
    """FP32's ridge points to try, and whether they are assumed."""
    peak, bandwidth = tp.peak("fp32"), tp.bandwidth_gbs
    if peak is not None and bandwidth is not None:
        return [peak * 1e12 / (bandwidth * 1e9)], False
    if tp.assumed_ridge_fp32 is None:
        return None
    lo, hi = tp.assumed_ridge_fp32
    if lo == hi:
        return [lo], True
    step = math.log(hi / lo) / (RIDGE_STEPS - 1)
    return [lo * math.exp(i * step) for i in range(RIDGE_STEPS)], True


def _ratio(tp: Throughput, fmt: str) -> tuple[tuple[float, ...], bool] | None:
    if fmt == "fp32":
        return (1.0,), False
    peak, peak32 = tp.peak(fmt), tp.peak("fp32")
    if peak is not None and peak32 is not None:
        return (peak / peak32,), False
    if fmt in tp.assumed_peak_vs_fp32:
        return tp.assumed_peak_vs_fp32[fmt], True
    return None


def _time(nodes: Sequence[NodeCost], ridge: float, ratio: dict[str, float], tp: Throughput) -> float:
    return sum(max(n.flops / (ridge * ratio[n.fmt] * tp.efficiency_of(n.fmt)),
                   n.bytes / tp.bandwidth_efficiency(n.fmt))
               for n in nodes if n.bound != "free")


def speedup_range(fp32: Estimate, row: Estimate, tp: Throughput) -> SpeedupRange | str:
    """The row's speed-up over FP32 at the ends the known and assumed figures allow, or why
    there is none (a figure neither published nor assumed)."""
    ridge = _ridge(tp)
    if ridge is None:
        return ("neither the FP32 peak and bandwidth nor throughput.assumed.ridge_fp32 is in the "
                "profile")
    fmts = sorted({n.fmt for n in (*fp32.nodes, *row.nodes) if n.bound != "free"})
    ratios: dict[str, tuple[float, ...]] = {}
    assumed: list[str] = ["ridge"] if ridge[1] else []
    for fmt in fmts:
        found = _ratio(tp, fmt)
        if found is None:
            return f"no throughput.assumed.peak_vs_fp32.{fmt} in the profile"
        ratios[fmt] = found[0]
        if found[1]:
            assumed.append(fmt)
    ends: list[End] = []
    for combo in itertools.product(*(ratios[f] for f in fmts)):
        ratio = dict(zip(fmts, combo, strict=True))
        for r in ridge[0]:
            t_row = _time(row.nodes, r, ratio, tp)
            if t_row > 0:
                shown = tuple((f, ratio[f]) for f in fmts if f != "fp32")
                ends.append(End(_time(fp32.nodes, r, ratio, tp) / t_row, r, shown, tuple(assumed)))
    if not ends:
        return "the row moves nothing and computes nothing"
    bytes_row = sum(n.bytes for n in row.nodes)
    bytes_ratio = sum(n.bytes for n in fp32.nodes) / bytes_row if bytes_row else 1.0
    return SpeedupRange(min(ends, key=lambda e: e.speedup), max(ends, key=lambda e: e.speedup),
                        bytes_ratio)
