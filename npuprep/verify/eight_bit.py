"""The QDQ model the plan's 8-bit decisions give, and each 8-bit layer's own error: quantise
one layer at a time, run it in onnxruntime, rel L2 of the outputs (as attribution does for FP16).
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
from npuprep.numerics import EightBitFormat
from npuprep.opsets import model_opset, upgrade_opset
from npuprep.plan.eight_bit import LayerPrecision, activation_inputs
from npuprep.rewrite.qdq import ActivationScale, insert_qdq
from npuprep.rewrite.result import RewriteResult

# Samples each one-layer run is measured on: the ranking needs an order, not a verdict.
RANK_SAMPLES = 4


@dataclass(frozen=True)
class Sensitivity:
    """One 8-bit layer's own error: the outputs' pooled rel L2 with only it quantised."""

    node: str
    rel_l2: float

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "rel_l2": self.rel_l2}


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
            step = clip_for(r, fmt, rule).scale(fmt, unsigned=unsigned) * rescaled.get(name, 1.0) * headroom
            scales[name] = ActivationScale(step, unsigned)
        wanted[label] = scales
    return insert_qdq(model, wanted, fmt, saturate=saturate)


def rank_layers(reference: onnx.ModelProto, model: onnx.ModelProto, nodes: Sequence[str],
                stats: Any, fmt: EightBitFormat, samples: Sequence[Feed], *, saturate: bool,
                rule: str = DEFAULT_RULE,
                tensor_scales: Mapping[str, float] | None = None,
                headroom: float = 1.0) -> list[Sensitivity]:
    """Each of `nodes` quantised alone, worst first."""
    from npuprep.runtime.session import make_session, run

    feeds = list(samples)[:RANK_SAMPLES]
    ref_session = make_session(reference)
    refs = [run(ref_session, f) for f in feeds]
    found = []
    for label in nodes:
        single = quantise(model, [label], stats, fmt, saturate=saturate, rule=rule,
                          tensor_scales=tensor_scales, headroom=headroom)
        if not single:
            continue
        session = make_session(single.model)
        found.append(Sensitivity(label, _pooled_rel_l2(refs, [run(session, f) for f in feeds])))
    return sorted(found, key=lambda s: -s.rel_l2)


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
