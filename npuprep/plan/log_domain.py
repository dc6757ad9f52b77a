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

import math
from dataclasses import replace
from typing import Any

import onnx

from npuprep.graph import constant_value, node_label
from npuprep.ops import LAYOUT_OPS
from npuprep.plan.actions import Clamp, Declined, Hazard, PinFp32, Rescale, Unpinnable
from npuprep.plan.context import Outcome, PlanContext, Problem
from npuprep.plan.rescale_domain import (
    UNDERFLOW_SHARE,
    checked,
    entries_for,
    needed_k,
    pow2,
    pushed_constant,
    rescale_action,
    try_rescale,
    underflow_veto,
)
from npuprep.profiles import Pinning
from npuprep.rewrite.rescale import check_rescale

# Ops a power spectrum passes through on its way to the Log; the scale rides along.
CHAIN_OPS = LAYOUT_OPS | {
    "Add", "Sum", "Max", "Clip", "Mul", "Pow", "Sqrt", "ReduceSum", "ReduceMean", "MatMul",
    "Slice", "Concat", "Abs",
}
# How many nodes past the overflowing tensor the Log may sit.
MAX_CHAIN = 12


def propose(ctx: PlanContext, problem: Problem, before: tuple[str, ...]) -> Outcome:
    """A Rescale absorbed by a Log, or why not; None when no Log follows the tensor."""
    if problem.kind == "underflow":
        return _underflow_into_log(ctx, problem)
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
        declined = Declined("rescale", label, (
            f"the input {x} of Log {label} spans {span}, wider than the {ctx.fmt.name} normal "
            f"range under the limit (x{room:.3g}): no power of two keeps both ends, and a value "
            "flushed to 0 has log -inf"), (problem.ref,))
        wide = _wide_chain(ctx, problem, log, declined.reason) \
            or _floored_in_fp16(ctx, problem, log, declined.reason)
        if wide:
            ctx.declined.append(declined)
            return wide
        return (declined,)
    out = try_rescale(ctx, problem.ref, problem.tensor, problem.absmax)
    if isinstance(out, tuple) and all(isinstance(d, Declined) for d in out):
        # The Log's input fits, but inside the chain (the power spectrum before a mel filter
        # bank's sum) the span does not: keep the chain wide and its sources in the format.
        reason = "; ".join(d.reason for d in out)
        wide = _wide_chain(ctx, problem, log, reason) or _floored_in_fp16(ctx, problem, log, reason)
        if wide:
            ctx.declined.extend(out)
            return wide
    if not isinstance(out, Rescale) or label not in out.absorbers:
        return out
    return replace(out, why=(
        f"{problem.tensor} reaches {problem.absmax:.6g} on its way to Log {label}, whose input "
        f"spans {r.min:.3g} .. {r.max:.3g}, within the {ctx.fmt.name} normal range once scaled; "
        f"log(s x) = log(x) + log(s) compensates the scale with one added constant: "
        + out.why))


