"""For targets that cannot pin: a clamp before a written-out softmax's Exp -> the exact max shift.

    Clamp(logits, hi=10.4) before Exp -> ReduceSum -> Div   =>   no clamp; Exp(logits - max)

A clamp changes the softmax wherever it bites; subtracting the row max changes nothing
and keeps every Exp input <= 0. Decision only: npuprep.rewrite.softmax_shift rewrites.
"""

from __future__ import annotations

from dataclasses import replace

import onnx

from npuprep.graph import node_label
from npuprep.plan import Plan
from npuprep.profiles import Pinning, TargetProfile
from npuprep.rewrite.softmax_shift import softmax_head


def shifts_instead_of_clamps(model: onnx.ModelProto, plan: Plan,
                             profile: TargetProfile) -> tuple[Plan, tuple[str, ...]]:
    """The plan without the clamps a softmax shift replaces, and the Exp nodes to shift."""
    if profile.fp32_pinning is not Pinning.NONE:
        return plan, ()
    shifts: list[str] = []
    dropped = []
    for clamp in plan.clamps():
        readers = [n for n in model.graph.node if clamp.tensor in n.input
                   and (not clamp.consumers or node_label(n) in clamp.consumers)]
        exps = [node_label(n) for n in readers if n.op_type == "Exp"]
        if exps and len(exps) == len(readers) and \
                all(not isinstance(softmax_head(model, e), str) for e in exps):
            shifts += exps
            dropped.append(clamp)
    if not dropped:
        return plan, ()
    kept = tuple(a for a in plan.actions if not any(a is d for d in dropped))
    return replace(plan, actions=kept), tuple(dict.fromkeys(shifts))
