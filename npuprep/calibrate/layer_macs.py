"""Multiply-adds per sample of every layer, those of If/Loop/Scan bodies as often as they ran.

A Loop body's Gemm runs once per iteration, so its multiply-adds per inference are its
per-run count times the iterations; shapes alone cannot know a greedy decoder's length (nor
infer a body's sizes where its loop-carried state grows). Calibration already counts every
element a body tensor held over all iterations and samples (npuprep.calibrate.instrument
merges a body's statistics over its runs), and each output element of a layer costs K
multiply-adds, K the reduced size its weight gives: so the layer's multiply-adds per sample
are its output's count / samples x K, whatever the iterations, batch or sizes were.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import onnx

from npuprep.calibrate.stats import CalibrationStats
from npuprep.flops import node_flops, tensor_shapes
from npuprep.formatting import percent
from npuprep.graph import attribute, node_scopes, scope_constant
from npuprep.ops import QUANTISED_MAC_OPS, RECURRENT_OPS


def layer_macs(model: onnx.ModelProto, stats: CalibrationStats | None,
               input_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """Multiply-adds per sample (FLOPs / 2) of every Conv/MatMul/Gemm of the model and its
    bodies, at `input_shapes` (a sample's sizes); a body's layer as often as `stats` measured
    its output (one run's, from shapes, where its output or weight is unknown), and so is a
    main-graph layer whose sizes shape inference cannot tell (a ViT's token axis after
    a computed Reshape: from shapes, it would count one multiply-add)."""
    shapes = tensor_shapes(model, input_shapes)
    flops = node_flops(model, input_shapes, shapes=shapes)
    out: dict[str, int] = {}
    for label, (node, chain) in node_scopes(model.graph).items():
        if node.op_type not in QUANTISED_MAC_OPS:
            continue
        unsized = any(t not in shapes for t in (*node.input[:2], *node.output[:1]) if t)
        measured = _measured(node, chain, stats) if len(chain) > 1 or unsized else None
        out[label] = measured if measured is not None else flops.get(label, 0) // 2
    return out


def _measured(node: onnx.NodeProto, chain: Sequence[onnx.GraphProto],
              stats: CalibrationStats | None) -> int | None:
    """A body layer's multiply-adds per sample: its output's measured count / samples x the
    reduced size K of its constant weight."""
    r = None if stats is None or not node.output else stats.tensors.get(node.output[0])
    w = scope_constant(chain, node.input[1]) if len(node.input) > 1 else None
    if r is None or w is None or stats is None or stats.sample_count <= 0:
        return None
    if node.op_type == "Conv" and w.ndim >= 3:
        k = math.prod(w.shape[1:])
    elif node.op_type == "MatMul" and w.ndim >= 2:
        k = w.shape[-2]
    elif node.op_type == "Gemm" and w.ndim == 2:
        k = w.shape[1] if attribute(node, "transB", 0) else w.shape[0]
    else:
        return None
    return round(r.count / stats.sample_count * k)


def body_note(model: onnx.ModelProto, macs: Mapping[str, int]) -> list[str]:
    """A note on the layers of If/Loop/Scan bodies among `macs` and their share (none: no note)."""
    inside = [label for label, (_, chain) in node_scopes(model.graph).items()
              if len(chain) > 1 and label in macs]
    if not inside:
        return []
    share = sum(macs[x] for x in inside) / (sum(macs.values()) or 1)
    return [f"{len(inside)} layer(s) inside If/Loop/Scan bodies ({share:.1%} of the multiply-adds, "
            "counted as often as calibration saw each body run): decided and searched like the "
            "main graph's, their Q/DQ in the body"]


def recurrent_note(model: onnx.ModelProto, macs: Mapping[str, int],
                   input_shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """A note on the RNN/GRU/LSTM layers, which stay in the wider format, and their part of
    all multiply-adds beside the Conv/MatMul/Gemm ones `macs` counts (none: no note)."""
    ops = {label: node.op_type for label, (node, _) in node_scopes(model.graph).items()
           if node.op_type in RECURRENT_OPS}
    if not ops:
        return []  # no second shape inference for the models without one
    flops = node_flops(model, input_shapes)
    recurrent = sum(flops.get(label, 0) // 2 for label in ops)
    part = recurrent / ((recurrent + sum(macs.values())) or 1)
    kinds = "/".join(sorted(set(ops.values())))
    return [f"{len(ops)} recurrent layer(s) ({kinds}) hold {percent(part)} of all multiply-adds and "
            "stay in the wider format (no 8-bit rule covers their gates); the 8-bit share counts "
            "the Conv/MatMul/Gemm ones only"]
