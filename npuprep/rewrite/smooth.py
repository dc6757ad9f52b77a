"""Outlier channels into the weights: `MatMul(x, W)` -> `MatMul(Mul(x, 1/s), diag(s) W)`.

A few channels of a LayerNorm or GELU output reach 10-30x the others; one INT8 scale per
tensor then leaves the ordinary channels a handful of levels. Dividing each input channel
by s_j = sqrt(max|x_j| / max|W_j|) and multiplying the weight's row j by it (SmoothQuant,
Xiao et al. 2023, alpha = 0.5) leaves the product exact in FP32 and balances the two ranges;
the weight keeps its own per-channel INT8 scales. The Mul is an elementwise op a compiler
folds into the producer's affine (a LayerNorm's gamma).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npuprep.graph import constant_value, name_maker, node_label
from npuprep.rewrite.result import RewriteResult


def smoothable(graph: onnx.GraphProto, node: onnx.NodeProto) -> bool:
    """A MatMul whose input 1 is a constant 2-D FP32 weight (rows = x's last axis)."""
    if node.op_type != "MatMul" or len(node.input) < 2:
        return False
    w = constant_value(graph, node.input[1])
    return w is not None and w.ndim == 2 and w.dtype == np.float32


def smoothing_factors(x_absmax: np.ndarray, weights: Sequence[np.ndarray]) -> np.ndarray:
    """s per channel of x from its abs-max and the rows of every weight that reads it."""
    w_absmax = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
    s = np.sqrt(np.maximum(x_absmax, 1e-12) / np.maximum(w_absmax, 1e-12))
    # Channels that are all zero in x or in W stay as they are.
    return np.where((x_absmax > 0) & (w_absmax > 0), s, 1.0).astype(np.float32)


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
        inv = fresh(f"{x}_smooth_inv")
        g.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), inv))
        xs = fresh(f"{x}_smoothed")
        added.append(helper.make_node("Mul", [x, inv], [xs], name=fresh(f"{x}_Smooth")))
        for node in nodes:
            w = constant_value(g, node.input[1])
            scaled = fresh(f"{node.input[1]}_smoothed")
            g.initializer.append(place((s[:, None] * w).astype(np.float32), scaled))
            node.input[0], node.input[1] = xs, scaled
        smoothed[x] = xs
    if not smoothed:
        return RewriteResult(model, False, "no MatMul input had channels to balance")
    from npuprep.rewrite.qdq import drop_unused_weights, sort_nodes

    g.node.extend(added)
    sort_nodes(g)
    drop_unused_weights(g)
    return RewriteResult(out, True, f"{len(smoothed)} MatMul input(s) balanced into their weights",
                         {"smoothed": smoothed})
