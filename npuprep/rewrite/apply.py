"""Apply a plan to the FP32 graph: softmax shifts, then clamps, then rescales; the function is unchanged where exact.

Shifts go first (exact, they only add a subtraction); clamps next, so that a later rescale
scales their bounds with the tensor they guard. Scales of successive rescales compose
multiplicatively in `tensor_scales`. The plan is read through its actions' fields only
(rewrite never imports plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import onnx

from npuprep.rewrite.clamp import apply_clamp, guard_denominator
from npuprep.rewrite.graph_ops import check_model
from npuprep.rewrite.rescale import apply_rescale
from npuprep.rewrite.result import RewriteResult, Skipped
from npuprep.rewrite.softmax_shift import apply_softmax_shift


@dataclass(frozen=True)
class AppliedPlan:
    """The rewritten FP32 model and what each action did.

    `fp32_nodes` are nodes the rewrites inserted that must stay FP32 (an output's
    compensation after its Cast, a softmax shift on coarse logits), each with its reason in
    `fp32_reasons`; `input_nodes` maps the power-of-two Muls inserted on graph inputs to
    their input, which need FP32 only when the input itself exceeds the target.
    """

    model: onnx.ModelProto
    tensor_scales: dict[str, float]
    fp32_nodes: tuple[str, ...]
    applied: tuple[str, ...]
    declined: tuple[Skipped, ...] = field(default_factory=tuple)
    input_nodes: dict[str, str] = field(default_factory=dict)
    fp32_reasons: dict[str, str] = field(default_factory=dict)


def apply_plan(model: onnx.ModelProto, plan: Any) -> AppliedPlan:
    """Run the plan's shifts, clamps and rescales in order; a declined rewrite is recorded,
    not fatal."""
    current = model
    scales: dict[str, float] = {}
    fp32_nodes: list[str] = []
    input_nodes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    applied: list[str] = []
    declined: list[Skipped] = []
    for shift in plan.shifts():
        result = apply_softmax_shift(current, shift.exp)
        if result.modified:
            current = result.model
            if shift.fp32_shift:
                for node in result.details.get("nodes", []):
                    fp32_nodes.append(node)
                    reasons[node] = f"subtracts the row maximum in FP32 before softmax {shift.exp}"
            applied.append(f"shift softmax Exp {shift.exp} by its row maximum")
        else:
            declined.append(Skipped("softmax_shift", shift.exp, result.reason, shift.findings))
    for clamp in plan.clamps():
        result = _clamp(current, clamp)
        if result.modified:
            current = result.model
            applied.append(f"clamp {clamp.tensor} to [{clamp.lo}, {clamp.hi}]")
        else:
            declined.append(Skipped("clamp", clamp.tensor, result.reason, clamp.findings))
    for rescale in plan.rescales():
        result = apply_rescale(current, rescale.entry, rescale.k, run_checker=False)
        if not result.modified:
            declined.append(Skipped("rescale", rescale.entry, result.reason, rescale.findings))
            continue
        current = result.model
        for tensor, s in dict(result.details.get("tensor_scales", {})).items():
            scales[tensor] = scales.get(tensor, 1.0) * float(s)
        inputs = dict(result.details.get("input_nodes", {}))
        input_nodes.update(inputs)
        for node in result.details.get("fp32_nodes", []):
            if node in inputs:
                reasons[node] = f"scales graph input {inputs[node]} by a power of two"
            else:
                fp32_nodes.append(node)
                reasons[node] = (f"undoes the rescale of {rescale.entry} at a graph output, in "
                                 "FP32 after the output Cast")
        applied.append(f"rescale {rescale.entry} by 2^{-rescale.k}")
    if any(a.startswith("rescale ") for a in applied):
        # Once for the whole series: each full check re-infers every shape of the model.
        check_model(current)
    # Tensors a rewrite made (a clamp's output) have no reference to be compared with.
    known = {t for n in model.graph.node for t in n.output} | {i.name for i in model.graph.input}
    scales = {t: s for t, s in sorted(scales.items()) if s != 1.0 and t in known}
    return AppliedPlan(current, scales, tuple(fp32_nodes), tuple(applied), tuple(declined),
                       dict(sorted(input_nodes.items())), dict(sorted(reasons.items())))


def _clamp(model: onnx.ModelProto, clamp: Any) -> RewriteResult:
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
