"""8-bit QDQ: `Conv(x, W)` -> `Conv(DQ(Q(x, s)), DQ(W8, s_c))`, weights per output channel.

Activations get one QuantizeLinear/DequantizeLinear pair per tensor with the scale the plan
chose (shared by every 8-bit consumer; other consumers keep reading the FP32 tensor).
Weights are stored quantised, symmetric, one scale per output channel, behind a
DequantizeLinear: the standard form onnxruntime and NPU compilers read. FP8 is
FLOAT8E4M3FN; its QuantizeLinear saturates or not as the caller says (`saturate=`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.graph import (
    attribute,
    constant_value,
    name_maker,
    node_label,
    node_scopes,
    tensor_types,
    walk_graphs,
)
from npuprep.numerics import EightBitFormat
from npuprep.rewrite.qdq_weights import WeightStore
from npuprep.rewrite.result import RewriteResult


@dataclass(frozen=True)
class ActivationScale:
    """Per-tensor scale of an activation; `unsigned` for an INT8 tensor stored as uint8 (a
    non-negative one, or a skewed one with `zero_point`: real = scale x (stored - zero_point))."""

    scale: float
    unsigned: bool = False
    zero_point: int = 0


def weight_axis(node: onnx.NodeProto, rank: int) -> int | None:
    """The output-channel axis of `node`'s weight (input 1), None when it has none."""
    if node.op_type == "Conv" and rank >= 3:
        return 0
    # [C_in, C_out / group, k...]: with groups, axis 1 is not one output channel but one per
    # group; such a weight takes one scale.
    if node.op_type == "ConvTranspose" and rank >= 3:
        return 1 if attribute(node, "group", 1) == 1 else None
    if node.op_type == "MatMul" and rank == 2:
        return 1
    if node.op_type == "Gemm" and rank == 2:
        return 0 if attribute(node, "transB", 0) else 1
    return None


def dequantised_weight(node: onnx.NodeProto, w: np.ndarray, fmt: EightBitFormat, *,
                       saturate: bool, weights: WeightStore) -> np.ndarray:
    """`w` as its 8-bit copy in `fmt` (the store's: nearest, or rounded for the layer)
    dequantises it: DequantizeLinear's own float32 product of the stored value and its
    channel's scale."""
    axis = weight_axis(node, w.ndim)
    stored, scale = weights.values(w, axis, fmt, saturate=saturate)
    shape = [1] * w.ndim
    if axis is not None:
        shape[axis] = -1
    return (stored.astype(np.float32) * scale.reshape(shape)).astype(np.float32)


