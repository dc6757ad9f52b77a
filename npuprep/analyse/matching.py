"""Graph matchers the rules share: squares, max subtraction, guards that bound an op's input."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from npuprep.analyse.context import Context, ScopeView
from npuprep.graph import attribute
from npuprep.numerics import NumberFormat


def square_exponent(view: ScopeView, node: onnx.NodeProto) -> float | None:
    """The power p when the node computes x**p with p > 1 (Pow by a constant, Mul(x, x))."""
    if node.op_type == "Mul" and len(node.input) == 2 and node.input[0] == node.input[1]:
        return 2.0
    if node.op_type == "Pow" and len(node.input) == 2:
        p = view.scalar(node.input[1])
        if p is not None and p > 1:
            return p
    return None


def power_limit(fmt: NumberFormat, p: float) -> float:
    """Largest |x| whose p-th power is finite in `fmt`."""
    return fmt.square_limit if p == 2 else fmt.max ** (1.0 / p)


def is_max_subtracted(view: ScopeView, name: str) -> bool:
    """Whether `name` is x - ReduceMax(x), the stable-softmax shift that keeps exp <= 1."""
    node = view.source(name)
    if node is None or node.op_type != "Sub" or len(node.input) != 2:
        return False
    reducer = view.source(node.input[1])
    return (reducer is not None and reducer.op_type == "ReduceMax"
            and bool(reducer.input) and reducer.input[0] == node.input[0])


def reduction_size(ctx: Context, view: ScopeView, node: onnx.NodeProto) -> int | None:
    """How many elements one output of a Reduce* node sums, from static shapes."""
    shape = ctx.shapes.get(node.input[0]) if node.input else None
    if shape is None or any(d is None for d in shape):
        return None
    axes = attribute(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        value = view.constant(node.input[1])
        if value is None:
            return None
        axes = [int(a) for a in value.reshape(-1)]
    if not axes:
        if attribute(node, "noop_with_empty_axes", 0):
            return 1
        axes = list(range(len(shape)))
    size = 1
    for a in axes:
        size *= int(shape[a % len(shape)])
    return size


@dataclass(frozen=True)
class Guard:
    """A lower bound on a positive input (eps, Max, Clip min) and whether it survives the format."""

    op_type: str
    floor: float
    survives: bool


def positive_floor(view: ScopeView, name: str, fmt: NumberFormat) -> Guard | None:
    """The guard that keeps `name` away from zero, looking through Sqrt and pass-through ops."""
    value = view.constant(name)
    if value is not None:
        low = float(np.abs(value.astype(np.float64)).min()) if value.size else 0.0
        return Guard("constant", low, low > fmt.min_subnormal / 2) if low > 0 else None
    node = view.source(name)
    while node is not None and node.op_type == "Sqrt":
        node = view.source(node.input[0])
    if node is None:
        return None
    floor = None
    if node.op_type in ("Add", "Sum", "Max"):
        consts = [view.scalar(i) for i in node.input]
        positive = [c for c in consts if c is not None and c > 0]
        floor = max(positive) if positive else None
    elif node.op_type == "Clip" and len(node.input) > 1 and node.input[1]:
        low = view.scalar(node.input[1])
        floor = low if low is not None and low > 0 else None
    elif node.op_type == "Clip":
        low = attribute(node, "min")
        floor = float(low) if low is not None and low > 0 else None
    elif node.op_type == "ReduceSum":
        # sum(exp(x - max(x))) >= 1: the max element contributes exp(0).
        inner = view.source(node.input[0])
        if inner is not None and inner.op_type == "Exp" and is_max_subtracted(view, inner.input[0]):
            floor = 1.0
    if floor is None:
        return None
    return Guard(node.op_type, floor, floor > fmt.min_subnormal / 2)


def upper_bound(view: ScopeView, name: str) -> float | None:
    """A constant upper bound on `name` set by Clip or Min just before it, else None."""
    node = view.source(name)
    if node is None:
        return None
    if node.op_type == "Clip":
        if len(node.input) > 2 and node.input[2]:
            return view.scalar(node.input[2])
        high = attribute(node, "max")
        return float(high) if high is not None else None
    if node.op_type == "Min":
        consts = [view.scalar(i) for i in node.input]
        bounds = [c for c in consts if c is not None]
        return min(bounds) if bounds else None
    return None


def magnitude_bound(view: ScopeView, name: str) -> float | None:
    """A constant bound on |name| set by a symmetric-enough Clip, else None."""
    node = view.source(name)
    if node is None or node.op_type != "Clip":
        return None
    if len(node.input) > 2 and node.input[1] and node.input[2]:
        low, high = view.scalar(node.input[1]), view.scalar(node.input[2])
    else:
        low, high = attribute(node, "min"), attribute(node, "max")
    if low is None or high is None:
        return None
    return max(abs(float(low)), abs(float(high)))
