"""Finding: one place where a model will misbehave on the target, with evidence and a remedy."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from npuprep.profiles import Severity

# Rules whose finding means "this node needs more than the format the run computes in".
SENSITIVE_RULES = ("hazard.", "pattern.", "autocast.", "range.overflow", "range.headroom",
                   "range.underflow", "precision.")


# What each remedy a plan can make does, in words (`Finding.planned`).
PLANNED_WORDS = {
    "rescale": "the plan rescales it by a power of two (exact)",
    "softmax_shift": "the plan subtracts the max before the Exp (exact)",
    "clamp": "the plan clamps it",
    "pin_fp32": "the plan pins it to FP32",
    "host_scale": "the output leaves the device scaled; the host multiplies it back",
    "none": "the plan leaves it in the target's format (measured safe, or no remedy holds)",
}


def remedy_words(remedy: str, suggested: str, remedy_text: str) -> str:
    """How a finding is remedied, in words: the rule's `remedy_text` when the plan did what the
    rule suggested, else what the plan did (a page never recommends a pin nobody made)."""
    if remedy == suggested or remedy not in PLANNED_WORDS:
        return remedy_text
    return PLANNED_WORDS[remedy]


@dataclass(frozen=True)
class Finding:
    """One hazard at one node or tensor.

    `rule` is a dotted id (`dtype.unsupported`, `hazard.exp`, `range.overflow`, ...);
    `evidence` holds the numbers behind the verdict; `remedy` is what the rule suggests
    (`rescale`, `pin_fp32`, `clamp`, `convert_dtype`, `fold`, `none`; the planner reads it),
    with `remedy_text` saying it in words. `planned` is what the plan did for it (set by
    npuprep.plan.remedies; "" before planning): people are shown that one, never a suggestion
    the plan did not take.
    """

    rule: str
    severity: Severity
    node: str
    op_type: str
    message: str
    tensor: str = ""
    scope: str = "main"
    evidence: dict[str, Any] = field(default_factory=dict)
    remedy: str = "none"
    remedy_text: str = ""
    planned: str = ""

    @property
    def shown_remedy(self) -> str:
        """The remedy to show: the plan's when planned, else the rule's suggestion."""
        return self.planned or self.remedy

    @property
    def shown_remedy_text(self) -> str:
        return remedy_words(self.shown_remedy, self.remedy, self.remedy_text)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "severity": str(self.severity),
            "node": self.node,
            "op_type": self.op_type,
            "tensor": self.tensor,
            "scope": self.scope,
            "message": self.message,
            "evidence": dict(self.evidence),
            "remedy": self.shown_remedy,
            "suggested_remedy": self.remedy,
            "remedy_text": self.remedy_text,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        return cls(
            rule=d["rule"], severity=Severity.parse(d["severity"]), node=d["node"],
            op_type=d["op_type"], message=d["message"], tensor=d.get("tensor", ""),
            scope=d.get("scope", "main"), evidence=dict(d.get("evidence", {})),
            remedy=d.get("suggested_remedy", d.get("remedy", "none")),
            remedy_text=d.get("remedy_text", ""),
            planned=d.get("remedy", "") if "suggested_remedy" in d else "",
        )


@dataclass(frozen=True)
class Findings:
    """An ordered collection of findings; truthy when it holds nothing at `error`."""

    items: tuple[Finding, ...] = ()

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return not self.reaching(Severity.ERROR)

    def reaching(self, severity: Severity) -> list[Finding]:
        return [f for f in self.items if f.severity >= severity]

    def by_node(self) -> dict[str, list[Finding]]:
        out: dict[str, list[Finding]] = {}
        for f in self.items:
            out.setdefault(f.node, []).append(f)
        return out

    def merged(self, other: Iterable[Finding]) -> Findings:
        return Findings(self.items + tuple(other))

    def to_dict(self) -> list[dict[str, Any]]:
        return [f.to_dict() for f in self.items]


def is_sensitive(finding: Finding) -> bool:
    """A finding that asks for more than the target's default precision for its node."""
    return finding.severity >= Severity.WARNING and finding.rule.startswith(SENSITIVE_RULES)
