"""Outlier channels into the weights: `MatMul(x, W)` -> `MatMul(Mul(x, 1/s), diag(s) W)`,
and `Conv(x, W)` -> `Conv(Mul(x, 1/s), W * s)` along W's input channels.

A few channels of a LayerNorm or GELU output reach 10-30x the others; one INT8 scale per
tensor then leaves the ordinary channels a handful of levels. Dividing each input channel
by s_j = max|x_j|^alpha / max|W_j|^(1 - alpha) and multiplying the weight's input channel j
by it (SmoothQuant, Xiao et al. 2023: alpha = 0.5; alpha = 1 gives every channel of x the
same range) leaves the product exact in FP32 and balances the two ranges; the weight keeps
its own per-channel INT8 scales. The Mul is an elementwise op a compiler folds into the
producer's affine (a LayerNorm's gamma) or into the producer's requantisation (a Conv's
SiLU output, which cross-layer equalisation cannot pass: npuprep.rewrite.equalise).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npuprep.graph import constant_value, name_maker, node_label
from npuprep.rewrite.result import RewriteResult


def smoothable(graph: onnx.GraphProto, node: onnx.NodeProto) -> bool:
    """A MatMul whose input 1 is a constant 2-D FP32 weight (rows = x's last axis), or an
    ungrouped Conv with a constant 4-D FP32 weight (input channels = x's axis 1)."""
    if node.op_type not in ("MatMul", "Conv") or len(node.input) < 2:
        return False
    w = constant_value(graph, node.input[1])
    if w is None or w.dtype != np.float32:
        return False
    if node.op_type == "MatMul":
        return w.ndim == 2
    group = next((a.i for a in node.attribute if a.name == "group"), 1)
    return w.ndim == 4 and group == 1


def channel_axis(node: onnx.NodeProto) -> int:
    """The axis of a smoothable node's input 0 that its weight's input channels read."""
    return 1 if node.op_type == "Conv" else -1


def input_channel_absmax(node: onnx.NodeProto, w: np.ndarray) -> np.ndarray:
    """max |W| per input channel of a smoothable node's weight."""
    return np.abs(w).max(axis=(0, 2, 3)) if node.op_type == "Conv" else np.abs(w).max(axis=1)


def smoothing_factors(x_absmax: np.ndarray, w_absmax: Sequence[np.ndarray],
                      alpha: float = 0.5) -> np.ndarray:
    """s per channel of x from its abs-max and the per-input-channel abs-max of every weight
    that reads it (input_channel_absmax)."""
    w_top = np.max(w_absmax, axis=0)
    s = np.maximum(x_absmax, 1e-12) ** alpha / np.maximum(w_top, 1e-12) ** (1.0 - alpha)
    # Channels that are all zero in x or in W stay as they are.
    return np.where((x_absmax > 0) & (w_top > 0), s, 1.0).astype(np.float32)


def smooth(model: onnx.ModelProto, factors: Mapping[str, np.ndarray],
           readers: Mapping[str, Sequence[str]], *,
           place: Callable[[np.ndarray, str], onnx.TensorProto] | None = None) -> RewriteResult:
    """Divide tensor x (`factors`: x -> s) by s before the MatMuls `readers[x]` (labels),
    whose weight rows are multiplied by s (a new initialiser each, made by `place`: inline
    by default, a large model's scratch file in convert). The new tensors are named in
    details["smoothed"] (x -> x / s)."""
    place = place or numpy_helper.from_array
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    by_label = {node_label(n): n for n in g.node}
    fresh = name_maker(g)

    smoothed: dict[str, str] = {}
    added: list[onnx.NodeProto] = []
    for x, s in factors.items():
        nodes = [by_label[r] for r in readers.get(x, ()) if r in by_label]
        if not nodes or np.all(s == 1.0):
            continue
        conv = nodes[0].op_type == "Conv"
        inv = fresh(f"{x}_smooth_inv")
        # A Conv's x is N x C x H x W: 1/s broadcasts along C as C x 1 x 1.
        per_channel = (1.0 / s).reshape((-1, 1, 1) if conv else (-1,))
        g.initializer.append(numpy_helper.from_array(per_channel.astype(np.float32), inv))
        xs = fresh(f"{x}_smoothed")
        added.append(helper.make_node("Mul", [x, inv], [xs], name=fresh(f"{x}_Smooth")))
        for node in nodes:
            w = constant_value(g, node.input[1])
            scaled = fresh(f"{node.input[1]}_smoothed")
            grown = w * s[None, :, None, None] if conv else s[:, None] * w
            g.initializer.append(place(grown.astype(np.float32), scaled))
            node.input[0], node.input[1] = xs, scaled
        smoothed[x] = xs
    if not smoothed:
        return RewriteResult(model, False, "no MatMul or Conv input had channels to balance")
    from npuprep.rewrite.qdq import drop_unused_weights, sort_nodes

    g.node.extend(added)
    sort_nodes(g)
    drop_unused_weights(g)
    return RewriteResult(out, True, f"{len(smoothed)} input(s) balanced into their weights",
                         {"smoothed": smoothed})
