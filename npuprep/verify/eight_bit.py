"""The QDQ model the plan's 8-bit decisions give, and what keeping each 8-bit layer wider
gains: every other layer quantised, this one not, run in onnxruntime, rel L2 of the outputs.

Leaving one layer out of the full 8-bit model, rather than quantising it alone, sees errors
that cancel: the two branches of a classifier-free guidance err alike, and keeping only one
of them wider undoes the cancellation (alone, each looks like the worst layer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from npuprep.calibrate.scales import DEFAULT_RULE, clip_for
from npuprep.data import Feed
from npuprep.graph import node_label
from npuprep.numerics import EightBitFormat, NumberFormat
from npuprep.opsets import model_opset, upgrade_opset
from npuprep.plan.eight_bit import LayerPrecision, activation_inputs
from npuprep.rewrite.qdq import ActivationScale, insert_qdq
from npuprep.rewrite.result import RewriteResult

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
# Samples each one-layer run is measured on: the ranking needs an order, not a verdict.
RANK_SAMPLES = 4


@dataclass(frozen=True)
class Sensitivity:
    """One 8-bit layer's weight in the error: the outputs' pooled rel L2 with every other
    ranked layer in 8 bits and this one wider, and what that gains over all of them in 8 bits
    (negative where keeping it wider alone undoes a cancellation)."""

    node: str
    rel_l2: float
    gain: float

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "rel_l2": self.rel_l2, "gain": self.gain}


def eight_bit_nodes(layers: Iterable[LayerPrecision], fmt: EightBitFormat) -> list[str]:
    return [x.node for x in layers if x.precision == fmt.name]


def with_opset(model: onnx.ModelProto, fmt: EightBitFormat) -> onnx.ModelProto:
    """`model` at an opset whose QuantizeLinear takes `fmt` per channel (a copy if upgraded)."""
    if model_opset(model) >= fmt.min_opset:
        return model
    return upgrade_opset(model, fmt.min_opset, why=f"{fmt.name} QDQ needs opset {fmt.min_opset}")


def quantise(model: onnx.ModelProto, nodes: Sequence[str], stats: Any, fmt: EightBitFormat, *,
             saturate: bool, rule: str = DEFAULT_RULE,
             tensor_scales: Mapping[str, float] | None = None, headroom: float = 1.0) -> RewriteResult:
    """`model` (at a QDQ opset) with `nodes` quantised: activation scales by `rule` from `stats`;
    a tensor the plan rescaled (`tensor_scales`: rewritten = s x measured) gets s x its clip,
    and every clip is widened by `headroom` (values of the quantised model reach past FP32's)."""
    rescaled = tensor_scales or {}
    by_label = {node_label(n): n for n in model.graph.node}
    wanted: dict[str, dict[str, ActivationScale]] = {}
    for label in nodes:
        node = by_label.get(label)
        if node is None:
            continue
        scales = {}
        for name in activation_inputs(model.graph, node):
            r = stats.tensors[name]
            unsigned = r.min >= 0 and not fmt.is_float
            step = clip_for(r, fmt, rule, extrapolate=True).scale(fmt, unsigned=unsigned) * rescaled.get(name, 1.0) * headroom
            scales[name] = ActivationScale(step, unsigned)
        wanted[label] = scales
    return insert_qdq(model, wanted, fmt, saturate=saturate)


def on_target(qdq: onnx.ModelProto, wide: NumberFormat, pinned_nodes: Iterable[str], *,
              saturate: bool) -> onnx.ModelProto:
    """What the board computes: the QDQ model with every tensor outside the pinned nodes
    rounded to `wide` (FP16), the 8-bit layers' outputs too; QuantizeLinear/DequantizeLinear
    stay exact (their scales are FP32 constants of the compiler). `qdq` itself where the
    wider format is FP32."""
    from npuprep.verify.emulate import emulate

    if wide.name == "fp32":
        return qdq
    exact = {node_label(n) for n in qdq.graph.node if n.op_type in QDQ_OPS}
    return emulate(qdq, wide, saturate=saturate, pinned_nodes=exact | set(pinned_nodes)).model


def rank_layers(reference: onnx.ModelProto, model: onnx.ModelProto, nodes: Sequence[str],
                stats: Any, fmt: EightBitFormat, samples: Sequence[Feed], *, saturate: bool,
                rule: str = DEFAULT_RULE,
                tensor_scales: Mapping[str, float] | None = None,
                headroom: float = 1.0) -> list[Sensitivity]:
    """Each of `nodes` kept wider while the others are quantised, the largest gain first."""
    from npuprep.runtime.session import make_session, run

    feeds = list(samples)[:RANK_SAMPLES]
    ref_session = make_session(reference)
    refs = [run(ref_session, f) for f in feeds]
    del ref_session

    def error(quantised: Sequence[str]) -> float:
        built = quantise(model, quantised, stats, fmt, saturate=saturate, rule=rule,
                         tensor_scales=tensor_scales, headroom=headroom)
        session = make_session(built.model if built else model)
        return _pooled_rel_l2(refs, [run(session, f) for f in feeds])

    every = error(nodes)
    found = []
    for label in nodes:
        without = error([n for n in nodes if n != label])
        found.append(Sensitivity(label, without, every - without))
    return sorted(found, key=lambda s: -s.gain)


def _pooled_rel_l2(refs: list[dict[str, np.ndarray]], got: list[dict[str, np.ndarray]]) -> float:
    """The worst output's rel L2, pooled over the samples."""
    worst = 0.0
    for name in refs[0] if refs else ():
        num = den = 0.0
        for r, g in zip(refs, got, strict=True):
            a = np.asarray(r[name], np.float64)
            if not np.issubdtype(a.dtype, np.floating):
                continue
            num += float(np.sum((np.asarray(g[name], np.float64) - a) ** 2))
            den += float(np.sum(a**2))
        if den > 0:
            worst = max(worst, float(np.sqrt(num / den)))
        elif num > 0:
            worst = float("inf")
    return worst
