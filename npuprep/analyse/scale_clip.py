"""What an 8-bit scale cuts off: range.scale_clip, per activation input of an 8-bit multiply-add.

    x (abs-max 9.1) -> Q(scale = clip / 127) -> Conv: |x| > clip (0.02% of x) becomes +-clip

The clip is the one convert writes: the scale rule's (abs-max, percentile, MSE;
npuprep.calibrate.scales) on the measured statistics, raised for unseen samples as
quantisation raises it, abs-max with FP8's NaN headroom where FP8 does not saturate. The
finding carries the share of the tensor's values above it. INT8 and FP8 alike map the clip
onto their largest code (127, 255 for a uint8 activation, 448 for E4M3). Where INT8's rules
place different clips, convert picks the one of least measured output error (a verification
run check does not make): the finding shows `rule`'s and lists every candidate's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import onnx

from npuprep.analyse.finding import Finding, Findings
from npuprep.calibrate.scales import (
    FP8_NAN_HEADROOM,
    Clip,
    clip_for,
    clip_raise_factor,
    stored_as,
)
from npuprep.calibrate.stats import CalibrationStats, RangeStats
from npuprep.graph import constant_value, node_label
from npuprep.numerics import EightBitFormat
from npuprep.profiles import Severity
from npuprep.scale_rules import DEFAULT_RULE, ScaleRule

# Above this share of a tensor's values clipped, the finding is a warning: a percentile clip
# cuts 0.01% by design; ten times that is the tail of the distribution, not outliers.
CLIP_WARNING = 1e-3


def scale_clip_findings(model: onnx.ModelProto, stats: CalibrationStats | None, fmt: EightBitFormat,
                        eight_bit_nodes: Iterable[str], rule: ScaleRule = DEFAULT_RULE, *,
                        saturate: bool = True) -> Findings:
    """One finding per measured activation input of each node in `eight_bit_nodes`: where the
    scale convert writes clips it and the share of values clipped (0 for an abs-max clip).
    `saturate`: whether the target's FP8 saturates (convert's abs-max fallback where not)."""
    headroom = 1.0
    if fmt.is_float and not saturate:
        rule, headroom = ScaleRule.ABSMAX, FP8_NAN_HEADROOM
    wanted = set(eight_bit_nodes)
    g = model.graph
    found: list[Finding] = []
    seen: set[str] = set()
    for node in g.node:
        label = node_label(node)
        if label not in wanted:
            continue
        for i, name in enumerate(node.input[:2]):
            if not name or name in seen or (i == 1 and constant_value(g, name) is not None):
                continue
            r = stats.tensors.get(name) if stats is not None else None
            if r is None or not r.absmax > 0:
                continue
            seen.add(name)
            widen = clip_raise_factor(r, fmt, headroom)
            clips = {other: _written(r, fmt, other, widen)
                     for other in ((rule,) if fmt.is_float else (rule, *ScaleRule))}
            # Convert weighs the rules only where their clips differ.
            distinct = len({c.value for c in clips.values()}) > 1
            found.append(_finding(node, label, name, fmt, clips[rule], r, widen,
                                  clips if distinct else {}))
    return Findings(tuple(found))


def _written(r: RangeStats, fmt: EightBitFormat, rule: ScaleRule, widen: float) -> Clip:
    placed = clip_for(r, fmt, rule)
    return Clip(placed.value * widen, placed.rule, placed.fallback)


def _share(r: RangeStats, clip: Clip) -> float | None:
    """Share of values above the clip; None where the histogram cannot tell."""
    return r.fraction_above(clip.value) if clip.value < r.absmax else 0.0


def _said(share: float | None) -> str:
    return "an unknown share" if share is None else f"{100 * share:.2g}%"


def _stored(r: RangeStats, clip: Clip, widen: float, fmt: EightBitFormat) -> dict[str, Any]:
    scale, unsigned, zero_point = stored_as(r, clip.value, widen, fmt)
    return {"clip": clip.value, "clipped_fraction": _share(r, clip), "scale": scale,
            "stored": "uint8" if unsigned else fmt.name, "zero_point": zero_point}


def _finding(node: onnx.NodeProto, label: str, tensor: str, fmt: EightBitFormat, clip: Clip,
             r: RangeStats, widen: float, candidates: dict[ScaleRule, Clip]) -> Finding:
    written = _stored(r, clip, widen, fmt)
    share = written["clipped_fraction"]
    warn = share is None or share > CLIP_WARNING
    cut = (f"clips {_said(share)} of its values (abs-max {r.absmax:.3g})" if clip.value < r.absmax
           else f"clips nothing (abs-max {r.absmax:.3g})")
    # Rules placing the same clip are said once (convert measures each clip once).
    other = {c.value: c for c in reversed(candidates.values()) if c.value != clip.value}
    others = ", ".join(f"{c.rule} {c.value:.3g} (clips {_said(_share(r, c))})"
                       for c in reversed(other.values()))
    choice = f"; convert weighs it against {others} by measured error" if others else ""
    return Finding(
        rule="range.scale_clip", severity=Severity.WARNING if warn else Severity.INFO,
        node=label, op_type=node.op_type, tensor=tensor,
        message=(f"{written['stored']} scale {written['scale']:.3g} ({clip.rule} clip at "
                 f"{clip.value:.3g}) on '{tensor}' {cut}{choice}"),
        evidence={"format": fmt.name, **written, "absmax": r.absmax, "scale_rule": clip.rule.value,
                  "unseen_sample_widening": widen,
                  **({"candidates": {rule.value: _stored(r, c, widen, fmt) for rule, c in candidates.items()}}
                     if candidates else {}),
                  **({"fallback": clip.fallback} if clip.fallback else {})},
        remedy="none",
        remedy_text=("values past the clip become +-clip; --scale-rule absmax clips none "
                     "(coarser steps), or keep the layer wider in the plan's eight_bit list"
                     if warn else ""),
    )
