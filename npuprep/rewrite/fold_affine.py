"""An affine after a convolution is part of its weights: `Conv(x, W, b) -> Mul(s) -> Add(c)` -> `Conv(x, s*W, s*b + c)`.

Exporters write a BatchNormalization, or a per-channel or scalar scale and shift (paddle2onnx's
re-parameterised MobileOne blocks, a "learnable affine"), as nodes after the Conv. Each stores
its output once more: in FP16 that is one more rounding per layer, and PP-OCR's recogniser
has two of them after most of its 38 convolutions. A compiler folds them into the Conv
(TensorRT, rknn-toolkit2, onnxruntime's ConvBNFusion/ConvMulFusion), so the folded graph is
also what the board runs. Exact up to FP32 rounding of the folded parameters; the Conv keeps
its name and takes the last folded node's output tensor, so plans and statistics find it.

A fold is declined when the target would store the folded parameters worse than the
originals: a BatchNormalization over a near-constant channel (variance ~1e-10) multiplies its
Conv's weights by 1e5, one with small gammas can push them subnormal.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from npuprep.analyse.initialisers import UNDERFLOW_MASS, summarise
from npuprep.numerics import NumberFormat
from npuprep.rewrite import graph_ops as go
from npuprep.rewrite.result import RewriteResult, sites_result

# The elementwise ops an affine is written with; Sub and Div only with the Conv's output first.
AFFINE_OPS = ("Mul", "Add", "Sub", "Div", "BatchNormalization")


def fold_affines(model: onnx.ModelProto, fmt: NumberFormat | None = None, *,
                 largest: float = math.inf) -> RewriteResult:
    """Fold every chain of per-channel scales and shifts that follows a main-graph Conv with
    constant weights into those weights.

    A fold is declined when a folded weight or bias would exceed `largest`, or when a visible
    share of the folded weights would land below `fmt`'s smallest normal number (the target
    format; the analyser's init.underflow test) where the unfolded ones did not.
    A chain that cannot fold but holds a BatchNormalization (or more than a scale and a
    shift) becomes one per-channel Mul and Add: FP16 then stores the scale, not a variance
    of 1e7 that overflows it.
    details: "replaced" {conv: what was done}, "partial" {conv: how} for those left as one Mul
    and Add, "declined" {conv: why}.
    """
    if not any(n.op_type == "Conv" for n in model.graph.node):
        return RewriteResult(model, False, "no Conv", {"replaced": {}, "declined": {}})
    graph = go.import_graph(model)
    replaced: dict[str, str] = {}
    declined: dict[str, str] = {}
    partial: dict[str, str] = {}  # replaced, but by one Mul and Add instead of a fold
    for conv in [n for n in graph.nodes if n.op == "Conv"]:
        label = go.node_label(conv)
        chain, scale, shift, why = _affine_chain(graph, conv)
        if not chain:
            if why:
                declined[label] = why
            continue
        weights = go.const_value(conv.inputs[1])
        bias = go.const_value(conv.inputs[2]) if len(conv.inputs) > 2 else None
        if weights is None or weights.dtype != np.float32 or (
                bias is not None and bias.dtype != np.float32):
            declined[label] = "its weights or bias are not FP32 constants"
            continue
        channels = weights.shape[0]
        scale = np.broadcast_to(scale, (channels,)).astype(np.float64)
        shift = np.broadcast_to(shift, (channels,)).astype(np.float64)
        new_w = (weights.astype(np.float64) * scale.reshape((-1,) + (1,) * (weights.ndim - 1)))
        base = bias.astype(np.float64) if bias is not None else np.zeros(channels)
        new_b = base * scale + shift
        why = _stores_worse(weights, new_w, new_b, fmt, largest)
        names = ", ".join(f"{n.op} {go.node_label(n)}" for n in chain)
        if why and (len(chain) > 2 or any(n.op == "BatchNormalization" for n in chain)):
            # Still one scale and one shift, and no variance left to overflow FP16.
            _as_one_affine(graph, conv, chain, scale, shift, weights.ndim)
            replaced[label] = partial[label] = (f"{names} as one Mul and Add after it (not folded: "
                                                f"{why}){_variance_note(chain, fmt)}")
            continue
        if why:
            declined[label] = f"folding {names}: {why}"
            continue
        w_name = go.unique_name(graph, f"{conv.inputs[1].name}.folded")
        b_name = go.unique_name(graph, f"{label}.bias.folded")
        conv.inputs[1] = gs.Constant(w_name, new_w.astype(np.float32))
        folded_bias = gs.Constant(b_name, new_b.astype(np.float32))
        if len(conv.inputs) > 2:
            conv.inputs[2] = folded_bias
        else:
            conv.inputs.append(folded_bias)
        last = chain[-1].outputs[0]
        for node in chain:
            node.outputs.clear()
        conv.outputs[0] = last
        replaced[label] = f"{names} folded into its weights and bias"
    result = sites_result(model, lambda: go.finish(graph, model), replaced, declined,
                          nothing="no scale or shift after a Conv",
                          done=f"{len(replaced) - len(partial)} Conv(s) took the scale and shift "
                               f"after them")
    return replace(result, details={**result.details, "partial": partial})


def _variance_note(chain: list[gs.Node], fmt: NumberFormat | None) -> str:
    """Why replacing a BatchNormalization matters even unfolded: its variance beyond `fmt`."""
    if fmt is None:
        return ""
    variances = [go.const_value(n.inputs[4]) for n in chain if n.op == "BatchNormalization"]
    top = max((float(np.abs(v).max()) for v in variances if v is not None and v.size), default=0.0)
    if top <= fmt.max:
        return ""
    return (f"; its variance reaches {top:.3g}, beyond {fmt.name}'s max {fmt.max:.6g}: the "
            "scale is stored instead")


def _as_one_affine(graph: gs.Graph, conv: gs.Node, chain: list[gs.Node], scale: np.ndarray,
                   shift: np.ndarray, rank: int) -> None:
    """Replace `chain` by `Mul(conv, scale) -> Add(shift)` (per channel of an output of
    `rank` dims), writing its last tensor."""
    label = go.node_label(chain[0])
    shape = (1, -1) + (1,) * (rank - 2)
    last = chain[-1].outputs[0]
    for node in chain:
        node.outputs.clear()
    scaled = gs.Variable(go.unique_name(graph, f"{last.name}.scaled"), dtype=last.dtype)
    graph.nodes.append(gs.Node("Mul", go.unique_name(graph, f"{label}.scale"), inputs=[
        conv.outputs[0], gs.Constant(go.unique_name(graph, f"{label}.scale_value"),
                                     scale.astype(np.float32).reshape(shape))], outputs=[scaled]))
    graph.nodes.append(gs.Node("Add", go.unique_name(graph, f"{label}.shift"), inputs=[
        scaled, gs.Constant(go.unique_name(graph, f"{label}.shift_value"),
                            shift.astype(np.float32).reshape(shape))], outputs=[last]))


def _affine_chain(graph: gs.Graph, conv: gs.Node) -> tuple[list[gs.Node], np.ndarray, np.ndarray, str]:
    """The foldable nodes after `conv` with their combined per-channel scale and shift
    (y = scale * conv + shift), or an empty chain and why the affine after it cannot fold."""
    weights = go.const_value(conv.inputs[1]) if len(conv.inputs) > 1 else None
    channels = weights.shape[0] if weights is not None and weights.ndim > 1 else 0
    rank = weights.ndim if weights is not None else 0
    chain: list[gs.Node] = []
    scale, shift = np.ones(max(channels, 1)), np.zeros(max(channels, 1))
    tensor = conv.outputs[0]
    while True:
        reader = go.sole_reader(graph, tensor)
        if reader is None:
            break
        step = _affine_step(reader, tensor, channels, rank)
        if step is None:
            break
        if not channels:
            return [], scale, shift, "its weights are not constant"
        if isinstance(step, str):
            return chain, scale, shift, "" if chain else step
        a, c = step
        scale, shift = scale * a, shift * a + c
        chain.append(reader)
        tensor = reader.outputs[0]
    return chain, scale, shift, ""


def _affine_step(node: gs.Node, tensor: gs.Tensor, channels: int,
                 rank: int) -> tuple[np.ndarray, np.ndarray] | str | None:
    """`node` as y = a * tensor + c with per-channel a and c; why it cannot fold; or None
    when it is no affine (another op, or an operand that is not constant: a residual)."""
    label = f"{node.op} {go.node_label(node)}"
    if node.op not in AFFINE_OPS:
        return None
    if node.op == "BatchNormalization":
        if len(node.outputs) > 1 or node.attrs.get("training_mode", 0):
            return f"{label} is in training mode"
        params = [go.const_value(t) for t in node.inputs[1:5]]
        if any(p is None for p in params):
            return f"{label} has parameters that are not constant"
        gamma, beta, mean, var = (np.asarray(p, np.float64).reshape(-1) for p in params)
        if any(p.size != channels for p in (gamma, beta, mean, var)):
            return f"{label}'s parameters do not hold one value per channel ({channels})"
        inv = gamma / np.sqrt(var + float(node.attrs.get("epsilon", 1e-5)))
        return inv, beta - mean * inv
    pos = next(i for i, t in enumerate(node.inputs) if t is tensor)
    if node.op in ("Sub", "Div") and pos != 0:
        return f"{label} takes the Conv's output as its second operand"
    other = go.const_value(node.inputs[1 - pos])
    if other is None or not go.is_float_array(other):
        return None
    per_channel = _per_channel(other, channels, rank)
    if per_channel is None:
        return f"{label}'s constant {list(other.shape)} varies along more than the channels"
    if node.op == "Mul":
        return per_channel, np.zeros(channels)
    if node.op == "Div":
        if not np.all(per_channel):
            return f"{label} divides by zero"
        return 1.0 / per_channel, np.zeros(channels)
    sign = -1.0 if node.op == "Sub" else 1.0
    return np.ones(channels), sign * per_channel


def _per_channel(value: np.ndarray, channels: int, rank: int) -> np.ndarray | None:
    """`value` as one number per output channel when it broadcasts over a Conv output of
    `rank` dims [N, C, ...] along the channel axis only, else None."""
    if value.ndim > rank:
        return None
    shape = (1,) * (rank - value.ndim) + tuple(value.shape)
    if any(d != 1 for i, d in enumerate(shape) if i != 1) or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(value.astype(np.float64).reshape(-1), (channels,)).copy()


def _stores_worse(weights: np.ndarray, new_w: np.ndarray, new_b: np.ndarray,
                  fmt: NumberFormat | None, largest: float) -> str:
    """Why the folded parameters would store worse in `fmt` than the originals, or ''."""
    top = float(max(np.abs(new_w).max(initial=0.0), np.abs(new_b).max(initial=0.0)))
    if not math.isfinite(top) or top > largest:
        return f"a folded parameter would reach {top:.3g} (largest stored: {largest:.5g})"
    if fmt is None:
        return ""
    # The analyser's own test (init.underflow): the fold must not create that finding.
    before, after = summarise(weights, fmt).tiny_share, summarise(new_w, fmt).tiny_share
    if after >= UNDERFLOW_MASS > before:
        return (f"{after:.0%} of its folded weights' magnitude would lie below {fmt.name}'s "
                f"smallest normal {fmt.min_normal:.3g} (unfolded: {before:.1%})")
    return ""
