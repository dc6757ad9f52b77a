"""Small-op hazards: x**2, sums of squares, large sums, Exp, unguarded Div/Reciprocal/Log, Sqrt of squares."""

from __future__ import annotations

import math

import onnx

from npuprep.analyse.context import Context, ScopeView
from npuprep.analyse.finding import Finding
from npuprep.analyse.matching import (
    is_max_subtracted,
    magnitude_bound,
    positive_floor,
    power_limit,
    reduction_size,
    square_exponent,
    upper_bound,
)
from npuprep.graph import node_label
from npuprep.ops import MAC_OPS
from npuprep.profiles import Severity

# From this many summed elements on, values averaging max/256 (256 in FP16) overflow the sum.
LARGE_REDUCTION = 256


def _has_weighted_producer(view: ScopeView, name: str) -> bool:
    """Whether `name` comes from a Conv/Gemm/MatMul with constant weights (rescale can act)."""
    node = view.source(name)
    # Centring (Sub of a mean), bias Adds and Relu carry a power-of-two scale unchanged.
    while node is not None and node.op_type in ("Sub", "Add", "Relu") and node.input:
        node = view.source(node.input[0])
    return (node is not None and node.op_type in MAC_OPS
            and any(view.is_constant(i) for i in node.input[1:2]))


def _bounded(view: ScopeView, name: str, limit: float) -> bool:
    """Whether a Clip right before `name` keeps |name| within `limit`."""
    bound = magnitude_bound(view, name)
    return bound is not None and bound <= limit


def _squares_upstream(view: ScopeView, name: str) -> onnx.NodeProto | None:
    """The square or sum of squares feeding `name` (through an eps Add or a mean)."""
    node = view.source(name)
    for _ in range(3):
        if node is None:
            return None
        if node.op_type in ("ReduceSumSquare", "ReduceL2") or square_exponent(view, node):
            return node
        if node.op_type not in ("Add", "ReduceMean", "ReduceSum"):
            return None
        node = view.source(node.input[0])
    return None


def find(ctx: Context) -> list[Finding]:
    fmt = ctx.fmt
    hazard = ctx.profile.severity["hazard"]
    clamp_exp_at = math.log(ctx.target.limit)
    findings: list[Finding] = []

    for view, node in ctx.float_nodes():
        op = node.op_type

        def add(rule: str, message: str, evidence: dict, remedy: str, text: str,
                severity: Severity = hazard, node: onnx.NodeProto = node,
                view: ScopeView = view) -> None:
            findings.append(Finding(
                rule=rule, severity=severity, node=node_label(node), op_type=node.op_type,
                message=message, tensor=node.output[0] if node.output else "", scope=view.path,
                evidence={"format": fmt.name, **evidence}, remedy=remedy, remedy_text=text,
            ))

        p = square_exponent(view, node)
        if p is not None:
            limit = power_limit(fmt, p)
            if not _bounded(view, node.input[0], limit):
                rescale = _has_weighted_producer(view, node.input[0])
                add("hazard.square", f"x^{p:g} overflows {fmt.name} for |x| > {limit:.4g}",
                    {"exponent": p, "input_limit": limit, "max": fmt.max},
                    "rescale" if rescale else "pin_fp32",
                    ("scale the producer's weights by 2^-k so |x| stays below "
                     f"{limit:.4g}, or pin the square to FP32") if rescale else
                    (f"pin the square and what consumes it to FP32, or clip its input at "
                     f"+-{limit:.4g} where physical bounds allow"))
            continue

        if op in ("ReduceSumSquare", "ReduceL2") or (
                op == "ReduceSum" and square_exponent(view, view.source(node.input[0]) or node)):
            n = reduction_size(ctx, view, node)
            element_limit = math.sqrt(fmt.max / n) if n else fmt.square_limit
            squared = view.source(node.input[0]) if op == "ReduceSum" else node
            if _bounded(view, squared.input[0], element_limit):
                continue
            add("hazard.reduce_square",
                f"sum of {n if n else 'an unknown number of'} squares overflows {fmt.name} once "
                f"elements reach {element_limit:.4g}",
                {"reduction_size": n, "element_limit": element_limit, "max": fmt.max},
                "pin_fp32", "pin the reduction to FP32, or rescale its input by 2^-k (exact)")
        elif op == "ReduceSum":
            n = reduction_size(ctx, view, node)
            if n is None:
                add("hazard.reduce_sum",
                    f"sum over an unknown number of elements may overflow {fmt.name}",
                    {"reduction_size": None, "max": fmt.max}, "pin_fp32",
                    "check its measured range; pin it to FP32 if it nears the limit",
                    severity=Severity.INFO)
            elif n >= LARGE_REDUCTION and not _bounded(view, node.input[0], fmt.max / n):
                add("hazard.reduce_sum",
                    f"sum of {n} elements overflows {fmt.name} once they average {fmt.max / n:.4g}",
                    {"reduction_size": n, "element_limit": fmt.max / n, "max": fmt.max},
                    "pin_fp32", "pin the reduction to FP32 (FP32 accumulation), or rescale its input")
        elif op == "Exp":
            bound = upper_bound(view, node.input[0])
            if not is_max_subtracted(view, node.input[0]) and (bound is None or bound > fmt.exp_limit):
                add("hazard.exp", f"exp overflows {fmt.name} for x > {fmt.exp_limit:.4g}",
                    {"input_limit": fmt.exp_limit, "clamp_at": clamp_exp_at, "max": fmt.max},
                    "clamp", f"clip the input at {clamp_exp_at:.4g} (ln of the headroom limit), "
                    "subtract the max first inside a softmax, or pin to FP32")
        elif op in ("Div", "Reciprocal", "Log"):
            operand = node.input[1] if op == "Div" else node.input[0]
            guard = positive_floor(view, operand, fmt)
            if guard is not None and guard.survives:
                continue
            evidence = {"operand": operand, "guard": guard.op_type if guard else None,
                        "guard_floor": guard.floor if guard else None}
            flushed = (f"; its guard {guard.floor:.3g} flushes to zero in {fmt.name}"
                       if guard else "")
            if op == "Log":
                add("hazard.log", f"log of a value near 0 gives -inf; inputs below "
                    f"{fmt.min_subnormal / 2:.3g} flush to 0 in {fmt.name}{flushed}",
                    {**evidence, "flush_below": fmt.min_subnormal / 2,
                     "smallest_log": math.log(fmt.min_subnormal)},
                    "clamp", f"clip the input at {fmt.min_normal:.3g} (min normal) or pin to FP32")
            else:
                what = "denominator" if op == "Div" else "input"
                add(f"hazard.{op.lower()}",
                    f"unguarded {what}: |1/x| overflows {fmt.name} for |x| < {1 / fmt.max:.3g}"
                    f"{flushed}",
                    {**evidence, "overflow_below": 1 / fmt.max, "min_normal": fmt.min_normal},
                    "clamp", f"guard the {what}: Max(|x|, eps) or x + eps with eps >= "
                    f"{fmt.min_normal:.3g}, or pin to FP32")
        elif op == "Sqrt":
            upstream = _squares_upstream(view, node.input[0])
            if upstream is not None:
                add("hazard.sqrt",
                    f"Sqrt of a sum of squares ({node_label(upstream)}): the input overflows "
                    f"{fmt.name} before Sqrt brings it back",
                    {"squares": node_label(upstream), "element_limit": fmt.square_limit,
                     "max": fmt.max},
                    "pin_fp32", "pin the squares, the reduction and the Sqrt to FP32 as one "
                    "island, or rescale the input by 2^-k")
    return findings
