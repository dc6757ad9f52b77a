"""Remedy 3, rescale a scale domain: `tensor over the limit -> entry x 2^-k, absorbed downstream`.

The cheapest exact remedy. Walking back from the overflowing tensor through ops that carry
a scale (npuprep.ops) gives candidate entries: producers with constant weights, affine
normalisations, Mul/Div by a constant, and, past them, the graph input or block output the
domain starts from (a residual branch that reads the same tensor joins the domain there).
npuprep.rewrite.rescale checks that the domain closes exactly; the measured ranges size k
and veto scales that would flush a tensor under the smallest normal.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import onnx

from npuprep.calibrate.stats import RangeStats
from npuprep.graph import constant_value, node_label
from npuprep.ops import MAC_OPS, SCALE_INVARIANT_NORMS, SCALE_WALK_BACK
from npuprep.plan.actions import Declined, FindingRef, Rescale
from npuprep.plan.context import Outcome, PlanContext, Problem
from npuprep.rewrite.rescale import apply_rescale, check_rescale
from npuprep.rewrite.scale_domain import RescaleCheck

# A rescale is declined when it would push more than this share of a domain tensor's
# values below the target's smallest normal (where they lose precision or flush to 0).
UNDERFLOW_SHARE = 0.01
# Readers that only sum what they read (a mean is a scaled sum).
SUMMING_OPS = ("Add", "Sum", "ReduceSum", "ReduceMean")
# How many entries are tried when walking back from an overflowing tensor.
MAX_ENTRY_TRIES = 4
# How many times k is deepened when another domain tensor is still over the limit.
MAX_DEEPEN = 4


def propose(ctx: PlanContext, problem: Problem, before: tuple[str, ...]) -> Outcome:
    """A Rescale for an overflowing tensor or an out-of-range weight, or why not."""
    ref = problem.ref
    if problem.kind == "static":
        if problem.finding.remedy != "rescale":
            return None
        return (Declined("rescale", problem.tensor or problem.finding.node,
                         "rescale needs measured ranges (run with --data)", (ref,)),)
    if problem.kind == "weights":
        return _weights(ctx, problem)
    if problem.kind != "overflow":
        return None
    if problem.absmax is None:
        return (Declined("rescale", problem.tensor,
                         "rescale needs a measured range (run with --data)", (ref,)),)
    return try_rescale(ctx, ref, problem.tensor, problem.absmax)


def try_rescale(ctx: PlanContext, ref: FindingRef, tensor: str, absmax: float) -> Outcome:
    for rs in ctx.rescales:
        if tensor in rs.domain:
            need = rs.k + needed_k(absmax * 2.0 ** ctx.planned_exponent(tensor), ctx.limit)
            check, reason = checked(ctx, rs.entry, need, tensor)
            if check is None:
                return (Declined("rescale", rs.entry, reason, (ref,)),)
            return rescale_action(ctx, rs.entry, check, rs.findings + (ref,), tensor, absmax,
                                  "deepened")
    candidates, stop = entries_for(ctx, tensor)
    if not candidates:
        return (Declined("rescale", tensor, stop, (ref,)),)
    declines: list[Declined] = []
    for entry in candidates:
        check, reason = checked(ctx, entry, needed_k(absmax, ctx.limit), tensor)
        if check is not None:
            ctx.declined.extend(declines)
            return rescale_action(ctx, entry, check, (ref,), tensor, absmax, "")
        declines.append(Declined("rescale", entry, reason, (ref,)))
    return tuple(declines)


def _weights(ctx: PlanContext, problem: Problem) -> Outcome:
    """A constant beyond the target's range: rescale its layer so the constant fits."""
    f, ref = problem.finding, problem.ref
    worst = problem.absmax or 0.0
    if f.remedy != "rescale" or f.node not in ctx.nodes or worst <= 0:
        return None
    check, reason = checked(ctx, f.node, needed_k(worst, ctx.limit))
    if check is None:
        return (Declined("rescale", f.node, reason, (ref,)),)
    action = rescale_action(ctx, f.node, check, (ref,), f.tensor, worst, "")
    k = check.k
    return replace(action, absmax_after=worst * 2.0**-k, why=(
        f"weight {f.tensor} reaches {worst:.6g}; scaling it by {pow2(-k)} brings it within "
        f"{ctx.limit:.6g}, exactly; absorbed by {', '.join(action.absorbers) or 'nothing'}"))


