"""Skewed channels centred: `Conv(x, W, b)` -> `Conv(x - c, W, b + W.c)` per input channel c,
and `MatMul(x, W) + b` -> `MatMul(x - c, W) + (b + c W)`.

A PReLU's or GELU's output reaches far above zero and a little below it, each channel about
its own centre; symmetric INT8 (a target without zero points) spends the levels of
[-max, max] on it. Subtracting each channel's centre (Outlier Suppression+, Wei et al. 2023:
the channel-wise shift) leaves ranges symmetric about zero; the layer's sum over its input
channels takes the shift back as a constant in its bias, exact where every output sums the
whole kernel over real inputs: a MatMul, or a Conv without padding (a padded border would
sum the shifted zeros). The shift is one Add over the tensor, run in the wider format; an 8-bit
layer reading it has its bias corrected for its 8-bit weight (centred_bias).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npuprep.graph import attribute, constant_value, consumers, name_maker, node_label
from npuprep.rewrite.bias_correction import BiasSlot, bias_slot, corrected_bias, output_shift
from npuprep.rewrite.result import RewriteResult
from npuprep.rewrite.smooth import smoothable


def shiftable(graph: onnx.GraphProto, node: onnx.NodeProto) -> bool:
    """A layer whose input channels balance into its weight (npuprep.rewrite.smooth) and that
    sums every input it reads: a MatMul, or a Conv without padding. Its output is exact with
    x - c and the bias raised by the weight's sum over c."""
    if not smoothable(graph, node):
        return False
    auto_pad = attribute(node, "auto_pad", b"NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    return node.op_type == "MatMul" or (auto_pad in ("NOTSET", "VALID")
                                         and not any(attribute(node, "pads", [])))


def centred_bias(graph: onnx.GraphProto, node: onnx.NodeProto, dequantised: np.ndarray,
                 mean: np.ndarray) -> tuple[BiasSlot, np.ndarray] | None:
    """The bias of `node`, which reads x - c (its bias b + W.c) and whose weight runs as
    `dequantised` (W8), for an input of per-channel `mean` (E[x - c]): b + W.c - (W8 - W).mean,
    so the layer errs by (W8 - W).(x - c - mean), about zero. With b + W.c alone it errs by
    (W8 - W).(x - c), whose mean moves every output channel where c is far from E[x] (a
    channel's midpoint, its values crowded near the bottom: MTCNN's PNet, outputs' rel L2
    0.017 -> 0.105 with one layer's weight in INT8); with b + W8.c, by (W8 - W).x, where E[x]
    is far from zero."""
    slot = bias_slot(graph, node)
    weight = constant_value(graph, node.input[1])
    if slot is None or weight is None:
        return None
    bias = constant_value(graph, slot.tensor)
    fixed = None if bias is None else corrected_bias(node, weight, dequantised, bias, mean)
    return None if fixed is None else (slot, fixed)


def shift(model: onnx.ModelProto, centres: Mapping[str, np.ndarray],
          readers: Mapping[str, Sequence[str]]) -> RewriteResult:
    """Tensor x (`centres`: x -> c per channel: a Conv's axis 1, a MatMul's last) read as
    x - c by the layers `readers[x]` (labels, each shiftable), each taking W.c back in its
    bias: a Conv's bias input, a MatMul's following Add of a constant (an Add inserted where
    it has none). details["centred"]: x -> the tensor the readers now read;
    details["changed"]: the new tensors; details["centres"]: each reader -> its c."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    by_label = {node_label(n): n for n in g.node}
    read = consumers(g)
    graph_outputs = {o.name for o in g.output}
    fresh = name_maker(g)
    centred: dict[str, str] = {}
    by_reader: dict[str, np.ndarray] = {}
    added: list[onnx.NodeProto] = []
    for x, c in centres.items():
        nodes = [by_label[r] for r in readers.get(x, ()) if r in by_label]
        if not nodes or not np.any(c):
            continue
        shape = c.reshape(-1, *[1] * (constant_value(g, nodes[0].input[1]).ndim - 2)) \
            if nodes[0].op_type == "Conv" else c
        minus = fresh(f"{x}_centre")
        g.initializer.append(numpy_helper.from_array((-shape).astype(np.float32), minus))
        xc = fresh(f"{x}_centred")
        added.append(helper.make_node("Add", [x, minus], [xc], name=fresh(f"{x}_Centre")))
        for node in nodes:
            w = constant_value(g, node.input[1])
            assert w is not None, node_label(node)
            back = output_shift(node, w.astype(np.float64), c.astype(np.float64))
            assert back is not None, node_label(node)
            back = back.astype(np.float32)
            by_reader[node_label(node)] = c.astype(np.float32)
            node.input[0] = xc
            if node.op_type == "Conv":
                bias = constant_value(g, node.input[2]) if len(node.input) > 2 and node.input[2] \
                    else np.zeros(w.shape[0], np.float32)
                assert bias is not None, node_label(node)
                name = fresh(f"{node_label(node)}_bias_centred")
                g.initializer.append(numpy_helper.from_array((bias + back).astype(np.float32),
                                                             name))
                if len(node.input) > 2:
                    node.input[2] = name
                else:
                    node.input.append(name)
                continue
            y = node.output[0]
            after = read.get(y, [])
            add = after[0] if len(after) == 1 and y not in graph_outputs else None
            bias = None
            if add is not None and add.op_type == "Add" and len(add.input) == 2:
                k = 1 if add.input[0] == y else 0
                bias = constant_value(g, add.input[k])
            if bias is not None and bias.dtype == np.float32 and bias.size == back.size:
                name = fresh(f"{add.input[k]}_centred")
                g.initializer.append(numpy_helper.from_array(
                    (bias + back.reshape(bias.shape)).astype(np.float32), name))
                add.input[k] = name
            else:
                # No bias to take it: the MatMul writes a new tensor and an Add restores y.
                name = fresh(f"{node_label(node)}_centred_back")
                g.initializer.append(numpy_helper.from_array(back, name))
                raw = fresh(f"{y}_uncentred")
                node.output[0] = raw
                added.append(helper.make_node("Add", [raw, name], [y],
                                              name=fresh(f"{node_label(node)}_CentreBack")))
        centred[x] = xc
    if not centred:
        return RewriteResult(model, False, "no layer input had channels off centre to shift")
    from npuprep.rewrite.qdq import settle

    settle(g, added)
    return RewriteResult(out, True, f"{len(centred)} layer input(s) centred per channel",
                         {"centred": centred, "changed": list(centred.values()),
                          "centres": by_reader})
