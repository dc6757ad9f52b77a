"""What overflow looked like: observed vs FP32 reference -> inf | nan | saturate | other-finite | no-overflow.

Only the elements whose FP32 reference reaches the format's overflow threshold (65520 in
FP16, 464 in E4M3) can show the overflow behaviour; each of them is sorted into one bucket
and the biggest bucket gives the verdict. A value beyond the format's max that comes through
exactly means the runtime computed wider than the declared format: that is reported as
`no-overflow` with `wider=True`, not as a pass.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from npuprep.json_io import json_number as _num

if TYPE_CHECKING:  # numpy only at run time: torch_runner classifies on machines without onnx
    from npuprep.numerics import NumberFormat

# A wider runtime returns values beyond max within its own rounding; 1% separates that from
# a compressed or clamped value.
EXACT_RTOL = 1e-2
MAX_PAIRS = 4


class Verdict(enum.StrEnum):
    INF = "inf"
    NAN = "nan"
    SATURATE = "saturate"
    OTHER_FINITE = "other-finite"
    NO_OVERFLOW = "no-overflow"

    @property
    def conclusive(self) -> bool:
        return self is not Verdict.NO_OVERFLOW


# Tie-break order when two buckets hold as many elements: the louder or stranger one wins.
_ORDER = (Verdict.NAN, Verdict.INF, Verdict.SATURATE, Verdict.OTHER_FINITE)


@dataclass(frozen=True)
class Classification:
    """One tensor's overflow behaviour with the counts and value pairs behind it."""

    verdict: Verdict
    reason: str
    threshold: float
    reference_absmax: float
    over: int = 0
    inf: int = 0
    nan: int = 0
    saturated: int = 0
    exact: int = 0
    other: int = 0
    flushed: int = 0
    sign_flipped: int = 0
    in_range_wrong: int = 0
    wider: bool = False
    pairs: tuple[tuple[float, float], ...] = ()

    def __bool__(self) -> bool:
        """True when the tensor shows a definite overflow behaviour (the probe worked)."""
        return self.verdict.conclusive

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": str(self.verdict),
            "reason": self.reason,
            "threshold": self.threshold,
            "reference_absmax": self.reference_absmax,
            "counts": {
                "over": self.over, "inf": self.inf, "nan": self.nan, "saturated": self.saturated,
                "exact": self.exact, "other": self.other, "flushed": self.flushed,
                "sign_flipped": self.sign_flipped, "in_range_wrong": self.in_range_wrong,
            },
            "wider": self.wider,
            "pairs": [{"reference": _num(r), "observed": _num(o)} for r, o in self.pairs],
        }


def in_range_tolerance(fmt: NumberFormat) -> float:
    """Relative error that still counts as right for an in-range value: rounding, not a fault."""
    return max(0.05, 2 * fmt.eps)


def classify(reference: np.ndarray, observed: np.ndarray, fmt: NumberFormat) -> Classification:
    """Classify `observed` (what the target gave) against the FP32 `reference`."""
    ref = np.asarray(reference, dtype=np.float64).ravel()
    obs = np.asarray(observed).astype(np.float64).ravel()
    if ref.shape != obs.shape:
        raise ValueError(f"reference has {ref.size} values, observed {obs.size}")
    threshold = fmt.overflow_threshold
    finite_ref = np.isfinite(ref)
    absmax = float(np.max(np.abs(ref[finite_ref]))) if finite_ref.any() else 0.0
    over = finite_ref & (np.abs(ref) >= threshold)
    inside = finite_ref & ~over
    tol = in_range_tolerance(fmt)
    with np.errstate(invalid="ignore", over="ignore"):
        wrong_inside = inside & ~(np.abs(obs - ref) <= tol * (np.abs(ref) + absmax * tol))
        # Below the min normal both ways is underflow (subnormal rounding, flush to 0), not overflow.
        underflow = wrong_inside & (np.abs(ref) < fmt.min_normal) & (np.abs(obs) < fmt.min_normal)
    wrong_inside &= ~underflow
    in_range_wrong = int(wrong_inside.sum())
    base = {"threshold": threshold, "reference_absmax": absmax}
    if underflow.any() and not over.any() and not in_range_wrong:
        return Classification(
            Verdict.NO_OVERFLOW,
            f"no overflow: the FP32 reference stays below {threshold:g} (max |x| = {absmax:.6g}); "
            f"{int(underflow.sum())} values below the {fmt.name} min normal {fmt.min_normal:.3g} "
            "rounded as subnormals or flushed to 0 (underflow)",
            flushed=int((underflow & (obs == 0)).sum()), **base,
        )

    if not over.any():
        return _classify_in_range(ref, obs, fmt, wrong_inside, in_range_wrong, base)

    r, o = ref[over], obs[over]
    is_nan = np.isnan(o)
    is_inf = np.isinf(o)
    finite = ~is_nan & ~is_inf
    is_sat = finite & (np.abs(o) == fmt.max) & (np.sign(o) == np.sign(r))
    with np.errstate(invalid="ignore"):
        is_exact = finite & ~is_sat & (np.abs(o - r) <= EXACT_RTOL * np.abs(r))
    is_other = finite & ~is_sat & ~is_exact
    counts = {
        Verdict.NAN: int(is_nan.sum()),
        Verdict.INF: int(is_inf.sum()),
        Verdict.SATURATE: int(is_sat.sum()),
        Verdict.OTHER_FINITE: int(is_other.sum()),
    }
    exact = int(is_exact.sum())
    masks = {Verdict.NAN: is_nan, Verdict.INF: is_inf, Verdict.SATURATE: is_sat,
             Verdict.OTHER_FINITE: is_other}
    fields = dict(
        over=int(over.sum()), inf=counts[Verdict.INF], nan=counts[Verdict.NAN],
        saturated=counts[Verdict.SATURATE], exact=exact, other=counts[Verdict.OTHER_FINITE],
        flushed=int((is_other & (o == 0)).sum()),
        sign_flipped=int((is_other & (np.sign(o) == -np.sign(r)) & (o != 0)).sum()),
        in_range_wrong=in_range_wrong, **base,
    )
    n = fields["over"]
    lead = max(_ORDER, key=lambda v: (counts[v], -_ORDER.index(v)))
    if exact > counts[lead]:
        return Classification(
            Verdict.NO_OVERFLOW,
            f"computed wider than {fmt.name}: {exact} of {n} values beyond {fmt.max:g} came "
            f"through exactly (the runtime did not compute in {fmt.name})",
            wider=True, pairs=_pairs(r, o, is_exact), **fields,
        )
    what = {
        Verdict.NAN: "came out as NaN",
        Verdict.INF: "came out as +-Inf",
        Verdict.SATURATE: f"were clamped to +-{fmt.max:g}",
        Verdict.OTHER_FINITE: _other_words(fields),
    }[lead]
    return Classification(lead, f"{counts[lead]} of {n} values at or beyond {threshold:g} {what}",
                          pairs=_pairs(r, o, masks[lead]), **fields)


