"""Remedy 6, clamp: `Exp(x) -> Exp(Clip(x, hi))`, `x*x -> Clip(x)^2`, `a/b -> a/guard(b)`, `Log(Clip(x, lo))`.

A clamp changes numbers, so it is the last resort and only a guard: it is declined when
measured values lie beyond the bound (the answer would change), unless the user's plan
asks for it. It only applies where the op allows one: Exp, Log and square inputs,
division denominators.
"""

from __future__ import annotations

import math

import onnx

from npuprep.graph import constant_value
from npuprep.plan.actions import Clamp, Declined
from npuprep.plan.context import RANGE_RULES, Outcome, PlanContext, Problem


def propose(ctx: PlanContext, problem: Problem, before: tuple[str, ...]) -> Outcome:
    f, ref, tensor = problem.finding, problem.ref, problem.tensor
    if problem.kind not in ("overflow", "static"):
        return None
    if problem.kind == "static" and f.remedy not in ("clamp", "pin_fp32"):
        return None
    if problem.absmax is not None and problem.absmax <= ctx.fmt.max:
        return None  # representable: a clamp would only change the answer
    label = f.node if f.node in ctx.nodes and f.rule not in RANGE_RULES \
        else ctx.producer_label(tensor)
    where = tensor or f.node
    if label not in ctx.nodes:
        return (Declined("clamp", where, f"no node to clamp around {tensor}", (ref,)),)
    clamp = _clamp_for(ctx, problem, label, before)
    if isinstance(clamp, str):
        return (Declined("clamp", where, clamp, (ref,)),)
    changed = clamp.measured.get("share_clipped", clamp.measured.get("share_below_guard"))
    r = ctx.range_of(clamp.tensor)
    if changed is None and r is not None and clamp.hi is not None and r.absmax > clamp.hi:
        changed = 1.0 / max(1, int(getattr(r, "count", 0) or 1))
    if changed:
        return (Declined("clamp", clamp.tensor, (
            f"clamping {clamp.tensor} would change measured values (share {changed:.2g}), so "
            "the answer would change; add a user clamp to the plan to accept that"), (ref,)),)
    return clamp


def _clamp_for(ctx: PlanContext, problem: Problem, label: str, before: tuple[str, ...]) -> Clamp | str:
    node, graph, _scope = ctx.nodes[label]
    ref, limit, fmt = problem.ref, ctx.limit, ctx.fmt
    prefix = "; ".join(before)
    prefix = f"{prefix}; " if prefix else ""
    if node.op_type == "Exp":
        hi = _floor3(math.log(limit))
        x = node.input[0]
        why = (f"{prefix}clip the input of Exp at ln(limit) = {hi:g} so exp stays within "
               f"{limit:.6g}; only values that would overflow change")
        return Clamp(x, None, hi, "exp", (label,), (ref,), _numbers(ctx, x, hi), why)
    square_of = _square_input(node, graph)
    if square_of is not None:
        b = _floor3(math.sqrt(limit))
        why = (f"{prefix}clip the input of the square at +-sqrt(limit) = {b:g} so x^2 stays "
               f"within {limit:.6g}; only values that would overflow change")
        return Clamp(square_of, -b, b, "square", (label,), (ref,), _numbers(ctx, square_of, b), why)
    if node.op_type in ("Div", "Reciprocal"):
        d = node.input[1] if node.op_type == "Div" else node.input[0]
        num = ctx.range_of(node.input[0]) if node.op_type == "Div" else None
        numerator = float(num.absmax) if num is not None else 1.0
        lo = max(fmt.min_normal, 2.0 ** math.ceil(math.log2(max(numerator, 1e-30) / limit)))
        measured = {"numerator_absmax": numerator, "limit": float(limit)}
        share = ctx.share(d, lo, below=True)
        if share is not None:
            measured["share_below_guard"] = share
        why = (f"{prefix}keep |{d}| >= {lo:.6g} so |numerator| {numerator:.6g} / |{d}| "
               f"stays within {limit:.6g}; the sign is kept")
        return Clamp(d, lo, None, "denominator", (label,), (ref,), measured, why)
    if node.op_type == "Log":
        lo = fmt.min_normal
        x = node.input[0]
        why = (f"{prefix}clip the input of Log at the smallest {fmt.name} normal "
               f"{lo:.3g} so it never sees 0; only values that flush change")
        measured = {"bound": lo}
        share = ctx.share(x, lo, below=True)
        if share is not None:
            measured["share_clipped"] = share
        return Clamp(x, lo, None, "log", (label,), (ref,), measured, why)
    return f"{node.op_type} node {label} takes no clamp (only Exp, Log, squares, divisions)"


def _numbers(ctx: PlanContext, tensor: str, bound: float) -> dict[str, float]:
    r = ctx.range_of(tensor)
    out = {"bound": float(bound), "limit": float(ctx.limit)}
    if r is not None:
        out["absmax"] = float(r.absmax)
    share = ctx.share(tensor, bound, below=False)
    if share is not None:
        out["share_clipped"] = share
    return out


def _floor3(x: float) -> float:
    """Round a bound down to three decimals, so it reads well and stays on the safe side."""
    return math.floor(x * 1000) / 1000


def _square_input(node: onnx.NodeProto, graph: onnx.GraphProto) -> str | None:
    """The x of Mul(x, x) or Pow(x, 2), else None."""
    if node.op_type == "Mul" and len(node.input) == 2 and node.input[0] == node.input[1]:
        return node.input[0]
    if node.op_type == "Pow" and len(node.input) == 2:
        exponent = constant_value(graph, node.input[1])
        if exponent is not None and exponent.size == 1 and float(exponent.reshape(())) == 2.0:
            return node.input[0]
    return None
