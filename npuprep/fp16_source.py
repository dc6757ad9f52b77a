"""An FP16 model widened to FP32 as an 8-bit conversion's source: `y = Op(W:fp16) -> y = Op(W:fp32)`.

8-bit Q/DQ pairs quantise FP32 layers. A model exported in FP16 (`model.half()`, a hub's
`*_fp16.onnx`) approximates the FP32 model it came from; every FP16 value is exact in FP32,
so its initialisers, Constant values and type attributes are widened without loss and its
layers computed in FP32: the reference its 8-bit conversion is judged against and quantised
from. Its inputs and outputs keep their FP16 types (the interface the user deploys and feeds),
behind Casts: `x:fp16 -> Cast(FP32) -> ...` and `... -> Cast(FP16) -> y:fp16`. Tensor names
are kept; the working tensors added are named `<tensor>__fp32`.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.bf16 import TYPE_ATTRS
from npuprep.errors import NpuprepError
from npuprep.graph import infer_tensors, to_array, walk_graphs
from npuprep.model_io import Model

FP16 = TensorProto.FLOAT16
FLOAT = TensorProto.FLOAT
# A widened model must still serialise (onnxruntime reads it as bytes).
_MAX_BYTES = 2**31 - 2**26
# The FP32 twin of an FP16 graph input or output.
TWIN = "__fp32"


def eight_bit_source(model: Model) -> tuple[Model, str]:
    """What an 8-bit conversion (or its check) quantises: `model`, or its FP32 widening with
    a note saying so where it computes in FP16 (every command deciding 8-bit layers alike)."""
    if not computes_fp16(model.proto):
        return model, ""
    # Not named by the file's path (a stage would read that file's graph in its place); the
    # same fingerprint: statistics of the FP16 model name the same tensors.
    widened = Model(proto=widen_fp16(model.proto, model.path),
                    path=f"{model.path} (widened to FP32)", digest=model.digest)
    return widened, (f"{model.path} computes in FP16: widened to FP32 exactly (weights, "
                     "constants) as the 8-bit source and reference; its FP16 inputs and outputs "
                     "keep their types behind Casts")


def computes_fp16(model: onnx.ModelProto) -> bool:
    """Whether `model` computes in FP16 anywhere: a weight, Constant, type attribute or tensor
    (its interface aside: an FP32 model may take FP16 inputs or give FP16 outputs by Casts)."""
    interface = {v.name for v in (*model.graph.input, *model.graph.output)}
    if any(t == FP16 for name, t in infer_tensors(model).types.items() if name not in interface):
        return True
    for scope in walk_graphs(model.graph):
        g = scope.graph
        if any(i.data_type == FP16 for i in g.initializer):
            return True
        for node in g.node:
            if scope.is_main and node.op_type == "Cast" and node.output[0] in interface:
                continue
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == FP16:
                    return True
                if (attr.type == onnx.AttributeProto.INT and attr.i == FP16
                        and TYPE_ATTRS.get(node.op_type) == attr.name):
                    return True
    return False


def widen_fp16(model: onnx.ModelProto, path: str) -> onnx.ModelProto:
    """A copy of `model` computing in FP32 what it computes in FP16, its FP16 graph inputs
    and outputs kept behind Casts (module docstring); its FP16 weights held inline (external
    ones read from their anchored files: npuprep.model_io.anchored). `path` names the model
    in errors."""
    half = [t for t in onnx.external_data_helper._get_all_tensors(model) if t.data_type == FP16]
    if model.ByteSize() + 4 * sum(math.prod(t.dims) for t in half) > _MAX_BYTES:
        raise NpuprepError(f"{path}: the FP16 model's weights widened to FP32 would pass protobuf's "
                           "2 GiB (export it in FP32 with external weights)")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    main = out.graph
    inputs = {i.name for i in main.input}
    # Each FP16 graph input and output keeps its name and type; the graph computes on an FP32
    # twin named `<tensor>__fp32` (an output that is also an input passes through untouched).
    boundary = {vi.name for vi in (*main.input, *main.output)
                if vi.type.tensor_type.elem_type == FP16
                and not (vi.name in inputs and vi.name in {o.name for o in main.output})}
    twin = {name: f"{name}{TWIN}" for name in boundary}
    for scope in walk_graphs(main):
        g = scope.graph
        for init in g.initializer:
            if init.data_type == FP16:
                init.CopyFrom(_widened(init))
            if scope.is_main and init.name in twin:
                init.name = twin[init.name]
        for vi in (*g.value_info, *(() if scope.is_main else (*g.input, *g.output))):
            if vi.type.tensor_type.elem_type == FP16:
                vi.type.tensor_type.elem_type = FLOAT
        for node in g.node:
            _widen_attributes(node)
            node.input[:] = [twin.get(n, n) for n in node.input]
            node.output[:] = [twin.get(n, n) for n in node.output]
    kept = [vi for vi in main.value_info if vi.name not in twin]
    del main.value_info[:]
    main.value_info.extend(kept)
    casts_in = [_cast(name, twin[name], FLOAT) for name in twin if name in inputs]
    casts_out = [_cast(twin[name], name, FP16) for name in twin if name not in inputs]
    nodes = [*casts_in, *main.node, *casts_out]
    del main.node[:]
    main.node.extend(nodes)
    return out


def _cast(src: str, dst: str, to: int) -> onnx.NodeProto:
    return helper.make_node("Cast", [src], [dst], name=f"{dst}__cast", to=to)


def _widen_attributes(node: onnx.NodeProto) -> None:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == FP16:
            attr.t.CopyFrom(_widened(attr.t))
        elif (attr.type == onnx.AttributeProto.INT and attr.i == FP16
              and TYPE_ATTRS.get(node.op_type) == attr.name):
            attr.i = FLOAT


def _widened(tensor: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(to_array(tensor).astype(np.float32), tensor.name)
