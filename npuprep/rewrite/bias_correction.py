"""Bias correction: an 8-bit weight's rounding shifts the mean of each output channel by
E[x] . (W8 - W); the layer's bias absorbs minus that shift (Nagel et al. 2019, DFQ).

    y = x W + b  ->  y8 = x W8 + b',  b' = b - E[x] (W8 - W)

The rounding error of one output channel's weights does not average out when the input's
mean is far from zero (ReLU outputs, a depthwise conv's few taps): the whole output channel
moves. The correction needs the per-channel mean of the layer's input (one FP32 pass,
npuprep.calibrate.channels.channel_means) and a bias to change: a Conv's or Gemm's input 2,
or the constant of the one Add after a MatMul.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from npuprep.graph import attribute, constant_value, consumers, name_maker, node_label


@dataclass(frozen=True)
class BiasSlot:
    """Where a layer's bias enters: input `index` of node `node` (a label), the constant
    `tensor`; `mean_axis` is the layer input's channel axis the shift reads."""

    node: str
    index: int
    tensor: str
    mean_axis: int


def bias_slot(graph: onnx.GraphProto, layer: onnx.NodeProto,
              readers: Mapping[str, Sequence[onnx.NodeProto]] | None = None) -> BiasSlot | None:
    """The bias `layer` (a Conv, Gemm or MatMul with a constant weight) adds, if it has one
    that only it reads. `readers`: consumers(graph), where the caller asks for many layers of
    one graph (a scan of the graph each: MiniLM's trial models, 278 layers)."""
    if readers is None:
        readers = consumers(graph)

    def own(name: str) -> bool:
        return (constant_value(graph, name) is not None and len(readers.get(name, [])) == 1
                and constant_value(graph, name).ndim == 1)

    if layer.op_type == "Conv" and len(layer.input) > 2 and layer.input[2] and own(layer.input[2]):
        return BiasSlot(node_label(layer), 2, layer.input[2], 1)
    if (layer.op_type == "Gemm" and len(layer.input) > 2 and layer.input[2] and own(layer.input[2])
            and not attribute(layer, "transA", 0) and attribute(layer, "alpha", 1.0) == 1.0
            and attribute(layer, "beta", 1.0) == 1.0):
        return BiasSlot(node_label(layer), 2, layer.input[2], -1)
    if layer.op_type == "MatMul":
        after = readers.get(layer.output[0], [])
        if len(after) == 1 and after[0].op_type == "Add":
            add = after[0]
            index = 1 if add.input[0] == layer.output[0] else 0
            if add.input[index] != layer.output[0] and own(add.input[index]):
                return BiasSlot(node_label(add), index, add.input[index], -1)
    return None


def corrected_bias(layer: onnx.NodeProto, weight: np.ndarray, dequantised: np.ndarray,
                   bias: np.ndarray, mean: np.ndarray) -> np.ndarray | None:
    """`bias` minus the shift the 8-bit weight (`dequantised`, against `weight`) gives each
    output channel for an input of per-channel `mean`; None where the shapes do not fit."""
    shift = output_shift(layer, (dequantised - weight).astype(np.float64), mean)
    if shift is None or shift.shape != bias.shape:
        return None
    return (bias - shift).astype(np.float32)


def output_shift(layer: onnx.NodeProto, weight: np.ndarray, mean: np.ndarray) -> np.ndarray | None:
    """What `layer` (a Conv, Gemm or MatMul) with `weight` adds to each output channel for an
    input of per-channel `mean` (a Conv's whole kernel window); None where the shapes do not
    fit."""
    if layer.op_type == "Conv":
        groups = int(attribute(layer, "group", 1))
        out, per_group = weight.shape[0], weight.shape[1]
        if mean.shape != (groups * per_group,) or out % groups:
            return None
        taps = weight.reshape(out, per_group, -1).sum(axis=2)  # [O, C/group]
        group_of = np.arange(out) // (out // groups)
        return (taps * mean.reshape(groups, per_group)[group_of]).sum(axis=1)
    if layer.op_type == "Gemm" and attribute(layer, "transB", 0):
        return weight @ mean if weight.shape[1:] == mean.shape else None
    return mean @ weight if weight.ndim == 2 and weight.shape[:1] == mean.shape else None


def with_biases(model: onnx.ModelProto,
                corrected: Sequence[tuple[BiasSlot, np.ndarray]]) -> onnx.ModelProto:
    """`model` (a copy) whose bias slots read the `corrected` values (new initialisers; the
    old ones leave the file once nothing reads them)."""
    if not corrected:
        return model
    from npuprep.rewrite.qdq import drop_unused_weights

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    fresh = name_maker(g)
    by_label = {node_label(n): n for n in g.node}
    for slot, value in corrected:
        node = by_label.get(slot.node)
        if node is None or node.input[slot.index] != slot.tensor:
            continue
        name = fresh(f"{slot.tensor}_corrected")
        g.initializer.append(numpy_helper.from_array(value.astype(np.float32), name))
        node.input[slot.index] = name
    drop_unused_weights(g)
    return out
