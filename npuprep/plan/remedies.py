"""What the plan did for each finding: `findings, plan -> findings` with `planned` set.

    hazard.exp at Exp_3, answered by SoftmaxShift(exp=Exp_3)    -> planned "softmax_shift"
    range.overflow at MatMul_1, answered by Rescale             -> planned "rescale"
    hazard.pow at Pow_2, node in a PinFp32 island               -> planned "pin_fp32"
    range.overflow at the graph output y, scaled on the host    -> planned "host_scale"
    range.headroom at Add_4, measured safe (no action)          -> planned "none"

A rule suggests a remedy (`Finding.remedy`, which the planner reads); the plan decides. Check,
crosscheck, checklist and convert's report show the decision, so a PASSED page never
recommends a pin that was never made.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from npuprep.analyse.finding import Finding, Findings
from npuprep.plan.actions import FindingRef
from npuprep.plan.plan import Plan

# Suggestions the planner weighs; other suggestions (convert_dtype, fold) are done by the
# lowering and the pre-plan passes whatever the plan says, so they stand as suggested.
PLANNED_SUGGESTIONS = ("rescale", "pin_fp32", "clamp", "softmax_shift")
# A finding the plan leaves in the target's format: measured safe, or no remedy that holds.
LEFT_IN_FORMAT = "none"


def planned_remedy(finding: Finding, answered: Mapping[FindingRef, str], pinned: set[str],
                   host_scaled: Iterable[str] = ()) -> str:
    """What the plan does for `finding` (see the module's table)."""
    action = answered.get(FindingRef.of(finding))
    if action:
        return action
    members = (finding.node, *finding.evidence.get("members", ()))
    if any(m in pinned for m in members if m):
        return "pin_fp32"
    if finding.tensor and finding.tensor in set(host_scaled):
        return "host_scale"
    return LEFT_IN_FORMAT if finding.remedy in PLANNED_SUGGESTIONS else finding.remedy


def remedied(findings: Findings | Iterable[Finding], plan: Plan,
             host_scales: Mapping[str, float] | None = None) -> Findings:
    """`findings` with `planned` set to what `plan` does for each; `host_scales` (output ->
    factor, the conversion's) name the outputs that leave the device scaled."""
    answered: dict[FindingRef, str] = {}
    for action in plan.actions:
        for ref in action.findings:
            answered.setdefault(ref, action.action)
    pinned = plan.pinned_nodes()
    scaled = tuple(host_scales or ())
    return Findings(tuple(replace(f, planned=planned_remedy(f, answered, pinned, scaled))
                          for f in findings))