def insert_qdq(model: onnx.ModelProto, nodes: Mapping[str, Mapping[str, ActivationScale]],
               fmt: EightBitFormat, *, saturate: bool, weights: WeightStore | None = None) -> RewriteResult:
    """Quantise the inputs of `nodes` (label -> {activation tensor: scale}) to `fmt`.

    A node's constant input 1 is its weight (quantised per channel here, through `weights`:
    made once per conversion and kept where the store keeps them); every other input named
    in its mapping is quantised per tensor. Declines a node whose inputs are not FP32.
    """
    weights = weights or WeightStore()
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    types = tensor_types(model)
    tensor_name = name_maker(g)
    # Node names too: a model quantised once already (INT8 and FP8 layers) holds x_Q8.
    nodes_named = {n.name for scope in walk_graphs(g) for n in scope.graph.node}

    def fresh(base: str) -> str:
        name = tensor_name(base)
        while name in nodes_named:
            name = tensor_name(base)
        nodes_named.add(name)
        return name

    # A layer of an If/Loop/Scan body gets its pairs and DequantizeLinear in its body, beside
    # it (the pattern a compiler fuses); every scale and 8-bit weight is an initialiser of the
    # main graph, which every body may read: a weight read by several bodies is stored once.
    scopes = [s.graph for s in walk_graphs(g)]
    chains = node_scopes(g)
    pairs: dict[tuple[int, str], str] = {}
    added: dict[int, list[onnx.NodeProto]] = {}
    declined: dict[str, str] = {}
    done: list[str] = []

    def activation(scope: onnx.GraphProto, tensor: str, s: ActivationScale) -> str:
        key = (id(scope), tensor)
        if key not in pairs:
            pairs[key] = qdq_pair(g, added.setdefault(id(scope), []), fresh, tensor, tensor, fmt,
                                  saturate, s)
        return pairs[key]

    for scope in scopes:
        for node in scope.node:
            label = node_label(node)
            wanted = nodes.get(label)
            # A label two scopes share names the first node (node_scopes): that one only.
            if wanted is None or label in done or label in declined:
                continue
            inputs = [i for i in node.input[:2] if i]
            if any(types.get(i, TensorProto.FLOAT) != TensorProto.FLOAT for i in inputs):
                declined[label] = "an input is not FP32"
                continue
            weight = (scope_weight(chains[label][1], node.input[1]) if len(node.input) > 1
                      else None)
            if weight is not None:
                node.input[1] = weight_dq(g, node, weight, fmt, fresh, saturate, weights,
                                          into=added.setdefault(id(scope), []))
            for i, name in enumerate(node.input):
                if name in wanted and not (i == 1 and weight is not None):
                    node.input[i] = activation(scope, name, wanted[name])
            done.append(label)
    if not done:
        return RewriteResult(model, False, "no node could be quantised", {"declined": declined})
    # Bodies first, innermost first: sorting a graph copies its nodes, bodies and all.
    for scope in reversed(scopes):
        scope.node.extend(added.get(id(scope), []))
        sort_nodes(scope)
    drop_unused_weights(g)
    return RewriteResult(out, True, f"{len(done)} node(s) quantised to {fmt.name}",
                         {"quantised": done, "declined": declined})


def qdq_pair(g: onnx.GraphProto, added: list[onnx.NodeProto], fresh: Callable[[str], str],
             tensor: str, stem: str, fmt: EightBitFormat, saturate: bool, s: ActivationScale) -> str:
    """A QuantizeLinear/DequantizeLinear pair of `tensor` at scale `s` (its nodes appended to
    `added`, its scale and zero point to `g`), named from `stem`; the dequantised tensor."""
    scale, zp = fresh(f"{stem}_scale8"), fresh(f"{stem}_zp8")
    q, dq = fresh(f"{stem}_q8"), fresh(f"{stem}_dq8")
    g.initializer.append(numpy_helper.from_array(np.array(s.scale, np.float32), scale))
    g.initializer.append(zero_point(zp, fmt, (), unsigned=s.unsigned, value=s.zero_point))
    extra = {"saturate": int(saturate)} if fmt.is_float else {}
    added.append(helper.make_node("QuantizeLinear", [tensor, scale, zp], [q], name=fresh(f"{stem}_Q8"),
                                  **extra))
    added.append(helper.make_node("DequantizeLinear", [q, scale, zp], [dq], name=fresh(f"{stem}_DQ8")))
    return dq


def weight_dq(g: onnx.GraphProto, node: onnx.NodeProto, w: onnx.TensorProto | np.ndarray,
              fmt: EightBitFormat, fresh: Callable[[str], str], saturate: bool,
              weights: WeightStore, into: list[onnx.NodeProto] | None = None) -> str:
    """The quantised copy of `node`'s weight (initialisers of `g`) behind a DequantizeLinear
    appended to `into` (default: `g`'s nodes); its output's name."""
    base = node.input[1]
    q_name, s_name, z_name = fresh(f"{base}_w8"), fresh(f"{base}_wscale8"), fresh(f"{base}_wzp8")
    made = weights.quantised(w, weight_axis(node, len(w.dims) if isinstance(w, onnx.TensorProto) else w.ndim),
                             fmt, saturate=saturate, name=q_name)
    g.initializer.append(made.stored)
    g.initializer.append(numpy_helper.from_array(made.scale, s_name))
    g.initializer.append(zero_point(z_name, fmt, made.scale.shape, unsigned=False))
    out = fresh(f"{base}_dq8")
    extra = {} if made.axis is None else {"axis": made.axis}
    dq = helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [out],
                          name=fresh(f"{base}_DQ8"), **extra)
    (g.node if into is None else into).append(dq)
    return out


