"""BF16 widened to FP32 exactly for onnxruntime: `y:bf16 = Op(..) -> y = Cast32(CastBF16(Op(..)))`.

onnxruntime's CPU provider has BF16 kernels for few ops, and a BF16 array cannot become an
OrtValue through numpy. Every BF16 value is exactly representable in FP32 (same exponent
range, shorter mantissa), so initialisers, Constant values and graph I/O are widened
without loss, and every tensor the model computes in BF16 is rounded to BF16 and back
right after its producer, so the widened graph computes what the BF16 graph would store.
Tensor names are kept; the working tensors added are named `<tensor>__bf16w` and
`<tensor>__bf16r`.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.graph import copy_fields, infer_tensors, is_anchored, to_array, walk_graphs

BF16 = TensorProto.BFLOAT16
FLOAT = TensorProto.FLOAT
# Attributes that declare a node's output type.
TYPE_ATTRS = {"Cast": "to", "EyeLike": "dtype", "RandomNormal": "dtype", "RandomUniform": "dtype",
               "RandomNormalLike": "dtype", "RandomUniformLike": "dtype", "Multinomial": "dtype"}


ROUND_SUFFIX = "__bf16_round"


def has_bf16(model: onnx.ModelProto) -> bool:
    """Whether any initialiser, Constant, Cast target or declared tensor of `model` is BF16
    (the rounding Casts widen_bf16 adds, which onnxruntime runs, do not count)."""
    for scope in walk_graphs(model.graph):
        g = scope.graph
        if any(i.data_type == BF16 for i in g.initializer):
            return True
        if any(vi.type.tensor_type.elem_type == BF16 for vi in (*g.input, *g.output, *g.value_info)):
            return True
        for node in g.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == BF16:
                    return True
                if attr.type == onnx.AttributeProto.INT and attr.i == BF16 \
                        and TYPE_ATTRS.get(node.op_type) == attr.name \
                        and not node.name.endswith(ROUND_SUFFIX):
                    return True
    return False


def widen_bf16(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with no BF16 type anywhere that computes the same values (see module
    docstring). Main-graph initialisers that are not BF16 are shared, not copied."""
    types = infer_tensors(model).types
    out = onnx.ModelProto()
    copy_fields(model, out, skip="graph")
    copy_fields(model.graph, out.graph, skip="initializer")
    for init in model.graph.initializer:
        if init.data_type == BF16:
            out.graph.initializer.append(_widened_tensor(init))
        else:
            out.graph.initializer.append(init)
    for scope in walk_graphs(out.graph):
        g = scope.graph
        if not scope.is_main:
            for init in g.initializer:
                if init.data_type == BF16:
                    init.CopyFrom(_widened_tensor(init))
        for vi in (*g.input, *g.output, *g.value_info):
            if vi.type.tensor_type.elem_type == BF16:
                vi.type.tensor_type.elem_type = FLOAT
        nodes: list[onnx.NodeProto] = []
        for node in g.node:
            nodes.append(node)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == BF16:
                    attr.t.CopyFrom(_widened_tensor(attr.t))
                elif attr.type == onnx.AttributeProto.INT and attr.i == BF16 \
                        and TYPE_ATTRS.get(node.op_type) == attr.name:
                    attr.i = FLOAT
            if node.op_type in ("Constant", "ConstantOfShape"):
                continue  # its value is exact in FP32 already
            for i, name in enumerate(node.output):
                if name and types.get(name) == BF16:
                    wide = f"{name}__bf16w"
                    node.output[i] = wide
                    nodes.append(helper.make_node("Cast", [wide], [f"{name}__bf16r"],
                                                  name=f"{name}{ROUND_SUFFIX}", to=BF16))
                    nodes.append(helper.make_node("Cast", [f"{name}__bf16r"], [name],
                                                  name=f"{name}__bf16_widen", to=FLOAT))
        del g.node[:]
        g.node.extend(nodes)
    return out


def widen_array(value: np.ndarray) -> np.ndarray:
    """A BF16 array as FP32 (exact); any other array unchanged."""
    return value.astype(np.float32) if value.dtype == ml_dtypes.bfloat16 else value


def _widened_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    if tensor.data_location == TensorProto.EXTERNAL and not is_anchored(tensor):
        # A placeholder whose values reach onnxruntime as an array (widened by the caller).
        out = onnx.TensorProto()
        out.CopyFrom(tensor)
        out.data_type = FLOAT
        for entry in out.external_data:
            if entry.key == "length":
                entry.value = str(2 * int(entry.value))
        return out
    return numpy_helper.from_array(to_array(tensor).astype(np.float32), tensor.name)
