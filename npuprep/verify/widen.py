"""Emulate an already-lowered model: `FP16 graph -> FP32 graph + Cast pairs where it stored FP16`.

A lowered (or naively converted) FP16 model run on onnxruntime's CPU provider is computed
partly in FP32 and hides overflow. Widening it to FP32 and rounding every tensor the model
declares in the low format reproduces what a target that honours those types computes.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, numpy_helper

from npuprep.graph import node_label, tensor_types, walk_graphs
from npuprep.numerics import NumberFormat
from npuprep.verify.emulate import Emulation, emulate


def emulate_lowered(model: onnx.ModelProto, fmt: NumberFormat, *, saturate: bool) -> Emulation:
    """Emulate a model whose tensors are typed in `fmt` (e.g. FP16) with explicit rounding.

    Nodes whose outputs the model keeps in FP32 are treated as pinned; every tensor it
    types in `fmt` is rounded (and overflows per `saturate`) after its producer.
    """
    types = tensor_types(model)
    low = fmt.onnx_type
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    high_nodes: set[str] = set()
    for scope in walk_graphs(wide.graph):
        g = scope.graph
        for init in g.initializer:
            if init.data_type == low:
                init.CopyFrom(numpy_helper.from_array(
                    numpy_helper.to_array(init).astype("float32"), init.name))
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            tt = vi.type.tensor_type
            if tt.elem_type == low:
                tt.elem_type = TensorProto.FLOAT
        for node in g.node:
            outs = [o for o in node.output if o]
            if outs and all(types.get(o) != low for o in outs):
                high_nodes.add(node_label(node))
            for attr in node.attribute:
                if node.op_type == "Cast" and attr.name == "to" and attr.i == low:
                    attr.i = TensorProto.FLOAT
                if node.op_type in ("Constant", "ConstantOfShape") and attr.name == "value" \
                        and attr.t.data_type == low:
                    attr.t.CopyFrom(numpy_helper.from_array(
                        numpy_helper.to_array(attr.t).astype("float32"), attr.t.name))
    return emulate(wide, fmt, saturate=saturate, pinned_nodes=high_nodes)
