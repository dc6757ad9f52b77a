"""Remedy for a layer's weights under the format's smallest subnormal: `W x 2^j, absorbed downstream`.

A weight whose small values carry a visible share of its magnitude (the init.underflow
finding: 1% or more of sum |w| below the smallest normal) loses them in FP16: those under
half the smallest subnormal (3e-8) are stored as 0, the rest as a few-bit subnormal. The
layer is a scale entry like any producer with constant weights, so the exact remedy is the
underflow scale-up turned onto the weight: the smallest power of two 2^j that lifts all
but a negligible share of its magnitude into the normal range while its largest value stays
within the limit, compensated where the scale domain closes (a linear consumer, a norm, a
graph output multiplied back in FP32; npuprep.rewrite.rescale) and checked against the
measured ranges of every tensor the scale reaches. Where no such rescale holds, the problem
goes on to the FP32 island (the layer, its weight stored FP32); the reasons say why.
Planned with measured ranges only (the planner asks): without them the finding stays a note.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from npuprep.analyse.initialisers import UNDERFLOW_MASS, summarise
from npuprep.graph import constant_value
from npuprep.plan.actions import Declined
from npuprep.plan.context import Outcome, PlanContext, Problem
from npuprep.plan.rescale_domain import checked, pow2, rescale_action
from npuprep.rewrite.rescale import apply_rescale

# The largest lift tried: FP16's whole range is 2^40 from its smallest subnormal to its max.
MAX_LIFT = 40


def propose(ctx: PlanContext, problem: Problem, before: tuple[str, ...]) -> Outcome:
    if problem.kind != "tiny_weights":
        return None
    f, ref, weight = problem.finding, problem.ref, problem.tensor
    graph = ctx.nodes[f.node][1]
    values = constant_value(graph, weight)
    if values is None:
        return (Declined("rescale", f.node, f"{weight} is not a constant of {f.node}'s graph", (ref,)),)
    values = np.asarray(values, np.float32)
    top = float(np.abs(values).max()) if values.size else 0.0
    j = _lift(values, ctx)
    planned = next((rs for rs in ctx.rescales if f.node == rs.entry or f.node in rs.absorbers), None)
    if planned is not None:
        if planned.entry == f.node and j is not None and -planned.k >= j:
            return replace(planned, findings=planned.findings + (ref,))  # already lifted enough
        if planned.entry != f.node:
            return (Declined("rescale", f.node, f"{f.node} already takes the rescale of "
                             f"{planned.entry} ({pow2(-planned.k)})", (ref,)),)
        # The layer's own lift (an underflow of its output) is too shallow for its weights:
        # deepened below, if the deeper lift holds, it replaces it and keeps its findings.
    if j is None:
        return (Declined("rescale", f.node, (
            f"no power of two lifts {weight}'s small values out of {ctx.fmt.name}'s subnormals with "
            f"its largest ({top:.3g}) within the limit {ctx.limit:.6g}"), (ref,)),)
    check, reason = checked(ctx, f.node, -j)
    if check is None:
        return (Declined("rescale", f.node, reason, (ref,)),)
    lifted = -check.k
    if lifted < j and summarise(values * np.float32(2.0**lifted), ctx.fmt).tiny_share >= UNDERFLOW_MASS:
        return (Declined("rescale", f.node, (
            f"{pow2(j)} on {f.node} lifts {weight}, but its domain holds only {pow2(lifted)} within "
            f"the limit {ctx.limit:.6g}"), (ref,)),)
    pushed = _pushed_under(ctx, f.node, check.k)
    if pushed:
        return (Declined("rescale", f.node, pushed, (ref,)),)
    action = rescale_action(ctx, f.node, check, (ref,), weight, top, "")
    lost = f.evidence.get("flush_count", 0)
    share = f.evidence.get("mass_fraction", 0.0)
    why = (f"{lost} value(s) of weight {weight} round to 0 in {ctx.fmt.name} and {share:.1%} of its "
           f"magnitude lies under its smallest normal; {weight} x {pow2(lifted)} (exact) stores them, "
           f"largest {top:.3g} -> {top * 2.0**lifted:.3g}, absorbed by "
           f"{', '.join(action.absorbers) or 'nothing'}")
    if planned is not None:
        why += f" (deepens the {pow2(-planned.k)} its output's underflow asked: {planned.why})"
        return replace(action, absmax_after=top * 2.0**lifted, why=why,
                       findings=planned.findings + action.findings)
    return replace(action, absmax_after=top * 2.0**lifted, why=why)


def _lift(values: np.ndarray, ctx: PlanContext) -> int | None:
    """Smallest j >= 1 with the finding's test passed by W x 2^j (under UNDERFLOW_MASS of the
    magnitude below the smallest normal) and its largest value within the limit; None if none."""
    top = float(np.abs(values).max()) if values.size else 0.0
    if top <= 0:
        return None
    most = min(MAX_LIFT, math.floor(math.log2(ctx.limit / top)))
    for j in range(1, most + 1):
        if summarise(values * np.float32(2.0**j), ctx.fmt).tiny_share < UNDERFLOW_MASS:
            return j
    return None


def _pushed_under(ctx: PlanContext, entry: str, k: int) -> str:
    """Why the compensation (an absorber's weight times 2^k) would put another constant's
    magnitude under the format's smallest normal by the same test, or "" when none is."""
    done = apply_rescale(ctx.model.proto, entry, k, run_checker=False)
    if not done:
        return done.reason
    for name, scaled in sorted(done.details.get("scaled_constants", {}).items()):
        if scaled["exponent"] >= 0 or scaled["min_nonzero"] >= ctx.fmt.min_normal:
            continue
        moved = constant_value(done.model.graph, name)  # as the rewrite scaled it
        if moved is not None and summarise(np.asarray(moved), ctx.fmt).tiny_share >= UNDERFLOW_MASS:
            return (f"{pow2(-k)} on {entry} is absorbed by {name} x {pow2(scaled['exponent'])}, which puts "
                    f"its values under the smallest {ctx.fmt.name} normal in turn")
    return ""