def scope_weight(chain: Sequence[onnx.GraphProto], name: str) -> onnx.TensorProto | np.ndarray | None:
    """`fp32_weight` of `name` in the first graph of `chain` (a node's graph, then those
    around it) that holds it as a constant."""
    for graph in chain:
        found = fp32_weight(graph, name)
        if found is not None:
            return found
        if constant_value(graph, name) is not None:
            return None
    return None


def fp32_weight(g: onnx.GraphProto, name: str) -> onnx.TensorProto | np.ndarray | None:
    """`name`'s FP32 initialiser as it is stored (not read: the store reads it when it has not
    quantised it before), or the FP32 value of another constant, else None."""
    init = next((i for i in g.initializer if i.name == name), None)
    if init is not None and init.data_type == TensorProto.FLOAT:
        return init
    value = constant_value(g, name) if name else None
    return value if value is not None and value.dtype == np.float32 else None


def zero_point(name: str, fmt: EightBitFormat, shape: tuple[int, ...], *, unsigned: bool,
          value: int = 0) -> onnx.TensorProto:
    if fmt.is_float:
        return helper.make_tensor(name, fmt.onnx_type, shape, bytes(int(np.prod(shape))), raw=True)
    return numpy_helper.from_array(np.full(shape, value, np.uint8 if unsigned else np.int8), name)


def zero_points(model: onnx.ModelProto) -> tuple[int, int]:
    """(INT8 activations written as uint8 with a non-zero zero point, QuantizeLinear nodes) of
    a QDQ model (weights are stored quantised: every QuantizeLinear is an activation's): what
    a compiler that takes symmetric INT8 only refuses."""
    scopes = list(walk_graphs(model.graph))
    consts = {i.name: i for scope in scopes for i in scope.graph.initializer}
    quantised = [n for scope in scopes for n in scope.graph.node if n.op_type == "QuantizeLinear"]
    offset = sum(1 for n in quantised if len(n.input) > 2 and n.input[2] in consts
                 and consts[n.input[2]].data_type == TensorProto.UINT8
                 and numpy_helper.to_array(consts[n.input[2]]).any())
    return offset, len(quantised)


def drop_unused_weights(g: onnx.GraphProto) -> None:
    """FP32 weights every consumer of which now reads the 8-bit copy leave the file: the main
    graph's and a body's own (its 8-bit copy lives in the main graph)."""
    for scope in walk_graphs(g):
        used = {i for inner in walk_graphs(scope.graph) for n in inner.graph.node for i in n.input}
        used |= {o.name for o in scope.graph.output}
        kept = [i for i in scope.graph.initializer if i.name in used]
        if len(kept) < len(scope.graph.initializer):
            del scope.graph.initializer[:]
            scope.graph.initializer.extend(kept)


def settle(g: onnx.GraphProto, added: Sequence[onnx.NodeProto]) -> None:
    """A rewrite's last step: its `added` nodes in the graph, every node after its inputs'
    producers, and the initialisers nothing reads any more gone."""
    g.node.extend(added)
    sort_nodes(g)
    drop_unused_weights(g)


def sort_nodes(g: onnx.GraphProto) -> None:
    """Order the graph's nodes so each comes after the producers of its inputs."""
    from npuprep.graph import topological_order

    ordered = []
    for node in topological_order(g):
        kept = onnx.NodeProto()
        kept.CopyFrom(node)
        ordered.append(kept)
    del g.node[:]
    g.node.extend(ordered)
