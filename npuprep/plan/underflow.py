"""Remedy 4, underflow: `tensor under the smallest normal -> entry x 2^j, compensated exactly`.

The mirror of a rescale down: the smallest power of two that lifts all but a small share
of the tensor out of the subnormal range without passing the limit. Where the domain
reaches a graph output, the rewrite multiplies it back by 2^-j in FP32, after the output
Cast, so the caller sees the reference's values; an output whose true range lies wholly under
the smallest normal leaves the device scaled instead and the host multiplies it back
(`plan/host_scale.py`).
"""

from __future__ import annotations

from dataclasses import replace

from npuprep.plan.actions import Declined
from npuprep.plan.context import Outcome, PlanContext, Problem
from npuprep.plan.host_scale import host_scaled_outputs
from npuprep.plan.rescale_domain import UNDERFLOW_SHARE, checked, entries_for, pow2, rescale_action


def propose(ctx: PlanContext, problem: Problem, before: tuple[str, ...]) -> Outcome:
    if problem.kind != "underflow":
        return None
    ref, tensor = problem.ref, problem.tensor
    r = ctx.range_of(tensor)
    scaled = next((rs for rs in ctx.rescales if tensor in rs.domain), None)
    if scaled is not None:
        return (Declined("rescale", tensor, f"{tensor} is already in the scale domain of "
                         f"{scaled.entry} ({pow2(-scaled.k)})", (ref,)),)
    base = r.fraction_below(ctx.fmt.min_normal)
    if base is None:
        return (Declined("rescale", tensor, f"no histogram of {tensor}; recalibrate with full "
                         "detail to plan a rescale", (ref,)),)
    j = 0
    for step in range(1, 64):
        if r.absmax * 2.0**step > ctx.limit:
            break
        lifted = r.fraction_below(ctx.fmt.min_normal / 2.0**step)
        if lifted is not None and lifted <= UNDERFLOW_SHARE:
            j = step
            break
    if j == 0:
        return (Declined("rescale", tensor, (
            f"no power of two lifts {tensor} out of the subnormal range without passing the "
            f"limit {ctx.limit:.6g} (absmax {r.absmax:.6g})"), (ref,)),)
    candidates, stop = entries_for(ctx, tensor)
    if not candidates:
        return (Declined("rescale", tensor, stop, (ref,)),)
    declines: list[Declined] = []
    for entry in candidates:
        check, reason = checked(ctx, entry, -j, tensor)
        if check is not None:
            ctx.declined.extend(declines)
            action = rescale_action(ctx, entry, check, (ref,), tensor, r.absmax, "")
            exits = [e for e in check.exits if e in ctx.graph_outputs]
            true = {e: a.absmax for e in exits if (a := ctx.range_of(e)) is not None}
            hosted = sorted(host_scaled_outputs(exits, true, ctx.target))
            on_device = [e for e in exits if e not in hosted]
            how = "".join((
                f"; {', '.join(on_device)} multiplied back by {pow2(-j)} in FP32 after the "
                "output Cast" if on_device else "",
                f"; {', '.join(hosted)} leaves the device scaled, the host multiplies it back "
                f"by {pow2(-j)}" if hosted else ""))
            return replace(action, why=(f"{base:.1%} of {tensor} lies below the smallest "
                                        f"{ctx.fmt.name} normal; " + action.why + how))
        declines.append(Declined("rescale", entry, reason, (ref,)))
    return tuple(declines)
