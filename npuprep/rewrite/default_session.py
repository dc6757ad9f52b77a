"""The lowered model written so that onnxruntime's default session (every fusion and layout
pass on, as users load it) takes it: the patterns it refuses, each rewritten exactly.

A norm's square as `Mul(x, x)`, not `Pow(x, 2)`: onnxruntime's LayerNormFusion matches the
decomposed norm `ReduceMean, Sub, Pow 2, ReduceMean, Add, Sqrt, Div` through the Cast that
widens an FP16 tensor into a norm kept FP32, and fuses it into one LayerNormalization with an
FP16 input and FP32 weights, which it then refuses to load ("bound to different types",
1.32). A `Mul` is not its pattern; `x * x` is one rounding of the exact square, as `Pow(x, 2)`.
Only Pows of a constant 2 (one element, at most one axis, so the shape is unchanged) that
feed a `ReduceMean` (the variance of a norm) are rewritten; node and tensor names are kept.

An FP16 Transpose that a MatMul reads, moved between Casts (FP16 -> FP32, Transpose, FP32 ->
FP16): onnxruntime's default session crashes (SIGSEGV, 1.32, its NCHWc layout pass) loading an
FP16 `Transpose(perm=[1, 0, 2])` before a MatMul with a constant weight, as a speech model's
GRU output turned time-major before its dense layers. A transpose moves values, so the same
FP16 values reach the MatMul; the Transpose keeps its name, its output keeps its name.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.graph import tensor_types


def squares_as_products(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of `model` with each norm's `Pow(x, 2)` as `Mul(x, x)`, and the nodes rewritten."""
    graph = model.graph
    constants = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = node.attribute[0].t
    readers: dict[str, list[str]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.op_type)
    squares = [i for i, n in enumerate(graph.node)
               if n.op_type == "Pow" and len(n.input) == 2 and _is_two(constants.get(n.input[1]))
               and "ReduceMean" in readers.get(n.output[0], [])]
    if not squares:
        return model, []
    out = onnx.ModelProto()
    out.CopyFrom(model)
    rewritten = []
    for i in squares:
        node = out.graph.node[i]
        node.op_type = "Mul"
        node.input[1] = node.input[0]
        rewritten.append(node.name or node.output[0])
    # An exponent nothing reads any more would only draw onnxruntime's "removing" warning.
    used = ({name for n in out.graph.node for name in n.input} | {o.name for o in out.graph.output}
            | {i.name for i in out.graph.input})
    kept = [t for t in out.graph.initializer if t.name in used]
    if len(kept) != len(out.graph.initializer):
        del out.graph.initializer[:]
        out.graph.initializer.extend(kept)
    return out, rewritten


def _is_two(tensor: onnx.TensorProto | None) -> bool:
    if tensor is None or len(tensor.dims) > 1 or tensor.data_location == onnx.TensorProto.EXTERNAL:
        return False
    value = numpy_helper.to_array(tensor)
    return value.size == 1 and float(value.reshape(-1)[0]) == 2.0



def transposes_in_fp32(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of `model` with each FP16 Transpose that a MatMul reads computed in FP32 between
    two Casts, and the Transposes moved (main graph)."""
    graph = model.graph
    readers: dict[str, set[str]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type)
    types = tensor_types(model)
    moved = [i for i, n in enumerate(graph.node)
             if n.op_type == "Transpose" and types.get(n.input[0]) == TensorProto.FLOAT16
             and "MatMul" in readers.get(n.output[0], set())]
    if not moved:
        return model, []
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = [onnx.NodeProto() for _ in graph.node]
    for copy, node in zip(nodes, graph.node, strict=True):
        copy.CopyFrom(node)
    for i in reversed(moved):  # from the back, so the earlier indices still hold
        node = nodes[i]
        label = node.name or node.output[0]
        wide_in, wide_out = f"{label}.fp32_input", f"{label}.fp32_output"
        widen = helper.make_node("Cast", [node.input[0]], [wide_in], name=f"{label}.to_fp32",
                                 to=TensorProto.FLOAT)
        narrow = helper.make_node("Cast", [wide_out], [node.output[0]], name=f"{label}.to_fp16",
                                  to=TensorProto.FLOAT16)
        node.input[0], node.output[0] = wide_in, wide_out
        nodes[i:i + 1] = [widen, node, narrow]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out, [graph.node[i].name or graph.node[i].output[0] for i in moved]
