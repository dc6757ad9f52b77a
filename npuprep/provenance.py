"""What a converted model records about its source: `metadata_props` -> (source fingerprint, tensor scales).

`convert` writes the fingerprint of the model it started from and the power-of-two scale
each rescaled tensor carries (the converted tensor holds `scale` times the source's values),
so statistics of the source model can be applied to its conversion
(npuprep.calibrate.mapping). Metadata is not part of the model's fingerprint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

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
