"""An 8-bit layer whose input no one 8-bit scale holds, as two INT8 passes of the same weight:

    x -> Q/DQ(s) -> hi -> L ------------------------> y_hi -┐
    x - hi = r (what INT8 rounded away, |r| <= s/2) -> L' -> y_lo -> Add -> y

L' is L reading r, with L's weight and no bias. L is linear in its input, so L(hi) + L'(r)
= L(x) in FP32; quantised, r's own INT8 scale is about 254x finer than hi's, so the input
keeps about 15 bits over hi's range. Raw audio into an STFT written as a Conv needs that: a
VAD's chunks span 50 dB from silence to speech, which one INT8 scale cannot (the quiet chunks
flush), and FP8's 3-bit significand leaves a noise floor 30 dB under each chunk that drowns
the weak bins of voiced speech. Each pass is an ordinary 8-bit layer (a compiler fuses its
Q/DQ pairs as any other's); the pair costs twice the layer's multiply-adds, in INT8.
"""

from __future__ import annotations

import onnx
from onnx import helper

from npuprep.graph import name_maker, node_label, node_scopes
from npuprep.numerics import EightBitFormat
from npuprep.ops import QUANTISED_MAC_OPS
from npuprep.rewrite.qdq import ActivationScale, qdq_pair, sort_nodes
from npuprep.rewrite.result import RewriteResult


def split_input(model: onnx.ModelProto, label: str, scale: ActivationScale,
                int8: EightBitFormat) -> RewriteResult:
    """`model` with layer `label`'s input 0 split at `scale` in `int8` (the rounded part
    read by `label`, the residual by a new layer `label`_residual); details: `rounded`,
    `residual` (tensor names), `layer` (the new layer's label), `parts` (the two outputs).
    `scale` is the one the rounded part's own pair takes (npuprep.verify.qdq_model
    .activation_scale), so that pair rounds nothing more."""
    scopes = node_scopes(model.graph)
    if label not in scopes:
        return RewriteResult(model, False, f"no node '{label}'")
    if scopes[label][0].op_type not in QUANTISED_MAC_OPS:
        return RewriteResult(model, False, f"'{label}' is a {scopes[label][0].op_type}, not "
                                           "a multiply-add")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    node, (scope, *_) = node_scopes(g)[label]
    fresh = name_maker(g)
    x, y = node.input[0], node.output[0]
    # The pair's scale lives in the main graph, which every body reads.
    added: list[onnx.NodeProto] = []
    hi = qdq_pair(g, added, fresh, x, f"{x}_rounded", int8, True, scale)
    r = fresh(f"{x}_residual")
    y_hi, y_lo = fresh(f"{y}_rounded_part"), fresh(f"{y}_residual_part")
    residual_label = fresh(f"{label}_residual")
    residual = onnx.NodeProto()
    residual.CopyFrom(node)
    residual.name = residual_label
    # The bias is added once, by the rounded part.
    del residual.input[2:]
    residual.input[0], residual.output[0] = r, y_lo
    node.input[0], node.output[0] = hi, y_hi
    scope.node.extend([
        *added,
        helper.make_node("Sub", [x, hi], [r], name=fresh(f"{x}_split_Sub")),
        residual,
        helper.make_node("Add", [y_hi, y_lo], [y], name=fresh(f"{y}_split_Add")),
    ])
    sort_nodes(scope)
    return RewriteResult(out, True, f"'{label}' split into two INT8 passes",
                         {"rounded": hi, "residual": r, "layer": node_label(residual),
                          "parts": (y_hi, y_lo)})