def _wide_chain(ctx: PlanContext, problem: Problem, log: onnx.NodeProto, span: str) -> list[Any]:
    """[Rescale, PinFp32]: the squares..Log chain kept FP32, and what feeds the squares (an
    STFT's re and im) scaled into the target format, so the transform that makes them stays
    in it; [] when the chain cannot be told apart, the target cannot pin or no scale holds."""
    if ctx.profile.fp32_pinning is Pinning.NONE:
        return []
    chain, sources = _chain_back(ctx, log)
    ranges = [ctx.range_of(t) for t in sources]
    if not sources or any(r is None for r in ranges):
        return []
    # k sized for the sources as the plan's rescales so far leave them (their scales add).
    absmax = max(float(r.absmax) * 2.0**ctx.planned_exponent(t)
                 for r, t in zip(ranges, sources, strict=True))
    if absmax <= ctx.limit:
        return []  # the sources fit: the island alone keeps the chain
    k = needed_k(absmax, ctx.limit)
    candidates, _ = entries_for(ctx, sources[0])
    for entry in candidates:
        if (entry, k) not in ctx.checks:
            ctx.checks[(entry, k)] = check_rescale(ctx.model.proto, entry, k)
        check = ctx.checks[(entry, k)]
        if not check or any(s not in check.exponents for s in sources):
            continue
        outside = [(t, p) for t, p in check.exponents.items()
                   if p and ctx.producer_label(t) not in chain]
        if any(_out_of_range(ctx, entry, k, t, p) for t, p in outside) \
                or pushed_constant(ctx, entry, k):
            continue
        rescale = rescale_action(ctx, entry, check, (problem.ref,), sources[0], absmax, "")
        request = ctx.profile.fp32_pinning is Pinning.COMPILER_DECIDES
        nodes = tuple(sorted(chain, key=ctx.order.__getitem__))
        pin = PinFp32(nodes=nodes, exit_tensors=tuple(log.output), findings=(problem.ref,),
                      measured={"absmax": float(problem.absmax or 0.0)}, request=request,
                      why=(f"{span}; the chain {nodes[0]}..{nodes[-1]} stays FP32 (elementwise "
                           f"and the sum it feeds), and {entry} x {pow2(-k)} brings "
                           f"{', '.join(sources)} within {ctx.limit:.6g} so it stays in "
                           f"{ctx.fmt.name}"))
        return [replace(rescale, why=(f"{', '.join(sources)} reach {absmax:.6g} before the "
                                      f"FP32 chain into Log {node_label(log)}: " + rescale.why)),
                pin]
    return []


def _floored_in_fp16(ctx: PlanContext, problem: Problem, log: onnx.NodeProto, span: str) -> list[Any]:
    """[Rescale, Clamp] for a target that cannot pin: the chain scaled into the format and
    the Log input floored at the smallest subnormal (a value flushed to 0 would give -inf).
    Exact above that floor; below it (digital silence, the model's own floor) the log reads
    the floor instead: only an FP32 pin of the chain could keep those, the why says so."""
    if ctx.profile.fp32_pinning is not Pinning.NONE:
        return []
    x = log.input[0]
    chain, sources = _chain_back(ctx, log)
    inside = frozenset(o for n in chain for o in ctx.node(n).output)
    # Nearest the squares first: one scale then covers the transform that feeds them too.
    candidates = list(dict.fromkeys(
        [*(e for s in sources[:1] for e in entries_for(ctx, s)[0]),
         *entries_for(ctx, problem.tensor)[0]]))
    for entry in candidates:
        check, _ = checked(ctx, entry, needed_k(problem.absmax or 0.0, ctx.limit), problem.tensor,
                           exempt=inside)
        if check is None or not check.exponents.get(x):
            continue
        p = check.exponents[x]
        r = ctx.range_of(x)
        lo = ctx.fmt.min_subnormal * 2.0**-p
        share = r.fraction_below(lo) if r is not None else None
        rescale = rescale_action(ctx, entry, check, (problem.ref,), problem.tensor,
                                 problem.absmax or 0.0, "")
        pin_needed = (f"target {ctx.profile.name} cannot pin the chain, so {x} is scaled by "
                      f"{pow2(p)} and floored at {ctx.fmt.name}'s smallest subnormal ({lo:.3g} "
                      f"unscaled): exact above it" + (f", {share:.2%} of the calibration values "
                                                       "lie below it" if share is not None else "")
                      + f"; only an FP32 pin of the chain into {node_label(log)} could keep those")
        said = f"{span}; {pin_needed}"
        clamp = Clamp(x, lo, None, "log", (node_label(log),), (problem.ref,),
                      {"floor": lo, **({"share_below": share} if share is not None else {})},
                      said)
        # One floor per Log input, set for the latest scale (a later problem may deepen k).
        ctx.clamps[:] = [c for c in ctx.clamps if c.tensor != x]
        ctx.unpinnable[:] = [u for u in ctx.unpinnable if u.tensor != x]
        ctx.unpinnable.append(Unpinnable(Hazard.LOG_FLOOR, x, tuple(sorted(
            chain, key=ctx.order.__getitem__)), pin_needed))
        return [replace(rescale, why=f"{said}; " + rescale.why), clamp]
    return []


