"""Which format each node runs in: `{node: fmt}` for a plan, or read back from a converted model.

`planned_costs`: the source FP32 graph with every node at an assigned format; where a float
tensor crosses formats a Cast is added (Cast(x) fp16->fp32), as convert's lowering does.
`converted_costs`: a converted model as written: each node at its outputs' element type, its
Casts and QuantizeLinear nodes counted as the format boundaries they are, a Conv/MatMul fed by
DequantizeLinear at the 8-bit type it dequantises (a compiler fuses the pair).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import onnx
from onnx import TensorProto, helper

from npuprep.graph import node_label, tensor_types, walk_graphs
from npuprep.ledger.roofline import BYTES_PER_ELEMENT, NodeCost, cast_cost, fused_inputs, node_cost
from npuprep.ops import MAC_OPS
from npuprep.profiles import Throughput

FLOAT_TYPES = {TensorProto.FLOAT: "fp32", TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}
FORMAT_OF_TYPE = {**FLOAT_TYPES, TensorProto.FLOAT8E4M3FN: "fp8_e4m3", TensorProto.FLOAT8E5M2: "fp8_e5m2",
                  TensorProto.INT8: "int8", TensorProto.UINT8: "int8"}
Shapes = Mapping[str, tuple[int, ...]]


def stored_precision(model: onnx.ModelProto) -> str | None:
    """The low float format a converted model stores (bf16 or fp16); None where it stores none."""
    stored = {FLOAT_TYPES.get(t) for t in tensor_types(model).values()}
    return next((f for f in ("bf16", "fp16") if f in stored), None)


def _itemsize(elem_type: int | None) -> float:
    if elem_type is None or elem_type == TensorProto.UNDEFINED:
        return 4
    return float(helper.tensor_dtype_to_np_dtype(elem_type).itemsize)


def _elements(shapes: Shapes, name: str) -> int:
    n = 1
    for d in shapes.get(name, ()):
        n *= d
    return n


def _nodes(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, str]]:
    return [(n, node_label(n)) for s in walk_graphs(model.graph) for n in s.graph.node]


def _fusions(model: onnx.ModelProto, nodes: list[tuple[onnx.NodeProto, str]],
             throughput: Throughput) -> dict[int, str]:
    if not throughput.fuses_elementwise:
        return {}
    return fused_inputs([n for n, _ in nodes], {o.name for o in model.graph.output})


def planned_costs(model: onnx.ModelProto, fmt_of: Callable[[onnx.NodeProto, str], str],
                  throughput: Throughput, shapes: Shapes, types: Mapping[str, int],
                  flops: Mapping[str, int], *, casts: bool) -> list[NodeCost]:
    """Every node of `model` at `fmt_of(node, label)`; float tensors move at that format,
    others at their own size. `casts`: add a Cast wherever a float tensor changes format,
    graph inputs and outputs (FP32 for the caller) included; without, the model's own Casts
    between float formats cost nothing (all one format, they have nothing to do)."""
    floats = {t for t, ty in types.items() if ty in FLOAT_TYPES}
    weights = {i.name for s in walk_graphs(model.graph) for i in s.graph.initializer}
    produced: dict[str, str] = {i.name: "fp32" for i in model.graph.input}
    costs: list[NodeCost] = []
    boundary: dict[tuple[str, str], NodeCost] = {}
    nodes = _nodes(model)
    fusions = _fusions(model, nodes, throughput)
    fmts: dict[str, str] = {}
    for i, (node, label) in enumerate(nodes):
        computes = any(o in floats for o in node.output)
        if node.op_type == "Cast" and not casts:
            computes = False
        fmt = fmt_of(node, label) if computes else "fp32"
        size = BYTES_PER_ELEMENT[fmt]
        # Where Casts are modelled, a node fuses only into a producer of its own format (the
        # Cast between them is a kernel of its own); a TF32 or 8-bit MAC's epilogue runs the
        # activation in the row's other format.
        src = fusions.get(i)
        fused = src if src is not None and (not casts or fmts.get(src) == fmt) else None
        for o in node.output:
            fmts[o] = fmt
        costs.append(node_cost(node, label, fmt, flops.get(label, 0), shapes,
                               lambda t, size=size: size if t in floats else _itemsize(types.get(t)),
                               throughput, free=not computes, fused_from=fused))
        if casts and computes:
            for t in node.input:
                src = produced.get(t)
                if t in floats and t not in weights and src is not None and src != fmt:
                    boundary.setdefault((t, fmt), cast_cost(t, _elements(shapes, t), src, fmt, throughput))
        for o in node.output:
            produced[o] = fmt
    if casts:
        for out in model.graph.output:
            src = produced.get(out.name, "fp32")
            if out.name in floats and src != "fp32":
                boundary.setdefault((out.name, "fp32"),
                                    cast_cost(out.name, _elements(shapes, out.name), src, "fp32", throughput))
    return costs + sorted(boundary.values(), key=lambda c: c.node)


def converted_costs(model: onnx.ModelProto, throughput: Throughput, shapes: Shapes,
                    types: Mapping[str, int], flops: Mapping[str, int],
                    fp32_runs_as: str | None = None) -> list[NodeCost]:
    """Every node of a converted model at the format it was written in; `fp32_runs_as`: the
    format a target that cannot pin runs FP32 nodes and tensors in (rk3588: FP16). A Cast
    runs on the unit of its narrower side."""
    dequantised = {n.output[0]: types.get(n.input[0]) for n, _ in _nodes(model)
                   if n.op_type == "DequantizeLinear" and n.output}
    costs: list[NodeCost] = []
    nodes = _nodes(model)
    fusions = _fusions(model, nodes, throughput)
    for i, (node, label) in enumerate(nodes):
        outs = [types.get(o) for o in node.output if o]
        quantised = [dequantised[t] for t in node.input if t in dequantised]
        if node.op_type in MAC_OPS and quantised:
            fmt = FORMAT_OF_TYPE.get(quantised[0] or 0, "int8")
        else:
            fmt = next((FORMAT_OF_TYPE[t] for t in outs if t in FORMAT_OF_TYPE), "")
        if node.op_type == "Cast" and fmt == "fp32":
            fmt = FORMAT_OF_TYPE.get(types.get(node.input[0]) or 0, fmt)
        if fmt == "fp32" and fp32_runs_as:
            fmt = fp32_runs_as
        computes = bool(fmt)

        def size(t: str) -> float:
            if fp32_runs_as and types.get(t) == TensorProto.FLOAT:
                return BYTES_PER_ELEMENT[fp32_runs_as]
            return _itemsize(dequantised[t] if t in dequantised else types.get(t))

        cost = node_cost(node, label, fmt or "fp32", flops.get(label, 0), shapes, size, throughput,
                         free=not computes, fused_from=fusions.get(i))
        if node.op_type == "QuantizeLinear" and computes:
            cost = replace(cost, cast=True)
        costs.append(cost)
    return costs