def rescaled_constant(ctx: PlanContext, name: str) -> tuple[str, float] | None:
    """(entry, new abs-max) when a planned rescale scales constant `name` as it absorbs."""
    for rs in ctx.rescales:
        key = (rs.entry, rs.k)
        if key not in ctx.scaled_cache:
            done = apply_rescale(ctx.model.proto, rs.entry, rs.k, run_checker=False)
            ctx.scaled_cache[key] = dict(done.details.get("scaled_constants", {})) if done else {}
        if name in ctx.scaled_cache[key]:
            return rs.entry, float(ctx.scaled_cache[key][name]["absmax"])
    return None


# How npuprep.rewrite.scale_domain declines a scale that a Sqrt or a Pow turns fractional.
FRACTIONAL_POWER = "not an integer power of two"


def checked(ctx: PlanContext, entry: str, k: int, focus: str = "",
            exempt: frozenset[str] = frozenset(),
            replaces: tuple[str, ...] = ()) -> tuple[Any | None, str]:
    """check_rescale, then the stats: every domain tensor within the limit (k grows until
    it is) and none pushed under the smallest normal in a harmful share (`exempt` tensors
    excepted: a chain whose Log input the caller floors above 0), each with the scales the
    plan's other rescales already put on it (basic_pitch's CQT: its Mul x 2^2 for its own
    underflow, then its Convs x 2^10 for the Log chain's, each within the limit alone and
    the Mul's output at 76800 with both); `replaces`: entries whose rescales this one takes
    the place of."""
    fitted = not focus or k < 0
    worst, worst_tensor = 0.0, ""
    for _ in range(MAX_DEEPEN):
        if (entry, k) not in ctx.checks:
            ctx.checks[(entry, k)] = check_rescale(ctx.model.proto, entry, k)
        check = ctx.checks[(entry, k)]
        if not check and FRACTIONAL_POWER in check.reason:
            # A root or a power (Sqrt, Pow 1.5) makes 2^k a fractional power: the next deeper
            # k whose powers are whole keeps every scale exact (deepening stays within limit).
            k += 1 if k > 0 else -1
            continue
        if not check:
            return None, check.reason
        p_focus = check.exponents.get(focus, 0) if focus else 0
        if focus and p_focus * k >= 0:
            return None, f"scaling {entry} does not reach {focus}"
        r_focus = ctx.range_of(focus)
        if not fitted and r_focus is not None and p_focus != -k:
            # The focus carries the scale to a power (a square): size k for that power.
            fitted = True
            k_focus = needed_k(r_focus.absmax, ctx.limit, per=-p_focus / k)
            if k_focus != k:
                k = k_focus
                continue
        worst, worst_tensor, worst_p = 0.0, "", -k
        for t, p in sorted(check.exponents.items()):
            if p == 0:
                continue
            r = ctx.range_of(t)
            if r is None:
                return None, f"no measured range for domain tensor {t}"
            if t in exempt:
                continue  # the caller answers for what flushes there (a floored Log chain)
            total = p + ctx.planned_exponent(t, besides=(entry, *replaces))
            reason = underflow_veto(ctx, entry, k, t, total, r)
            if reason:
                return None, reason
            if r.absmax * 2.0**total > worst:
                worst, worst_tensor, worst_p = r.absmax * 2.0**total, t, p
        if worst <= ctx.limit:
            return check, check.reason
        if k < 0:
            break
        # A tensor carrying the scale to a power (a square) needs k deepened by that much less.
        k += needed_k(worst, ctx.limit, per=max(1.0, -worst_p / k))
    return None, (f"{pow2(-k)} on {entry} leaves {worst_tensor} at {worst:.6g}, over the limit "
                  f"{ctx.limit:.6g}")


