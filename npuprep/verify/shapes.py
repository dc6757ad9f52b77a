"""Element types and static shapes of every tensor, inferred on a weightless skeleton.

onnx's shape inference serialises the whole model; for a model of hundreds of MB that
costs seconds. Large float initialisers become typed graph inputs of the same shape in a
skeleton copy, so inference sees the same types and shapes without the weights; small
initialisers (shape tensors, axes) keep their values for data-dependent shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from npuprep.graph import walk_graphs

# Initialisers up to this many bytes keep their values (Reshape shapes, axes, scalars).
KEEP_BYTES = 4096


@dataclass(frozen=True)
class TensorInfo:
    """Tensor name -> ONNX element type, and -> shape where every dimension is known."""

    types: dict[str, int]
    shapes: dict[str, tuple[int, ...]]


def infer(model: onnx.ModelProto) -> TensorInfo:
    """Types and static shapes of every tensor in all scopes (best effort, never raises)."""
    skeleton = onnx.ModelProto()
    _copy_without_weights(model, skeleton)
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton, strict_mode=False, data_prop=False)
    except Exception:  # noqa: BLE001 - inference is best effort on exotic models
        inferred = skeleton
    types: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for scope in walk_graphs(inferred.graph):
        g = scope.graph
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if not vi.type.HasField("tensor_type"):
                continue
            tt = vi.type.tensor_type
            types[vi.name] = tt.elem_type
            if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
                shapes[vi.name] = tuple(d.dim_value for d in tt.shape.dim)
        for init in g.initializer:
            types[init.name] = init.data_type
            shapes[init.name] = tuple(init.dims)
        for node in g.node:
            if node.op_type == "Constant":
                for attr in node.attribute:
                    if attr.name == "value":
                        types[node.output[0]] = attr.t.data_type
    return TensorInfo(types, shapes)


def _copy_without_weights(model: onnx.ModelProto, out: onnx.ModelProto) -> None:
    for field in ("ir_version", "producer_name", "domain", "model_version"):
        setattr(out, field, getattr(model, field))
    out.opset_import.extend(model.opset_import)
    out.functions.extend(model.functions)
    g, src = out.graph, model.graph
    g.name = src.name
    g.node.extend(src.node)
    g.output.extend(src.output)
    g.value_info.extend(src.value_info)
    declared = {vi.name for vi in src.input}
    g.input.extend(src.input)
    for init in src.initializer:
        if init.ByteSize() <= KEEP_BYTES:
            g.initializer.append(init)
        elif init.name not in declared:
            g.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
