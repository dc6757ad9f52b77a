"""A sum divided by its own count is a mean: `Mul(ReduceSum(x), 1/N)` -> `ReduceMean(x)`.

Exporters (jax2tf, TF's constant folding) write a mean over N elements as a ReduceSum
followed by a Mul by 1/N or a Div by N. The sum is N times larger than anything the model
needs: a LayerNorm's sum of squares reaches 1.7e5 in FP16 where the mean is 700. As one
ReduceMean the only stored value is the mean (a kernel accumulates wider than its output),
which is what a compiler makes of it too (rknn-toolkit2 fuses the pair). Exact up to FP32
rounding; the ReduceMean keeps the Mul's name and output tensor, so plans and statistics
still find it.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from npuprep.graph import attribute, constant_value, consumers, infer_tensors, node_label, producers
from npuprep.rewrite.result import RewriteResult, sites_result

# 1/N as stored in FP32 (or N itself) matches the count to this relative tolerance.
COUNT_RTOL = 1e-6
# ReduceMean takes its axes as an input from opset 18 on, as an attribute before.
AXES_INPUT_OPSET = 18


def sums_to_means(model: onnx.ModelProto) -> RewriteResult:
    """Fold every main-graph `ReduceSum -> Mul(1/N)` or `ReduceSum -> Div(N)` whose sum feeds
    nothing else and whose N is the count of the reduced elements.

    details: "replaced" {node: how}, "declined" {node: why} for each candidate pair.
    """
    graph = model.graph
    if not any(n.op_type == "ReduceSum" for n in graph.node):
        # Most models: no shape inference spent on convert's and check's start.
        return RewriteResult(model, False, "no ReduceSum divided by its count",
                             {"replaced": {}, "declined": {}})
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    shapes = infer_tensors(model).dims
    made = producers(graph)
    readers = consumers(graph)
    replaced: dict[str, str] = {}
    declined: dict[str, str] = {}
    swaps: dict[str, onnx.NodeProto] = {}  # label of the Mul/Div -> its ReduceMean
    dropped: set[str] = set()
    for node in graph.node:
        if node.op_type not in ("Mul", "Div") or len(node.input) != 2:
            continue
        sides = [0, 1] if node.op_type == "Mul" else [0]
        for pos in sides:
            total = made.get(node.input[pos])
            if total is None or total.op_type != "ReduceSum":
                continue
            label = node_label(node)
            why = _why_not(graph, node, pos, total, readers, shapes, opset)
            if why:
                declined[label] = why
                break
            swaps[label] = _mean_node(total, node, graph, opset)
            dropped.add(node_label(total))
            replaced[label] = (f"{node_label(total)} -> {label} is the mean over "
                               f"{_count(total, graph, shapes)} elements: one ReduceMean")
            break
    def rewritten() -> onnx.ModelProto:
        out = onnx.ModelProto()
        out.CopyFrom(model)
        nodes = [swaps.get(node_label(n), n) for n in out.graph.node if node_label(n) not in dropped]
        del out.graph.node[:]
        out.graph.node.extend(nodes)
        return out

    return sites_result(model, rewritten, replaced, declined,
                        nothing="no ReduceSum divided by its count",
                        done="; ".join(f"{n}: {r}" for n, r in replaced.items()))


def _why_not(graph: onnx.GraphProto, node: onnx.NodeProto, pos: int, total: onnx.NodeProto,
             readers: dict[str, list[onnx.NodeProto]], shapes: dict[str, tuple[int | None, ...]],
             opset: int) -> str:
    if opset < 13:
        return f"opset {opset}: ReduceSum takes its axes as an input only from opset 13"
    if len(readers.get(total.output[0], [])) != 1 or any(total.output[0] == o.name for o in graph.output):
        return f"the sum {total.output[0]} is read elsewhere too"
    count = _count(total, graph, shapes)
    if count is None:
        return f"the count of {total.output[0]}'s reduced elements is not static"
    factor = constant_value(graph, node.input[1 - pos])
    if factor is None or factor.size != 1 or not np.issubdtype(factor.dtype, np.floating):
        return "the other operand is not a constant scalar"
    value = float(factor.reshape(()))
    expected = 1.0 / count if node.op_type == "Mul" else float(count)
    if not math.isclose(value, expected, rel_tol=COUNT_RTOL):
        return f"the constant {value:.7g} is not {'1/' if node.op_type == 'Mul' else ''}{count}"
    return ""


def _axes(total: onnx.NodeProto, graph: onnx.GraphProto) -> list[int] | None:
    """The reduced axes ([] = all), or None when they are not constant."""
    if len(total.input) > 1 and total.input[1]:
        value = constant_value(graph, total.input[1])
        return None if value is None else [int(a) for a in value.reshape(-1)]
    axes = attribute(total, "axes")
    return [int(a) for a in axes] if axes else []


def _count(total: onnx.NodeProto, graph: onnx.GraphProto,
           shapes: dict[str, tuple[int | None, ...]]) -> int | None:
    axes = _axes(total, graph)
    shape = shapes.get(total.input[0])
    if axes is None or shape is None:
        return None
    if not axes:
        if attribute(total, "noop_with_empty_axes", 0):
            return None  # no reduction at all: nothing to fold
        axes = list(range(len(shape)))
    reduced = [shape[a % len(shape)] for a in axes] if shape else []
    if not reduced or any(d is None or d <= 0 for d in reduced):
        return None  # only the reduced dimensions need to be static
    return math.prod(reduced)  # type: ignore[arg-type]


def _mean_node(total: onnx.NodeProto, node: onnx.NodeProto, graph: onnx.GraphProto,
               opset: int) -> onnx.NodeProto:
    axes = _axes(total, graph) or []
    keepdims = int(attribute(total, "keepdims", 1))
    if opset >= AXES_INPUT_OPSET and axes:
        return helper.make_node("ReduceMean", [total.input[0], total.input[1]], [node.output[0]],
                                name=node_label(node), keepdims=keepdims)
    kwargs = {"axes": axes} if axes else {}
    return helper.make_node("ReduceMean", [total.input[0]], [node.output[0]], name=node_label(node),
                            keepdims=keepdims, **kwargs)