def _classify_in_range(ref: np.ndarray, obs: np.ndarray, fmt: NumberFormat,
                       wrong: np.ndarray, in_range_wrong: int, base: dict) -> Classification:
    """No reference value crosses the limit: anything odd is an overflow inside the unit."""
    if not in_range_wrong:
        return Classification(
            Verdict.NO_OVERFLOW,
            f"the FP32 reference stays below {base['threshold']:g} (max |x| = "
            f"{base['reference_absmax']:.6g}) and the outputs match it",
            **base,
        )
    o = obs[wrong]
    nan, inf = int(np.isnan(o).sum()), int(np.isinf(o).sum())
    sat = int((np.abs(o) == fmt.max).sum())
    other = in_range_wrong - nan - inf - sat
    counts = {Verdict.NAN: nan, Verdict.INF: inf, Verdict.SATURATE: sat, Verdict.OTHER_FINITE: other}
    lead = max(_ORDER, key=lambda v: (counts[v], -_ORDER.index(v)))
    return Classification(
        lead,
        f"internal overflow: the FP32 reference stays in range (max |x| = "
        f"{base['reference_absmax']:.6g}) but {in_range_wrong} values came out wrong "
        f"({nan} NaN, {inf} Inf, {sat} at +-{fmt.max:g}, {other} other)",
        inf=inf, nan=nan, saturated=sat, other=other, in_range_wrong=in_range_wrong,
        pairs=_pairs(ref[wrong], o, np.ones(o.shape, bool)), **base,
    )


def _other_words(fields: dict) -> str:
    parts = []
    if fields["flushed"]:
        parts.append(f"{fields['flushed']} flushed to 0")
    if fields["sign_flipped"]:
        parts.append(f"{fields['sign_flipped']} sign-flipped (wrapped)")
    rest = fields["other"] - fields["flushed"] - fields["sign_flipped"]
    if rest:
        parts.append(f"{rest} compressed or otherwise wrong")
    return "came out finite but wrong (" + ", ".join(parts) + ")"


def _pairs(ref: np.ndarray, obs: np.ndarray, mask: np.ndarray) -> tuple[tuple[float, float], ...]:
    idx = np.flatnonzero(mask)[:MAX_PAIRS]
    return tuple((float(ref[i]), float(obs[i])) for i in idx)


@dataclass(frozen=True)
class Overall:
    """The verdict over several probes: one class when all conclusive probes agree."""

    verdict: str  # a Verdict value, or "mixed"
    by_verdict: dict[str, tuple[str, ...]]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reason": self.reason,
                "by_verdict": {k: list(v) for k, v in sorted(self.by_verdict.items())}}


def overall(verdicts: Iterable[tuple[str, Verdict]]) -> Overall:
    """Combine per-probe verdicts; `mixed` when units behave differently (e.g. MAC vs vector)."""
    groups: dict[str, list[str]] = {}
    for name, verdict in verdicts:
        groups.setdefault(str(verdict), []).append(name)
    by_verdict = {k: tuple(v) for k, v in groups.items()}
    conclusive = sorted(k for k in by_verdict if Verdict(k).conclusive)
    if not conclusive:
        return Overall(str(Verdict.NO_OVERFLOW), by_verdict, "no probe overflowed: inconclusive")
    if len(conclusive) == 1:
        v = conclusive[0]
        return Overall(v, by_verdict, f"every probe that overflowed gave {v}")
    detail = "; ".join(f"{k}: {', '.join(by_verdict[k])}" for k in conclusive)
    return Overall("mixed", by_verdict, f"units differ ({detail})")