def pushed_constant(ctx: PlanContext, entry: str, k: int) -> str:
    """Why scaling `entry` by 2^-k pushes a weight past the format's max (lowering would
    keep its node FP32), or "" when every scaled constant still fits."""
    key = (entry, k)
    if key not in ctx.scaled_cache:
        done = apply_rescale(ctx.model.proto, entry, k, run_checker=False)
        ctx.scaled_cache[key] = dict(done.details.get("scaled_constants", {})) if done else {}
    past = {name: c for name, c in ctx.scaled_cache[key].items()
            if c["exponent"] > 0 and c["absmax"] > ctx.fmt.max}
    if not past:
        return ""
    values = sorted(c["absmax"] for c in past.values())
    span = f"{values[0]:.6g}" + (f" .. {values[-1]:.6g}" if len(values) > 1 else "")
    return (f"{pow2(-k)} on {entry} pushes {', '.join(sorted(past)[:3])} to {span}, past "
            f"{ctx.fmt.name}'s max {ctx.fmt.max:.6g}: lowering would keep their nodes FP32")


def underflow_veto(ctx: PlanContext, entry: str, k: int, t: str, p: int, r: RangeStats) -> str:
    """Why scaling `t` by 2^p flushes too much of it, or "" when it does not."""
    if p >= 0:
        return ""
    fmt = ctx.fmt
    readers = ctx.readers.get(t, [])
    if readers and t not in ctx.graph_outputs and all(n.op_type in SUMMING_OPS for n in readers):
        # An addend (a power spectrum's re^2, a LayerNorm's squared deviations): what it loses
        # under the smallest normal is at most half a subnormal step, small against its sum,
        # which is judged on its own.
        return ""
    if t in ctx.log_inputs and r.min * 2.0**p < fmt.min_normal:
        # A Log's input flushed to 0 gives -inf: no share of it may leave the normal range.
        return (f"{pow2(-k)} on {entry} brings the smallest value of {t}, a Log's input, to "
                f"{r.min * 2.0**p:.3g}, under the smallest {fmt.name} normal ({fmt.min_normal:.3g})")
    after = fmt.min_normal / 2.0**p
    newly, before = r.fraction_below(after), r.fraction_below(fmt.min_normal)
    if newly is None or before is None:
        # No histogram (an ordinary tensor): what drops under the smallest normal is
        # harmless while it also lies under the scaled tensor's own precision floor.
        floor = r.absmax * 2.0**p * fmt.eps
        if floor >= fmt.min_normal:
            return ""
        return (f"{pow2(-k)} on {entry} brings {t} to {r.absmax * 2.0**p:.3g}, where its "
                f"precision floor {floor:.3g} lies under the smallest {fmt.name} "
                f"normal, and no histogram shows how much would flush")
    pushed = newly - before
    if pushed <= UNDERFLOW_SHARE:
        return ""
    return (f"{pow2(-k)} on {entry} pushes {pushed:.1%} of {t} below the smallest "
            f"{fmt.name} normal ({fmt.min_normal:.3g})")


def rescale_action(ctx: PlanContext, entry: str, check: RescaleCheck, refs: tuple[FindingRef, ...],
                   tensor: str, absmax: float, how: str) -> Rescale:
    k = check.k
    domain = {t: p for t, p in sorted(check.exponents.items()) if p != 0}
    absorbers = tuple(dict.fromkeys([a.node for a in check.absorbers] + list(check.exits)))
    after = absmax * 2.0 ** domain.get(tensor, -k)
    direction = "down" if k > 0 else "up"
    why = (
        f"measured absmax {absmax:.6g} of {tensor} against the limit {ctx.limit:.6g} "
        f"(headroom {ctx.profile.headroom:g} x {ctx.fmt.name} max); a power-of-two "
        f"rescale {direction} is exact and free at run time, the cheapest remedy: "
        f"{entry} x {pow2(-k)}, absorbed by {', '.join(absorbers) or 'nothing'}"
    )
    if how:
        why += f" ({how} to cover {tensor})"
    return Rescale(entry=entry, k=k, domain=domain, absorbers=absorbers, findings=refs,
                   absmax=absmax, limit=ctx.limit, absmax_after=after, why=why)


