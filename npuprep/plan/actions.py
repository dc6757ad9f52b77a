"""Plan actions: Rescale, Clamp, PinFp32 and Declined, each carrying its finding and its why;
Unpinnable, a hazard only a pin fixes on a target that cannot pin."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from npuprep.analyse.finding import Finding

ClampKind = Literal["exp", "square", "denominator", "log", "user"]
CLAMP_KINDS: tuple[str, ...] = ("exp", "square", "denominator", "log", "user")
REMEDIES: tuple[str, ...] = ("softmax_shift", "rescale", "pin_fp32", "clamp")


@dataclass(frozen=True, order=True)
class FindingRef:
    """Which finding an action answers: its rule and where it was raised."""

    rule: str
    node: str = ""
    tensor: str = ""

    @classmethod
    def of(cls, finding: Finding) -> FindingRef:
        return cls(rule=finding.rule, node=finding.node, tensor=finding.tensor)

    def to_dict(self) -> dict[str, str]:
        out = {"rule": self.rule}
        if self.node:
            out["node"] = self.node
        if self.tensor:
            out["tensor"] = self.tensor
        return out

    def __str__(self) -> str:
        where = self.tensor or self.node
        return f"{self.rule} at {where}" if where else self.rule


@dataclass(frozen=True)
class Rescale:
    """Multiply the entry's weights (or a graph input) by 2^-k; the scale travels through
    `domain` (tensor -> exponent e: the tensor is multiplied by 2**e) and is undone
    exactly by `absorbers`.

    `absmax`/`absmax_after` are the measured largest magnitude of the overflowing tensor
    before and after, against `limit` (headroom x max of the target format). A negative k
    scales up, the cure for underflow.
    """

    entry: str
    k: int
    domain: dict[str, int] = field(default_factory=dict)
    absorbers: tuple[str, ...] = ()
    findings: tuple[FindingRef, ...] = ()
    absmax: float = 0.0
    limit: float = 0.0
    absmax_after: float = 0.0
    why: str = ""

    action = "rescale"

    @property
    def scale(self) -> float:
        return 2.0 ** (-self.k)

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "entry": self.entry,
            "k": self.k,
            "domain": dict(sorted(self.domain.items())),
            "absorbers": list(self.absorbers),
            "findings": [f.to_dict() for f in self.findings],
            "absmax": self.absmax,
            "limit": self.limit,
            "absmax_after": self.absmax_after,
            "why": self.why,
        }


@dataclass(frozen=True)
class Clamp:
    """Clip `tensor` into [lo, hi] where `consumers` read it (empty: every reader and the
    graph output).

    For kind `denominator`, `lo` is the smallest magnitude let through (the sign is kept)
    and `hi` is None. `measured` holds the numbers that set the bounds (absmax, share of
    values the clamp changes, ...).
    """

    tensor: str
    lo: float | None
    hi: float | None
    kind: ClampKind
    consumers: tuple[str, ...] = ()
    findings: tuple[FindingRef, ...] = ()
    measured: dict[str, float] = field(default_factory=dict)
    why: str = ""

    action = "clamp"

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "tensor": self.tensor,
            "lo": self.lo,
            "hi": self.hi,
            "kind": self.kind,
            "consumers": list(self.consumers),
            "findings": [f.to_dict() for f in self.findings],
            "measured": dict(sorted(self.measured.items())),
            "why": self.why,
        }


@dataclass(frozen=True)
class PinFp32:
    """Keep `nodes` in FP32; `exit_tensors` leave the island and fit the target range.

    `forced` marks a pin the user wrote into the plan. `request` marks a pin on a target
    whose compiler decides precision itself: it travels in the constraint file and
    crosscheck verifies it was honoured.
    """

    nodes: tuple[str, ...]
    exit_tensors: tuple[str, ...] = ()
    findings: tuple[FindingRef, ...] = ()
    measured: dict[str, float] = field(default_factory=dict)
    forced: bool = False
    request: bool = False
    why: str = ""

    action = "pin_fp32"

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "nodes": list(self.nodes),
            "exit_tensors": list(self.exit_tensors),
            "findings": [f.to_dict() for f in self.findings],
            "measured": dict(sorted(self.measured.items())),
            "forced": self.forced,
            "request": self.request,
            "why": self.why,
        }


@dataclass(frozen=True)
class SoftmaxShift:
    """Subtract ReduceMax(x) from the input x of `exp`, a written-out softmax's Exp
    (`Exp(x) / ReduceSum(Exp(x))`): exact, and Exp's output stays within (0, 1].

    `covers` are the tensors whose range the shift brings down (the Exp output, the sum,
    the quotient); `measured` holds the Exp input's absmax and spread. `fp32_shift`: the
    subtraction itself runs in FP32, because the Exp input is too large for its
    target-format rounding (a relative error of exp's output) to be harmless.
    """

    exp: str
    covers: tuple[str, ...] = ()
    fp32_shift: bool = False
    findings: tuple[FindingRef, ...] = ()
    measured: dict[str, float] = field(default_factory=dict)
    why: str = ""

    action = "softmax_shift"

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "exp": self.exp,
            "covers": list(self.covers),
            "fp32_shift": self.fp32_shift,
            "findings": [f.to_dict() for f in self.findings],
            "measured": dict(sorted(self.measured.items())),
            "why": self.why,
        }


@dataclass(frozen=True)
class Declined:
    """A remedy considered and not taken, with the sentence saying why."""

    remedy: str
    target: str
    reason: str
    findings: tuple[FindingRef, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "remedy": self.remedy,
            "target": self.target,
            "reason": self.reason,
            "findings": [f.to_dict() for f in self.findings],
        }


class Hazard(StrEnum):
    """What only an FP32 pin fixes: a Sin/Cos phase too coarse for the format's spacing, or
    a Log chain floored at the smallest subnormal where a pin would keep it exact."""

    COARSE_PHASE = "coarse_phase"
    LOG_FLOOR = "log_floor"


@dataclass(frozen=True)
class Unpinnable:
    """A hazard only an FP32 pin of `nodes` fixes, found on a target that cannot pin.

    `tensor` is where it shows (the phase, the Log's input); `why` is the sentence a failed
    conversion names as its cause. Kept typed so the verdict reads it, not the plan's notes.
    """

    hazard: Hazard
    tensor: str
    nodes: tuple[str, ...]
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"hazard": self.hazard.value, "tensor": self.tensor, "nodes": list(self.nodes),
                "why": self.why}


Action = SoftmaxShift | Rescale | Clamp | PinFp32
