"""Remedy 2, log domain: `Log(Max(re^2 + im^2, c))` over the limit -> entry x 2^-k, Log + 2k ln 2.

A power spectrum reaches 1e11 before its Log. Scaling its sources by s = 2^-k is exact
through the squares (s^2 x^2), sums, Sqrt and the floor (c s^2), and the Log absorbs it with
one added constant (log(s^2 x) = log(x) + 2 ln s), so the whole chain stays in the target
format. That holds only while the Log's input, scaled, also stays above the smallest
normal: a value flushed to 0 has log -inf. When the measured span of the Log input is wider
than the format's normal range, no scale fits both ends: the remedy declines with the span,
and the chain is kept wide by the FP32 island that comes after it.
npuprep.rewrite.rescale carries the scale, npuprep.rewrite.log_offset compensates the Log.
"""

from __future__ import annotations

from dataclasses import replace

from npuprep.graph import node_label
from npuprep.plan.actions import Declined, Rescale
from npuprep.plan.context import Outcome, PlanContext, Problem
from npuprep.plan.rescale_domain import try_rescale

# Ops a power spectrum passes through on its way to the Log; the scale rides along.
CHAIN_OPS = frozenset({
    "Add", "Sum", "Max", "Clip", "Mul", "Pow", "Sqrt", "ReduceSum", "ReduceMean", "MatMul",
    "Reshape", "Transpose", "Slice", "Concat", "Abs", "Identity", "Squeeze", "Unsqueeze",
})
# How many nodes past the overflowing tensor the Log may sit.
MAX_CHAIN = 12


def propose(ctx: PlanContext, problem: Problem, before: tuple[str, ...]) -> Outcome:
    """A Rescale absorbed by a Log, or why not; None when no Log follows the tensor."""
    if problem.kind != "overflow" or problem.absmax is None:
        return None
    log = log_after(ctx, problem.tensor)
    if log is None:
        return None
    x = log.input[0]
    label = node_label(log)
    r = ctx.range_of(x)
    if r is None:
        return (Declined("rescale", label, f"no measured range for {x}, the input of Log "
                         f"{label}", (problem.ref,)),)
    room = ctx.limit / ctx.fmt.min_normal
    if not r.min > 0 or r.max / r.min > room:
        span = f"{r.min:.3g} .. {r.max:.3g}" + (f" (x{r.max / r.min:.3g})" if r.min > 0 else "")
        return (Declined("rescale", label, (
            f"the input {x} of Log {label} spans {span}, wider than the {ctx.fmt.name} normal "
            f"range under the limit (x{room:.3g}): no power of two keeps both ends, and a value "
            "flushed to 0 has log -inf"), (problem.ref,)),)
    out = try_rescale(ctx, problem.ref, problem.tensor, problem.absmax)
    if not isinstance(out, Rescale) or label not in out.absorbers:
        return out
    return replace(out, why=(
        f"{problem.tensor} reaches {problem.absmax:.6g} on its way to Log {label}, whose input "
        f"spans {r.min:.3g} .. {r.max:.3g}, within the {ctx.fmt.name} normal range once scaled; "
        f"log(s x) = log(x) + log(s) compensates the scale with one added constant: "
        + out.why))


def log_after(ctx: PlanContext, tensor: str) -> object | None:
    """The first main-graph Log that `tensor` reaches through CHAIN_OPS, else None."""
    readers = ctx.readers
    frontier, seen = [tensor], {tensor}
    for _ in range(MAX_CHAIN):
        following: list[str] = []
        for t in frontier:
            for node in readers.get(t, []):
                if node.op_type == "Log":
                    return node
                if node.op_type in CHAIN_OPS:
                    following += [o for o in node.output if o and o not in seen]
                    seen.update(node.output)
        if not following:
            return None
        frontier = following
    return None
