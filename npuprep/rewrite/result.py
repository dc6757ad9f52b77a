"""RewriteResult: what every rewrite returns (the model, whether it changed, and why)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import onnx


@dataclass(frozen=True)
class RewriteResult:
    """The outcome of one rewrite.

    `modified` is False when the rewrite declined; `reason` then says why in a sentence a
    report can print, and `model` is the input unchanged. Truthy when the model changed.
    `details` carries rewrite-specific facts (e.g. "tensor_scales" for rescale).
    """

    model: onnx.ModelProto
    modified: bool
    reason: str
    details: Mapping[str, object] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.modified


@dataclass(frozen=True)
class Skipped:
    """A planned rewrite that declined when applied: which remedy, where, and why.

    `findings` are the plan's finding references, passed through untouched.
    """

    remedy: str
    target: str
    reason: str
    findings: tuple[Any, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"remedy": self.remedy, "target": self.target, "reason": self.reason,
                "findings": [f.to_dict() for f in self.findings]}


def sites_result(model: onnx.ModelProto, rewritten: Callable[[], onnx.ModelProto],
                 replaced: dict[str, str], declined: dict[str, str], *, nothing: str,
                 done: str) -> RewriteResult:
    """The result of a rewrite applied wherever its pattern matched: `rewritten()` builds the
    new model when a site was replaced; otherwise the reason names every declined site, or
    says `nothing` matched. details: "replaced" {site: how}, "declined" {site: why}."""
    details = {"replaced": replaced, "declined": declined}
    if not replaced:
        why = "; ".join(f"{n}: {r}" for n, r in declined.items()) or nothing
        return RewriteResult(model, False, why, details)
    return RewriteResult(rewritten(), True, done, details)
