"""What an 8-bit scale cuts off: range.scale_clip, per activation input of an 8-bit multiply-add.

    x (abs-max 9.1) -> Q(scale = clip / 127) -> Conv: |x| > clip (0.02% of x) becomes +-clip

The clip is the scale rule's (abs-max, percentile, MSE; npuprep.calibrate.scales) on the
measured statistics; the finding carries the share of the tensor's values above it. INT8 and
FP8 alike: both map the clip onto their largest code (127, or 448 for E4M3).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import onnx

from npuprep.analyse.finding import Finding, Findings
from npuprep.calibrate.scales import DEFAULT_RULE, clip_for
from npuprep.graph import constant_value, node_label
from npuprep.numerics import EightBitFormat
from npuprep.profiles import Severity

# Above this share of a tensor's values clipped, the finding is a warning: a percentile clip
# cuts 0.01% by design; ten times that is the tail of the distribution, not outliers.
CLIP_WARNING = 1e-3


def scale_clip_findings(model: onnx.ModelProto, stats: Any, fmt: EightBitFormat,
                        eight_bit_nodes: Iterable[str], rule: str = DEFAULT_RULE) -> Findings:
    """One finding per measured activation input of each node in `eight_bit_nodes`: where its
    scale clips it and the share of values clipped (0 for an abs-max clip)."""
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
            clip = clip_for(r, fmt, rule)
            share = r.fraction_above(clip.value) if clip.value < r.absmax else 0.0
            found.append(_finding(node, label, name, fmt, clip, r.absmax, share))
    return Findings(tuple(found))


def _finding(node: onnx.NodeProto, label: str, tensor: str, fmt: EightBitFormat, clip: Any,
             absmax: float, share: float | None) -> Finding:
    scale = clip.scale(fmt)
    said = "an unknown share" if share is None else f"{100 * share:.2g}%"
    warn = share is None or share > CLIP_WARNING
    cut = (f"clips {said} of its values (abs-max {absmax:.3g})" if clip.value < absmax
           else f"clips nothing (abs-max {absmax:.3g})")
    return Finding(
        rule="range.scale_clip", severity=Severity.WARNING if warn else Severity.INFO,
        node=label, op_type=node.op_type, tensor=tensor,
        message=(f"{fmt.name} scale {scale:.3g} ({clip.rule} clip at {clip.value:.3g}, "
                 f"{fmt.qmax:g} x scale) on '{tensor}' {cut}"),
        evidence={"format": fmt.name, "clipped_fraction": share, "clip": clip.value,
                  "absmax": absmax, "scale": scale, "scale_rule": clip.rule,
                  **({"fallback": clip.fallback} if clip.fallback else {})},
        remedy="none",
        remedy_text=("values past the clip become +-clip; --scale-rule absmax clips none "
                     "(coarser steps), or keep the layer wider in the plan's eight_bit list"
                     if warn else ""),
    )
