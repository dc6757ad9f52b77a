"""Remedy 1, softmax shift: `Exp(x) / ReduceSum(Exp(x))` -> subtract ReduceMax(x) before the Exp.

Exact whatever x holds, and it keeps Exp's output within (0, 1], so it comes before every
other remedy for an overflow anywhere in a written-out softmax (the Exp, its sum, the
quotient). Where x is too coarse in the target format for exp (|x| >= 32 in FP16), the
subtraction and x's elementwise producers stay FP32; Exp, the sum and the division never do.
npuprep.rewrite.softmax_shift checks the pattern and does the rewrite.
"""

from __future__ import annotations

import math

from npuprep.plan.actions import PinFp32, SoftmaxShift
from npuprep.plan.context import EXP_INPUT_ERROR, Outcome, PlanContext, Problem
from npuprep.profiles import Pinning
from npuprep.rewrite.softmax_shift import find_written_softmax


def propose(ctx: PlanContext, problem: Problem, before: tuple[str, ...]) -> Outcome:
    if problem.kind not in ("overflow", "static", "precision"):
        return None
    exp = _exp_of(ctx, problem)
    if not exp:
        return None
    found = find_written_softmax(ctx.model.proto, exp)
    if not found:
        return None
    measured: dict[str, float] = {}
    r = ctx.range_of(found.x)
    if r is not None:
        measured["input_absmax"] = float(r.absmax)
        measured["input_spread"] = float(r.max - r.min)
    why = (f"{exp} is a written-out softmax's Exp with no maximum subtracted; subtracting "
           f"ReduceMax({found.x}) first is exact and keeps exp within (0, 1], so Exp, its sum "
           f"and the division stay in {ctx.fmt.name}")
    # Rounding x itself to the target would still be a relative error of exp's output:
    # where it is too coarse, the subtraction runs in FP32 on an FP32 x (a graph input, or
    # elementwise producers kept FP32 with it). A matmul's output is rounded anyway.
    precise = ctx.precise_producers([found.x], set())
    coarse = bool(precise) or _coarse_input(ctx, found.x)
    banned = sorted(set(precise) & ctx.forbid)
    if not coarse or ctx.profile.fp32_pinning is Pinning.NONE or banned:
        if coarse:
            cause = f"forbid_pin names {', '.join(banned)}" if banned else \
                "this target cannot pin FP32"
            why += (f"; {found.x} rounds to {ctx.fmt.name} first ({cause}), which verification "
                    "measures")
        return SoftmaxShift(exp=exp, covers=found.tensors, findings=(problem.ref,),
                        measured=measured, why=why)
    size = f"absmax {r.absmax:.3g}" if math.isfinite(r.absmax) else \
        f"finite values below 2^{(r.top_exponent() or 0) + 1}, and -inf"
    why += (f"; {found.x} ({size}) is too coarse in {ctx.fmt.name} for exp: "
            f"{', '.join([*precise, 'the subtraction'])} run in FP32, elementwise")
    shift = SoftmaxShift(exp=exp, covers=found.tensors, fp32_shift=True, findings=(problem.ref,),
                     measured=measured, why=why)
    if not precise:
        return shift
    request = ctx.profile.fp32_pinning is Pinning.COMPILER_DECIDES
    pin = PinFp32(nodes=tuple(sorted(precise, key=ctx.order.__getitem__)),
                  exit_tensors=(found.x,), findings=(problem.ref,),
                  measured={"absmax": float(r.absmax)}, request=request,
                  why=(f"the softmax input {found.x} is shifted in FP32: its {ctx.fmt.name} "
                       "rounding would be a relative error of exp's output"))
    return [shift, pin]


def too_coarse(ctx: PlanContext, problem: Problem) -> bool:
    """A written-out softmax whose logits the format rounds too coarsely for exp, though
    nothing overflows (BF16: |x| >= 4 has a step of 2^-5): a precision problem this remedy
    answers with the same shift, in FP32."""
    exp = _exp_of(ctx, problem)
    found = find_written_softmax(ctx.model.proto, exp) if exp else None
    if not found:
        return False
    return bool(ctx.precise_producers([found.x], set())) or _coarse_input(ctx, found.x)


def _coarse_input(ctx: PlanContext, x: str) -> bool:
    """A graph input (FP32 at the boundary) whose target rounding exceeds EXP_INPUT_ERROR."""
    r = ctx.range_of(x)
    top = None if r is None else r.top_exponent()
    if x not in ctx.graph_inputs or top is None:
        return False
    return 2.0 ** top * ctx.fmt.eps / 2 > EXP_INPUT_ERROR


def _exp_of(ctx: PlanContext, problem: Problem) -> str:
    """The Exp a finding on an Exp, a ReduceSum or a Div of a softmax points at, else ""."""
    label = problem.finding.node if problem.finding.node in ctx.nodes \
        else ctx.producer_label(problem.tensor)
    for _ in range(2):
        if label not in ctx.nodes or ctx.nodes[label][2] != "main":
            return ""
        node = ctx.node(label)
        if node.op_type == "Exp":
            return label
        if node.op_type not in ("ReduceSum", "Div") or not node.input:
            return ""
        label = ctx.producer_label(node.input[0])
    return ""
