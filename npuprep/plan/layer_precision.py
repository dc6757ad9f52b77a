"""The 8-bit decision per node: `Conv/MatMul/Gemm -> int8 | fp8_e4m3`, or kept FP16/FP32 with why.

Range first: a multiply-add whose input is unmeasured, holds Inf/NaN, or that its 8-bit
scale would mostly flush to zero stays wider. The small ops around them (squares, exp,
divisions, reductions, normalisation statistics, softmax, sinusoids) are never quantised;
the plan names them with the range or resolution 8 bits would lose. Sensitivity comes
later (npuprep.verify.qdq_model ranks the 8-bit layers by the error each adds alone).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import onnx

from npuprep.calibrate.scales import clip_for
from npuprep.calibrate.stats import CalibrationStats
from npuprep.graph import node_scopes, scope_constant, tensor_types
from npuprep.numerics import EightBitFormat, eight_bit_format
from npuprep.ops import QUANTISED_MAC_OPS
from npuprep.scale_rules import DEFAULT_RULE, ScaleRule

# How a layer's residual pass is named in a plan's `why` (npuprep.verify.input_split: its input
# in two INT8 passes): the pass is made by the conversion, so the source has no such node.
RESIDUAL_OF = "the residual pass of "
# An 8-bit input whose scale flushes more than this share of its nonzero values stays wider.
FLUSH_LIMIT = 0.5
WIDER = ("fp16", "fp32")


@dataclass(frozen=True)
class LayerPrecision:
    """What one node runs in (`int8`, `fp8_e4m3`, `fp16`, `fp32`) and why; the plan's
    `eight_bit` list, editable like its actions."""

    node: str
    precision: str
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "precision": self.precision, "why": self.why}


def activation_inputs(graph: onnx.GraphProto, node: onnx.NodeProto,
                      outer: Sequence[onnx.GraphProto] = ()) -> list[str]:
    """The inputs of a multiply-add that are not constants (input 1 is its weight if constant);
    for a node of a body, `outer` holds the graphs around it (a weight its owner's scope holds)."""
    return [name for i, name in enumerate(node.input[:2])
            if name and not (i == 1 and scope_constant((graph, *outer), name) is not None)]


def decide(model: onnx.ModelProto, stats: CalibrationStats | None, fmt: EightBitFormat, pinned: Iterable[str] = (),
           rule: ScaleRule = DEFAULT_RULE) -> tuple[LayerPrecision, ...]:
    """Per node of the main graph and of every If/Loop/Scan body: 8-bit for the multiply-adds
    whose inputs 8 bits hold (a body's inputs as calibration measured them over every
    iteration), the wider format and its reason for the rest that matter (multiply-adds,
    small ops)."""
    pinned = set(pinned)
    scopes = node_scopes(model.graph)
    types = tensor_types(model)
    out: list[LayerPrecision] = []
    for label, (node, (g, *outer)) in scopes.items():
        wider = "fp32" if label in pinned else "fp16"
        small = _small_op_reason(node, fmt)
        if label in pinned and (node.op_type in QUANTISED_MAC_OPS or small):
            out.append(LayerPrecision(label, "fp32", "pinned FP32 by the plan" + (
                f"; {small}{_measured(node, stats)}" if small else "")))
        elif node.op_type in QUANTISED_MAC_OPS:
            why = _type_reason(node, types) or _range_reason(g, node, stats, fmt, rule, outer)
            out.append(LayerPrecision(label, wider, why) if why else
                       LayerPrecision(label, fmt.name, _clipping(g, node, stats, fmt, rule, outer)))
        elif small:
            out.append(LayerPrecision(label, wider, small + _measured(node, stats)))
    return tuple(out)


# The words of a layer's reason when its input is not FP32 (the verdict counts such layers).
NOT_FP32 = "not FP32"


def _type_reason(node: onnx.NodeProto, types: dict[str, int]) -> str:
    """Why a layer whose input or weight is not FP32 stays wider: Q/DQ pairs quantise FP32
    (an FP16 model's layers are left as they are, in its own format)."""
    for name in node.input[:2]:
        elem = types.get(name, onnx.TensorProto.FLOAT) if name else onnx.TensorProto.FLOAT
        if elem != onnx.TensorProto.FLOAT:
            return (f"input '{name}' is {onnx.helper.tensor_dtype_to_np_dtype(elem).name}, "
                    f"{NOT_FP32} (8-bit Q/DQ reads FP32 layers: export the model in FP32)")
    return ""


def _range_reason(g: onnx.GraphProto, node: onnx.NodeProto, stats: CalibrationStats | None, fmt: EightBitFormat,
                  rule: ScaleRule, outer: Sequence[onnx.GraphProto] = ()) -> str:
    for name in activation_inputs(g, node, outer):
        r = None if stats is None else stats.tensors.get(name)
        if r is None:
            return f"input '{name}' was not measured"
        if r.count == 0:
            return (f"input '{name}' was never computed on the calibration samples (a branch "
                    "or body they did not run)")
        if r.nan_count or r.inf_count or not math.isfinite(r.absmax):
            return f"input '{name}' holds Inf/NaN"
        clip = clip_for(r, fmt, rule)
        floor = clip.value / fmt.qmax * fmt.floor
        flushed = r.fraction_below(floor)
        if flushed is not None and flushed > FLUSH_LIMIT:
            return (f"{fmt.name} with scale {clip.value / fmt.qmax:.3g} flushes "
                    f"{100 * flushed:.0f}% of input '{name}' to zero")
    return ""


def _clipping(g: onnx.GraphProto, node: onnx.NodeProto, stats: CalibrationStats, fmt: EightBitFormat,
              rule: ScaleRule, outer: Sequence[onnx.GraphProto] = ()) -> str:
    """Why 8 bits hold the inputs: within the scaled range, and what the scales clip."""
    clipped = []
    for name in activation_inputs(g, node, outer):
        r = stats.tensors[name]
        clip = clip_for(r, fmt, rule)
        share = r.fraction_above(clip.value) if clip.value < r.absmax else 0.0
        if share:
            clipped.append(f"'{name}' clipped at {clip.value:.3g} (abs-max {r.absmax:.3g}, "
                           f"{100 * share:.2g}% of its values)")
    base = f"inputs measured within {fmt.name}'s scaled range"
    return base + ("; " + "; ".join(clipped) if clipped else "")


def _measured(node: onnx.NodeProto, stats: CalibrationStats | None) -> str:
    r = None if stats is None or not node.input else stats.tensors.get(node.input[0])
    return f" (measured |x| up to {r.absmax:.3g})" if r is not None else ""


def _small_op_reason(node: onnx.NodeProto, fmt: EightBitFormat) -> str:
    """Why a small op keeps a wider format; empty for ops 8-bit QDQ leaves alone silently."""
    op = node.op_type
    fp8 = fmt.is_float
    if op == "Exp":
        return (f"exp overflows {fmt.name} at {math.log(fmt.qmax):.3g}" if fp8 else
                "exp spans orders of magnitude: 256 levels of one scale cannot resolve it")
    if op == "Pow" or (op == "Mul" and len(node.input) == 2 and node.input[0] == node.input[1]):
        return (f"a square overflows {fmt.name} at |x| = {math.sqrt(fmt.qmax):.3g}" if fp8 else
                "a square doubles the range in decades: one 8-bit scale loses its small values")
    if op in ("Div", "Reciprocal"):
        return "a division amplifies the 8-bit error of its denominator"
    if op.startswith("Reduce") and op not in ("ReduceMax", "ReduceMin"):
        return "a reduction accumulates: its sum needs more than 8 bits"
    if op in ("Softmax", "LogSoftmax"):
        return "softmax: an exp and a normalising sum"
    if op in ("LayerNormalization", "InstanceNormalization", "GroupNormalization"):
        return "normalisation statistics (a mean of squares) need more than 8 bits"
    if op in ("Sin", "Cos"):
        return "a sinusoidal embedding's phase needs more resolution than 8 bits"
    if op in ("Sqrt", "Log"):
        return f"{op.lower()} of a statistic: its input's small values matter"
    return ""


def decided_with(model: onnx.ModelProto, stats: CalibrationStats, eight: EightBitFormat,
                 other: EightBitFormat | None, pinned: set[str],
                 rule: ScaleRule) -> tuple[LayerPrecision, ...]:
    """Each node's 8-bit decision in `eight`; with the target's `other` 8-bit format, a
    layer whose input `eight` cannot hold (INT8's one scale flushing a tensor that spans
    decades) takes `other` where that holds it."""
    layers = decide(model, stats, eight, pinned, rule)
    if other is None:
        return layers
    alt = {x.node: x for x in decide(model, stats, other, pinned, rule)}
    return tuple(LayerPrecision(x.node, other.name, f"{x.why}; {alt[x.node].why}")
                 if x.precision == "fp16" and alt[x.node].precision == other.name else x
                 for x in layers)


def int8_start_of(layers: Sequence[LayerPrecision],
                  int8_decided: Sequence[LayerPrecision]) -> list[LayerPrecision]:
    """The INT8 conversion's start for the layers `layers` keeps in 8 bits: INT8 where INT8
    holds the input, FP8 where only it does (`decided_with`); the rest
    as `layers` has them (the search's switches are those of `layers`' 8-bit layers)."""
    as_int8 = {x.node: x for x in int8_decided if eight_bit_format(x.precision) is not None}
    return [as_int8.get(x.node, x) if eight_bit_format(x.precision) is not None else x
            for x in layers]
