"""Remedy 5, FP32 island: `faulty node -> island {node, consumers...}` grown until every exit fits.

Islands hold the elementwise and reduction nodes that need FP32 range. A Conv, MatMul or
Gemm joins one only when the tensor it reads cannot be represented in the target format at
all; a tensor that fits the format but not the headroom never pulls one in, and such a
tensor alone (headroom short) gets no island. An island closes at a graph output kept in
FP32, also from inside an If branch. Where the compiler decides precision the pin is a
request; where the target cannot pin, the island is declined.
"""

from __future__ import annotations

from dataclasses import replace

import onnx

from npuprep.graph import node_label
from npuprep.ops import MAC_OPS, MAKES_MAGNITUDE
from npuprep.plan.actions import Declined, PinFp32
from npuprep.plan.context import RANGE_RULES, Outcome, PlanContext, Problem
from npuprep.profiles import Pinning, Severity
from npuprep.rewrite.pin import Island, grow_island, island_of, merge_islands


def propose(ctx: PlanContext, problem: Problem, before: tuple[str, ...]) -> Outcome:
    f, ref, tensor = problem.finding, problem.ref, problem.tensor
    if problem.kind == "precision":
        return None  # within range: plan.precision keeps it exact, no island to grow
    if problem.kind == "static" and f.remedy != "pin_fp32":
        return None
    if problem.kind == "underflow" and f.severity < Severity.ERROR:
        return None
    seeds = list(problem.seeds) or seeds_for(ctx, problem)
    if problem.kind == "overflow" and problem.absmax is not None \
            and problem.absmax <= ctx.fmt.max:
        # Past the headroom only: the value is representable. Pinning waits until the
        # profile calls this an error, and never takes a matmul for it.
        if f.severity < Severity.ERROR:
            return None
        linear = [s for s in seeds if ctx.node(s).op_type in MAC_OPS]
        if linear:
            return (Declined("pin_fp32", tensor, (
                f"{tensor} (absmax {problem.absmax:.6g}) fits {ctx.fmt.name} (max "
                f"{ctx.fmt.max:.6g}), short of headroom only; {', '.join(linear)} would run in "
                "FP32 for a value that fits"), (ref,)),)
    if ctx.profile.fp32_pinning is Pinning.NONE:
        return (Declined("pin_fp32", tensor, f"target {ctx.profile.name} cannot pin nodes to "
                         "FP32 (fp32_pinning: none)", (ref,)),)
    if not seeds:
        return (Declined("pin_fp32", tensor, f"no node computes {tensor}", (ref,)),)
    if problem.kind == "static":
        _mark_static(ctx, problem)
    parts = _grow(ctx, seeds)
    precise = precise_inputs(ctx, {n for part in parts for n in part.nodes})
    parts += _grow(ctx, precise)
    members = {n for part in parts for n in part.nodes}
    unfit = [t for part in parts for t in part.unfit_exits]
    banned = sorted(members & ctx.forbid, key=lambda n: ctx.order.get(n, 0))
    if banned:
        return (Declined("pin_fp32", tensor, f"the FP32 island would include "
                         f"{', '.join(banned)}, which forbid_pin excludes", (ref,)),)
    if unfit:
        return (Declined("pin_fp32", tensor, (
            f"the FP32 island from {', '.join(seeds)} cannot close: {', '.join(unfit)} would "
            f"still leave it beyond the limit {ctx.limit:.6g}"), (ref,)),)
    measured: dict[str, float] = {}
    r = ctx.range_of(tensor)
    if r is not None:
        measured["absmax"] = float(r.absmax)
        measured["limit"] = float(ctx.limit)
    request = ctx.profile.fp32_pinning is Pinning.COMPILER_DECIDES
    why = "; ".join(before) + (
        f"; pinning to FP32 is exact and costs speed: the island grows from "
        f"{', '.join(seeds)} until every exit fits {ctx.fmt.name} with headroom")
    if precise:
        why += (f"; {', '.join(precise)} join the island: Exp turns the {ctx.fmt.name} "
                "rounding of its input into a relative error of its output")
    linear = [n for n in sorted(members, key=ctx.order.__getitem__)
              if ctx.node(n).op_type in MAC_OPS and n not in seeds and n not in precise]
    for n in linear:
        over = [i for i in ctx.node(n).input if i and not ctx.representable(i)]
        why += (f"; {ctx.node(n).op_type} {n} joins: its input {', '.join(over)} cannot be "
                f"represented in {ctx.fmt.name}" if over else "")
    short = [t for part in parts for t in part.exit_tensors
             if not ctx.fits(t) and ctx.representable(t) and not _reaches_output(ctx, t)]
    if short:
        why += (f"; {', '.join(short)} leaves it short of headroom but within {ctx.fmt.name}: "
                "the Conv/MatMul/Gemm reading it stays in the target format")
    outs = [t for part in parts for t in part.exit_tensors
            if not ctx.fits(t) and _reaches_output(ctx, t)]
    if outs:
        why += (f"; {', '.join(outs)} exceeds {ctx.fmt.name} with headroom and stays FP32 "
                "up to the graph output")
    if request:
        why += "; the compiler decides precision, so this is a request (crosscheck verifies it)"
    nodes = tuple(sorted(members, key=lambda n: (ctx.order.get(n, len(ctx.order)), n)))
    exits = tuple(dict.fromkeys(t for part in parts for t in part.exit_tensors))
    return PinFp32(nodes=nodes, exit_tensors=exits, findings=(ref,), measured=measured,
                   request=request, why=why.lstrip("; "))


