"""Apply a plan to the FP32 graph: clamps first, then rescales; the function is unchanged where exact.

Clamps go first so that a later rescale scales their bounds with the tensor they guard.
Scales of successive rescales compose multiplicatively in `tensor_scales`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from npuprep.plan import Clamp, Declined, Plan
from npuprep.rewrite.clamp import apply_clamp, guard_denominator
from npuprep.rewrite.rescale import apply_rescale
from npuprep.rewrite.result import RewriteResult


@dataclass(frozen=True)
class AppliedPlan:
    """The rewritten FP32 model and what each action did."""

    model: onnx.ModelProto
    tensor_scales: dict[str, float]
    fp32_nodes: tuple[str, ...]
    applied: tuple[str, ...]
    declined: tuple[Declined, ...] = field(default_factory=tuple)


def apply_plan(model: onnx.ModelProto, plan: Plan) -> AppliedPlan:
    """Run the plan's clamps and rescales in order; a declined rewrite is recorded, not fatal."""
    current = model
    scales: dict[str, float] = {}
    fp32_nodes: list[str] = []
    applied: list[str] = []
    declined: list[Declined] = []
    for clamp in plan.clamps():
        result = _clamp(current, clamp)
        if result.modified:
            current = result.model
            applied.append(f"clamp {clamp.tensor} to [{clamp.lo}, {clamp.hi}]")
        else:
            declined.append(Declined("clamp", clamp.tensor, result.reason, clamp.findings))
    for rescale in plan.rescales():
        result = apply_rescale(current, rescale.entry, rescale.k)
        if not result.modified:
            declined.append(Declined("rescale", rescale.entry, result.reason, rescale.findings))
            continue
        current = result.model
        for tensor, s in dict(result.details.get("tensor_scales", {})).items():
            scales[tensor] = scales.get(tensor, 1.0) * float(s)
        fp32_nodes += list(result.details.get("fp32_nodes", []))
        applied.append(f"rescale {rescale.entry} by 2^-{rescale.k}")
    scales = {t: s for t, s in sorted(scales.items()) if s != 1.0}
    return AppliedPlan(current, scales, tuple(fp32_nodes), tuple(applied), tuple(declined))


def _clamp(model: onnx.ModelProto, clamp: Clamp) -> RewriteResult:
    if clamp.kind != "denominator" or not clamp.consumers:
        return apply_clamp(model, clamp.tensor, clamp.lo, clamp.hi,
                           consumers=list(clamp.consumers) or None)
    # A denominator guard keeps the sign: one Where per dividing node.
    current, modified, reasons = model, False, []
    for div in clamp.consumers:
        step = guard_denominator(current, div, float(clamp.lo or 0.0))
        if step.modified:
            current, modified = step.model, True
        else:
            reasons.append(step.reason)
    return RewriteResult(current, modified, "; ".join(reasons) or f"guarded {clamp.tensor}")
