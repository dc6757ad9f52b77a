"""What a converted model records about its source: `metadata_props` -> (source fingerprint, tensor scales).

`convert` writes the fingerprint of the model it started from and the power-of-two scale
each rescaled tensor carries (the converted tensor holds `scale` times the source's values),
so statistics of the source model can be applied to its conversion
(npuprep.calibrate.mapping). Metadata is not part of the model's fingerprint. A model
converted before this record existed is recognised by the `<out>.report.json` beside it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

SOURCE_KEY = "npuprep.source_fingerprint"
SCALES_KEY = "npuprep.tensor_scales"


@dataclass(frozen=True)
class Source:
    """The model a conversion was made from, and the scale of each rescaled tensor."""

    fingerprint: str
    tensor_scales: dict[str, float] = field(default_factory=dict)


def record_source(proto: onnx.ModelProto, fingerprint: str, tensor_scales: dict[str, float]) -> None:
    """Write (or replace) the source record in `proto.metadata_props`."""
    props = {p.key: p.value for p in proto.metadata_props}
    scales = {t: float(s) for t, s in sorted(tensor_scales.items()) if s != 1.0}
    props.update({SOURCE_KEY: fingerprint, SCALES_KEY: json.dumps(scales, sort_keys=True)})
    onnx.helper.set_model_props(proto, props)


def read_source(proto: onnx.ModelProto) -> Source | None:
    """The source record of a model npuprep converted; None for any other model (or a
    record that does not parse: then the model is treated as not converted by npuprep)."""
    props = {p.key: p.value for p in proto.metadata_props}
    if not props.get(SOURCE_KEY):
        return None
    try:
        scales = json.loads(props.get(SCALES_KEY) or "{}")
        return Source(props[SOURCE_KEY], {str(t): float(s) for t, s in scales.items()})
    except (ValueError, TypeError, AttributeError):
        return None


def find_source(model: Any) -> Source | None:
    """The source of `model` (an npuprep.model_io.Model): its metadata record, else the
    conversion report written beside it (`<out>.report.json`) when that names this model as
    its output; None for a model npuprep did not convert."""
    recorded = read_source(model.proto)
    if recorded is not None or not model.path:
        return recorded
    report = Path(model.path).with_suffix(".report.json")
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("kind") != "convert" \
            or data.get("output_fingerprint") != model.fingerprint or not data.get("fingerprint"):
        return None
    scales = data.get("tensor_scales") or {}
    try:
        return Source(str(data["fingerprint"]), {str(t): float(v) for t, v in scales.items() if v != 1.0})
    except (TypeError, ValueError, AttributeError):
        return None
