"""The lowered model written so that onnxruntime's default session (every fusion and layout
pass on, as users load it) takes it: the patterns it refuses, each rewritten exactly.

A norm's square as `Mul(x, x)`, not `Pow(x, 2)`: onnxruntime's LayerNormFusion matches the
decomposed norm `ReduceMean, Sub, Pow 2, ReduceMean, Add, Sqrt, Div` through the Cast that
widens an FP16 tensor into a norm kept FP32, and fuses it into one LayerNormalization with an
FP16 input and FP32 weights, which it then refuses to load ("bound to different types",
1.32). A `Mul` is not its pattern; `x * x` is one rounding of the exact square, as `Pow(x, 2)`.
Only Pows of a constant 2 (one element, at most one axis, so the shape is unchanged) that
feed a `ReduceMean` (the variance of a norm) are rewritten; node and tensor names are kept.
"""

from __future__ import annotations

import onnx
from onnx import numpy_helper


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

