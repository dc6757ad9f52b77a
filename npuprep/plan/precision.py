"""Remedy for a precision problem: keep a cancellation and what feeds it in FP32.

    a = x + 30, y = a - 30 (precision.cancellation at the Sub, gain 8.5 in BF16)
    -> pin {Sub, Add}: the Sub reads a exact, and a reads x as the FP32 graph input

The range fits (BF16 has FP32's range), the significand does not: the inputs' rounding is
a large error relative to the result. The Sub runs in FP32, and so does each elementwise
producer of its inputs (through sums) whose rounding would be an absolute error above
INHERITED_ERROR of the output's scale. A Conv/MatMul/Gemm producer stays in the target
format, as for an Exp's input (plan.context.precise_producers): where one feeds the
cancellation too coarsely, pinning the rest cannot undo its rounding, and the remedy declines
(verification measures what it costs). A written-out softmax whose logits are too coarse for
exp is the softmax shift's (remedy 1), which comes first.
"""

from __future__ import annotations

from npuprep.analyse.precision import INHERITED_ERROR
from npuprep.graph import node_label
from npuprep.ops import MAC_OPS
from npuprep.plan.actions import Declined, PinFp32
from npuprep.plan.context import Outcome, PlanContext, Problem
from npuprep.profiles import Pinning


def propose(ctx: PlanContext, problem: Problem, before: tuple[str, ...]) -> Outcome:
    if problem.kind != "precision":
        return None
    ref, tensor, fmt = problem.ref, problem.tensor, ctx.fmt
    if ctx.profile.fp32_pinning is Pinning.NONE:
        return (Declined("pin_fp32", tensor, f"target {ctx.profile.name} cannot pin nodes to "
                         f"FP32 (fp32_pinning: none); {tensor} keeps {fmt.name}'s rounding",
                         (ref,)),)
    seeds = [s for s in problem.seeds if s in ctx.nodes]
    r = ctx.range_of(tensor)
    if not seeds or r is None:
        return (Declined("pin_fp32", tensor, f"no measured node computes {tensor}", (ref,)),)
    inputs = [i for s in seeds for i in ctx.node(s).input if i]
    tolerance = INHERITED_ERROR * float(r.absmax)
    rounded = _rounded_linear(ctx, inputs, tolerance)
    if rounded:
        return (Declined("pin_fp32", tensor, f"{', '.join(rounded)} feeds {tensor} rounded to "
                         f"{fmt.name} already (a layer with weights is not pinned for precision):"
                         " keeping the cancellation in FP32 cannot undo that", (ref,)),)
    precise = ctx.precise_producers(inputs, set(seeds), tolerance)
    nodes = sorted({*seeds, *precise}, key=ctx.order.__getitem__)
    banned = sorted(set(nodes) & ctx.forbid)
    if banned:
        return (Declined("pin_fp32", tensor, f"keeping {tensor} exact needs {', '.join(banned)}"
                         " in FP32, which forbid_pin excludes", (ref,)),)
    gain = problem.finding.evidence.get("gain")
    said = f"{gain:.3g}x" if isinstance(gain, int | float) else "many times"
    return PinFp32(
        nodes=tuple(nodes), exit_tensors=(tensor,), findings=(ref,),
        measured={"absmax": float(r.absmax), **({"gain": float(gain)} if said != "many times"
                                                 else {})},
        request=ctx.profile.fp32_pinning is Pinning.COMPILER_DECIDES,
        why=(f"{tensor} cancels: its inputs' {fmt.name} rounding ({fmt.significand_bits} "
             f"significant bits) is {said} larger relative to it; {', '.join(nodes)} run in "
             "FP32 so it is computed from exact values"))


def _rounded_linear(ctx: PlanContext, tensors: list[str], tolerance: float) -> list[str]:
    """Conv/MatMul/Gemm nodes whose output reaches `tensors` (directly or summed in) with a
    rounding step above `tolerance`: they stay in the format, so their error stays too."""
    found = [node_label(n) for n in ctx.coarse_producers(tensors, tolerance)
             if n.op_type in MAC_OPS]
    return sorted(found, key=lambda n: ctx.order.get(n, 0))