def _underflow_into_log(ctx: PlanContext, problem: Problem) -> Outcome:
    """A power spectrum under the smallest normal on its way to a Log whose input spans wider
    than the format (a floor of 1e-12 beside 1e3): no power of two lifts it, and what flushes
    to 0 reads the floor's log, not its own. The chain from the squares stays FP32; the
    transform that makes them (fitting the format) stays in it. None where this is not so."""
    log = log_after(ctx, problem.tensor)
    if log is None or ctx.profile.fp32_pinning is Pinning.NONE:
        return None
    x = log.input[0]
    r = ctx.range_of(x)
    room = ctx.limit / ctx.fmt.min_normal
    if r is None or (r.min > 0 and r.max / r.min <= room):
        return None  # one scale fits the Log's input: the underflow remedy lifts it
    chain, sources = _chain_back(ctx, log)
    if ctx.producer_label(problem.tensor) not in chain:
        return None
    nodes = tuple(sorted(chain, key=ctx.order.__getitem__))
    under = ctx.range_of(problem.tensor)
    share = under.fraction_below(ctx.fmt.min_normal) if under is not None else None
    pin = PinFp32(
        nodes=nodes, exit_tensors=tuple(log.output), findings=(problem.ref,),
        measured={"absmax": float(under.absmax if under is not None else 0.0)},
        request=ctx.profile.fp32_pinning is Pinning.COMPILER_DECIDES,
        why=(f"{problem.tensor} lies under the smallest {ctx.fmt.name} normal"
             + (f" ({share:.1%})" if share is not None else "")
             + f" on its way to Log {node_label(log)}, whose input {x} spans {r.min:.3g} .. "
             f"{r.max:.3g}, wider than the {ctx.fmt.name} normal range under the limit "
             f"(x{room:.3g}): no power of two keeps both ends; the chain {nodes[0]}..{nodes[-1]} "
             f"stays FP32"))
    lift = _lifted_sources(ctx, problem, chain, sources)
    return [lift, pin] if lift is not None else pin


def _lifted_sources(ctx: PlanContext, problem: Problem, chain: set[str],
                    sources: list[str]) -> Rescale | None:
    """The transform that feeds an FP32 chain's squares (a CQT's Convs), lifted by 2^j out of
    FP16's subnormal range, where its small bins keep a few bits only and the Log magnifies
    what they lose; the chain, FP32, takes the scale to the Log, which absorbs it. The
    largest lift that keeps every tensor outside the chain within the limit, the farthest
    entry first (a graph input, or a Conv whose domain joins every Conv of the transform);
    None when the sources are normal already or no lift fits."""
    ranges = [ctx.range_of(t) for t in sources]
    if not sources or any(r is None for r in ranges):
        return None
    absmax = max(float(r.absmax) for r in ranges)
    shares = [r.fraction_below(ctx.fmt.min_normal) for r in ranges]
    # Without a histogram the squares' own underflow (the problem) says the sources are small.
    known = [x for x in shares if x is not None]
    if absmax <= 0 or (len(known) == len(shares) and max(known) <= UNDERFLOW_SHARE):
        return None
    under = f"{max(known):.1%} of " if known else "the small values of "
    fits = int(math.floor(math.log2(ctx.limit / absmax)))
    inside = frozenset(o for n in chain for o in ctx.node(n).output)
    # Farthest first: the entry nearest the squares (a Mul by a constant) lifts only what
    # the chain computes, not the transform before it.
    entries = [*sorted(ctx.graph_inputs), *reversed(entries_for(ctx, sources[0])[0])]
    for j in range(fits, 0, -1):
        for entry in entries:
            lifted = _lifted_within(ctx, entry, -j)
            check, _ = checked(ctx, entry, -j, sources[0], exempt=inside, replaces=lifted)
            if check is None or any(check.exponents.get(t, 0) != j for t in sources):
                continue
            # The lifts it covers go (their scales would add), and one of its own entry it
            # replaces: their findings are this one's.
            taken = [rs for rs in ctx.rescales if rs.entry in (*lifted, entry)]
            ctx.rescales[:] = [rs for rs in ctx.rescales if rs.entry not in lifted]
            refs = tuple(dict.fromkeys((*(ref for rs in taken for ref in rs.findings),
                                        problem.ref)))
            lift = rescale_action(ctx, entry, check, refs, sources[0], absmax, "")
            return replace(lift, why=(
                f"{under}{', '.join(sources)} lie under the smallest {ctx.fmt.name} "
                f"normal before the FP32 chain into {', '.join(sorted(chain))[:80]}: lifted "
                f"into it so the transform keeps its precision in {ctx.fmt.name}; " + lift.why))
    return None