def entries_for(ctx: PlanContext, tensor: str) -> tuple[list[str], str]:
    """Walk back from `tensor` through scale-carrying ops to candidate entries, nearest
    first. The walk goes on past an entry through its data input: when the nearest entry's
    domain reaches back into its own input (a residual join), the domain starts upstream."""
    candidates: list[str] = []
    current = tensor
    seen: set[str] = set()
    past_entry = False
    while current not in seen and len(candidates) < MAX_ENTRY_TRIES:
        seen.add(current)
        if current in ctx.graph_inputs:
            candidates.append(current)
            return candidates, ""
        node = ctx.produced_by.get(current)
        if node is None:
            return candidates, f"{current} is a constant; nothing to rescale"
        label = node_label(node)
        graph, scope = ctx.nodes[label][1], ctx.nodes[label][2]
        if scope != "main":
            return candidates, (f"{label} is inside a subgraph ({scope}); rescale works on "
                                "the main graph")
        entry = is_entry(ctx, node)
        if past_entry and not entry:
            # The input of an entry whose own domain reaches back into it (a residual
            # join): the domain can start on that tensor, behind an exact Mul.
            candidates.append(current)
            return candidates, ""
        past_entry = entry and node.op_type in MAC_OPS | set(SCALE_INVARIANT_NORMS)
        if entry:
            candidates.append(label)
        if entry and node.op_type in MAC_OPS | set(SCALE_INVARIANT_NORMS):
            follow: tuple[int, ...] | None = (0,) if constant_value(graph, node.input[0]) is None \
                else (1,)
        else:
            follow = SCALE_WALK_BACK.get(node.op_type, ())
        if node.op_type in ("Mul", "Div") and not has_constant_input(ctx, node):
            # x*x carries the scale squared; other products of activations stop here.
            square = node.op_type == "Mul" and node.input[0] == node.input[1]
            follow = (0,) if square else ()
        data = [i for pos, i in enumerate(node.input)
                if i and (follow is None or pos in follow) and constant_value(graph, i) is None]
        if not data:
            if candidates:
                return candidates, ""
            return candidates, f"{node.op_type} node {label} does not commute with scaling"
        current = max(data, key=lambda t: (ctx.range_of(t).absmax if ctx.range_of(t) else -1.0, t))
    return candidates, f"no scalable entry found upstream of {tensor}"


def is_entry(ctx: PlanContext, node: onnx.NodeProto) -> bool:
    graph = ctx.nodes[node_label(node)][1]
    if node.op_type in MAC_OPS or SCALE_INVARIANT_NORMS.get(node.op_type):
        return len(node.input) > 1 and constant_value(graph, node.input[1]) is not None
    return node.op_type in ("Mul", "Div") and has_constant_input(ctx, node)


def has_constant_input(ctx: PlanContext, node: onnx.NodeProto) -> bool:
    graph = ctx.nodes[node_label(node)][1]
    return any(constant_value(graph, i) is not None for i in node.input if i)


def needed_k(absmax: float, limit: float, per: float = 1.0) -> int:
    """Smallest k >= 1 with absmax * 2^(-k * per) <= limit."""
    k = max(1, math.ceil(math.log2(absmax / limit) / per)) if absmax > 0 else 1
    while absmax * 2.0 ** (-k * per) > limit:
        k += 1
    return k


def pow2(e: int) -> str:
    """2^e written for people: `2^-4`, `2^24` (never `2^--4`)."""
    return f"2^{e}"