def _grow(ctx: PlanContext, seeds: list[str]) -> list[Island]:
    grown = [grow_island(ctx.model.proto, seed, ctx.fits, types=ctx.types,
                         joins=lambda label, t: _may_join(ctx, label, t)) for seed in seeds]
    if len(grown) <= 1:
        return grown
    # Exits whose readers refused to join stay accepted once the islands are merged.
    accepted = {t for g in grown for t in g.exit_tensors if t not in g.unfit_exits}
    merged = merge_islands(ctx.model.proto, grown, ctx.fits, max_gap=0, types=ctx.types)
    return [replace(m, unfit_exits=tuple(t for t in m.unfit_exits if t not in accepted))
            for m in merged]


def _may_join(ctx: PlanContext, label: str, tensor: str) -> bool:
    """A Conv/MatMul/Gemm joins an island only when the tensor it reads does not fit the
    format at all; elementwise and reduction nodes join whenever the tensor is past the limit."""
    if ctx.node(label).op_type not in MAC_OPS:
        return True
    return not ctx.representable(tensor)


def _reaches_output(ctx: PlanContext, tensor: str) -> bool:
    if tensor in ctx.graph_outputs:
        return True
    node = ctx.produced_by.get(tensor)
    scope = ctx.nodes[node_label(node)][2] if node is not None else "main"
    return scope != "main"


def _mark_static(ctx: PlanContext, problem: Problem) -> None:
    """Without measurements, a rule's members make their outputs large (until its end)."""
    final = problem.finding.evidence.get("output", "")
    for m in problem.seeds:
        node = ctx.node(m)
        if node.op_type in MAKES_MAGNITUDE:
            ctx.static_hot.update(o for o in node.output if o and o != final)
    if final:
        ctx.static_cool.add(final)
    ctx.hot_cache.clear()


def precise_inputs(ctx: PlanContext, members: set[str]) -> list[str]:
    """Producers outside the island whose rounding an Exp inside would turn into a
    relative error above EXP_INPUT_ERROR (exp(x + d) = exp(x)(1 + d))."""
    exp_inputs = [ctx.node(n).input[0] for n in sorted(members) if ctx.node(n).op_type == "Exp"]
    return ctx.precise_producers(exp_inputs, members)


def seeds_for(ctx: PlanContext, problem: Problem) -> list[str]:
    ref, tensor = problem.ref, problem.tensor
    if ref.node in ctx.nodes and ref.rule not in RANGE_RULES:
        return [ref.node]
    label = ctx.producer_label(tensor)
    if label and ctx.node(label).op_type == "If":
        inner = _branch_producers(ctx, ctx.node(label), tensor)
        if inner:
            return inner
    if label:
        return [label]
    return [node_label(n) for _l, (n, _g, _s) in ctx.nodes.items() if tensor in n.input]


def _branch_producers(ctx: PlanContext, node: onnx.NodeProto, tensor: str) -> list[str]:
    """The nodes inside an If's branches that write its output `tensor` and do not fit: the
    pin belongs on them, not on the whole If."""
    pos = list(node.output).index(tensor)
    found: list[str] = []
    for attr in node.attribute:
        if attr.type != onnx.AttributeProto.GRAPH or len(attr.g.output) <= pos:
            continue
        out = attr.g.output[pos].name
        inner = ctx.produced_by.get(out)
        if inner is not None and node_label(inner) in ctx.nodes and not ctx.fits(out):
            found.append(node_label(inner))
    return found


def merged_pins(ctx: PlanContext) -> list[PinFp32]:
    """Merge the islands (fewer Casts), one PinFp32 per connected group."""
    if not ctx.islands:
        return []
    grown = [_as_island(ctx, pin) for pin in ctx.islands]
    grown = [i for group in grown for i in group]
    merged = merge_islands(ctx.model.proto, grown, ctx.fits, types=ctx.types)
    if any(set(m.nodes) & ctx.forbid for m in merged) or any(
            ctx.node(n).op_type in MAC_OPS and n not in _planned(ctx)
            for m in merged for n in m.nodes):
        # Bridging pulled in a forbidden node or a matmul: merge only what touches.
        merged = merge_islands(ctx.model.proto, grown, ctx.fits, max_gap=0, types=ctx.types)
    out: list[PinFp32] = []
    for island in merged:
        members = set(island.nodes)
        parts = [p for p in ctx.islands if members & set(p.nodes)]
        refs = tuple(dict.fromkeys(r for p in parts for r in p.findings))
        measured: dict[str, float] = {}
        for p in parts:
            for k, v in p.measured.items():
                measured[k] = max(measured.get(k, v), v)
        # Graph outputs stay FP32; the exits that matter feed target-precision nodes.
        inner = [t for t in island.exit_tensors if t not in ctx.graph_outputs]
        known = [r.absmax for r in map(ctx.range_of, inner) if r is not None]
        if known:
            measured["exit_absmax"] = float(max(known))
        nodes = tuple(sorted(members, key=lambda n: (ctx.order.get(n, len(ctx.order)), n)))
        out.append(replace(parts[0], nodes=nodes, exit_tensors=tuple(island.exit_tensors),
                           findings=refs, measured=measured,
                           why=" | ".join(dict.fromkeys(p.why for p in parts))))
    return sorted(out, key=lambda a: (ctx.order.get(a.nodes[0], 0), a.nodes))


def _planned(ctx: PlanContext) -> set[str]:
    return {n for p in ctx.islands for n in p.nodes}


def _as_island(ctx: PlanContext, pin: PinFp32) -> list[Island]:
    by_scope: dict[str, list[str]] = {}
    for n in pin.nodes:
        by_scope.setdefault(ctx.nodes[n][2], []).append(n)
    return [island_of(ctx.model.proto, nodes, ctx.fits, types=ctx.types)
            for _scope, nodes in sorted(by_scope.items())]