def _lifted_within(ctx: PlanContext, entry: str, k: int) -> tuple[str, ...]:
    """Entries of the rescales planned so far that lift tensors only where `entry` x 2^-k
    (k < 0) lifts each of them at least as much (a CQT's normalising Mul, lifted for its own
    underflow, inside the lift of the Convs before it): that lift can take their place."""
    if (entry, k) not in ctx.checks:
        ctx.checks[(entry, k)] = check_rescale(ctx.model.proto, entry, k)
    check = ctx.checks[(entry, k)]
    if not check:
        return ()
    return tuple(rs.entry for rs in ctx.rescales if rs.entry != entry and rs.domain and all(
        0 < p <= check.exponents.get(t, 0) for t, p in rs.domain.items()))


def _out_of_range(ctx: PlanContext, entry: str, k: int, t: str, p: int) -> bool:
    r = ctx.range_of(t)
    total = p + ctx.planned_exponent(t, besides=(entry,))
    return r is None or r.absmax * 2.0**total > ctx.limit or bool(
        underflow_veto(ctx, entry, k, t, total, r))


def _chain_back(ctx: PlanContext, log: onnx.NodeProto) -> tuple[set[str], list[str]]:
    """The nodes from the squares to `log` (through CHAIN_OPS) and the squared tensors."""
    chain: set[str] = {node_label(log)}
    sources: list[str] = []
    todo = [log.input[0]]
    while todo and len(chain) <= MAX_CHAIN * 2:
        node = ctx.produced_by.get(todo.pop())
        if node is None or node.op_type not in CHAIN_OPS or node_label(node) in chain:
            continue
        chain.add(node_label(node))
        below = ctx.produced_by.get(node.input[0])
        while below is not None and below.op_type in LAYOUT_OPS:
            below = ctx.produced_by.get(below.input[0])
        # A square of a Sqrt (|X|^2 as sqrt(re^2 + im^2)^2, transposed or not) is no source:
        # the power is made by the squares under the Sqrt.
        if _is_square(ctx, node) and (below is None or below.op_type != "Sqrt"):
            sources.append(node.input[0])
            continue
        todo.extend(i for i in node.input if i and i not in ctx.graph_inputs)
    return chain, sorted(set(sources))


def _is_square(ctx: PlanContext, node: onnx.NodeProto) -> bool:
    if node.op_type == "Mul":
        return len(node.input) == 2 and node.input[0] == node.input[1]
    if node.op_type != "Pow" or len(node.input) < 2:
        return False
    e = constant_value(ctx.nodes[node_label(node)][1], node.input[1])
    return e is not None and e.size == 1 and float(e.reshape(())) == 2.0


def log_after(ctx: PlanContext, tensor: str) -> Any | None:
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
