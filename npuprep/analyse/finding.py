"""Finding: one place where a model will misbehave on the target, with evidence and a remedy."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from npuprep.profiles import Severity

# Rules whose finding means "this node needs more than the format the run computes in".
SENSITIVE_RULES = ("hazard.", "pattern.", "autocast.", "range.overflow", "range.headroom",
                   "range.underflow", "precision.")


@dataclass(frozen=True)
class Finding:
    """One hazard at one node or tensor.

    `rule` is a dotted id (`dtype.unsupported`, `hazard.exp`, `range.overflow`, ...);
    `evidence` holds the numbers behind the verdict; `remedy` is one of `rescale`,
    `pin_fp32`, `clamp`, `convert_dtype`, `fold`, `none`, with `remedy_text` saying it in words.
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
            "remedy": self.remedy,
            "remedy_text": self.remedy_text,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        return cls(
            rule=d["rule"], severity=Severity.parse(d["severity"]), node=d["node"],
            op_type=d["op_type"], message=d["message"], tensor=d.get("tensor", ""),
            scope=d.get("scope", "main"), evidence=dict(d.get("evidence", {})),
            remedy=d.get("remedy", "none"), remedy_text=d.get("remedy_text", ""),
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
