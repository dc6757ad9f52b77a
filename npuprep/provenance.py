"""What a converted model records about itself: `metadata_props` -> `Source`, `ConversionRecord`.

`convert` writes the fingerprint of the model it started from and the power-of-two scale
each rescaled tensor carries (the converted tensor holds `scale` times the source's values),
so statistics of the source model can be applied to its conversion
(npuprep.calibrate.mapping). Metadata is not part of the model's fingerprint. A model
converted before this record existed is recognised by the `<out>.report.json` beside it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from npuprep.detections import Decision, decision_from_json, decision_to_json
from npuprep.json_io import to_jsonable

SOURCE_KEY = "npuprep.source_fingerprint"
SCALES_KEY = "npuprep.tensor_scales"
# Tensors an 8-bit conversion rescaled per channel on purpose (equalised, balanced): the
# factors each was multiplied by, broadcast against it, so a compare can undo them.
CHANNEL_SCALES_KEY = "npuprep.channel_scales"
# The whole record of a conversion (JSON): what convert did and decided, so that every other
# command given the converted model reaches convert's verdict, not one of its own.
RECORD_KEY = "npuprep.conversion"
RECORD_VERSION = 1


@dataclass(frozen=True)
class Source:
    """The model a conversion was made from, the scale of each rescaled tensor, and the
    factors of each tensor rescaled per channel (an array that broadcasts against it)."""

    fingerprint: str
    tensor_scales: dict[str, float] = field(default_factory=dict)
    channel_scales: dict[str, np.ndarray] = field(default_factory=dict)


def record_source(proto: onnx.ModelProto, fingerprint: str, tensor_scales: dict[str, float],
                  channel_scales: Mapping[str, np.ndarray] | None = None) -> None:
    """Write (or replace) the source record in `proto.metadata_props`; the per-channel
    factors only where `channel_scales` is given (else those recorded stay)."""
    props = {p.key: p.value for p in proto.metadata_props}
    scales = {t: float(s) for t, s in sorted(tensor_scales.items()) if s != 1.0}
    props.update({SOURCE_KEY: fingerprint, SCALES_KEY: json.dumps(scales, sort_keys=True)})
    if channel_scales is not None:
        props.pop(CHANNEL_SCALES_KEY, None)
    if channel_scales:
        props[CHANNEL_SCALES_KEY] = json.dumps(
            {t: {"shape": list(np.shape(f)), "factors": np.asarray(f, np.float32).ravel().tolist()}
             for t, f in sorted(channel_scales.items())}, sort_keys=True)
    onnx.helper.set_model_props(proto, props)


def read_source(proto: onnx.ModelProto) -> Source | None:
    """The source record of a model npuprep converted; None for any other model (or a
    record that does not parse: then the model is treated as not converted by npuprep)."""
    props = {p.key: p.value for p in proto.metadata_props}
    if not props.get(SOURCE_KEY):
        return None
    try:
        scales = json.loads(props.get(SCALES_KEY) or "{}")
        channels = json.loads(props.get(CHANNEL_SCALES_KEY) or "{}")
        return Source(props[SOURCE_KEY], {str(t): float(s) for t, s in scales.items()},
                      {str(t): np.asarray(c["factors"], np.float32).reshape(c["shape"])
                       for t, c in channels.items()})
    except (ValueError, TypeError, AttributeError, KeyError):
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


@dataclass(frozen=True)
class Gates:
    """What a conversion had to meet: each output's rel L2 (`rtol`, `atol` for near-zero
    outputs), top-k agreement of decided outputs, the FP32 share of FLOPs (FP16/BF16) or the
    8-bit share of multiply-adds (INT8/FP8)."""

    rtol: float
    atol: float
    top_k: dict[str, Decision] = field(default_factory=dict)
    max_fp32_share: float | None = None
    min_8bit_share: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"rtol": self.rtol, "atol": self.atol,
                "top_k": {k: decision_to_json(v) for k, v in sorted(self.top_k.items())},
                "max_fp32_share": self.max_fp32_share, "min_8bit_share": self.min_8bit_share}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Gates:
        return cls(rtol=float(data["rtol"]), atol=float(data["atol"]),
                   top_k={str(k): decision_from_json(v)
                          for k, v in (data.get("top_k") or {}).items()},
                   max_fp32_share=_optional_float(data.get("max_fp32_share")),
                   min_8bit_share=_optional_float(data.get("min_8bit_share")))


@dataclass(frozen=True)
class ConversionRecord:
    """What one conversion did, stored in the converted model itself.

    `plan` is the applied plan as `Plan.to_dict()` (verification rounds' pins included);
    `stats_fingerprint` names the statistics it planned on (None: calibrated in the run);
    `calibration_ids`/`holdout_ids` the samples it planned and verified on; `passed` and
    `cause` its verdict (`cause`: the FAILED line's reason, '' when it passed).
    """

    source: Source
    target: str
    precision: str
    gates: Gates
    plan: dict[str, Any]
    passed: bool
    cause: str = ""
    stats_fingerprint: str | None = None
    calibration_ids: tuple[str, ...] = ()
    holdout_ids: tuple[str, ...] = ()
    host_scales: dict[str, float] = field(default_factory=dict)
    # Where the calibration ids are from (kind, folder or file: SampleSet.source_info).
    calibration_source: dict[str, Any] = field(default_factory=dict)
    # The nodes the converted model computes in FP32 (its verification kept them unrounded).
    pinned_nodes: tuple[str, ...] = ()
    version: int = RECORD_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "source_fingerprint": self.source.fingerprint,
            "tensor_scales": {t: s for t, s in sorted(self.source.tensor_scales.items())},
            "target": self.target,
            "precision": self.precision,
            "gates": self.gates.to_dict(),
            "passed": self.passed,
            "cause": self.cause,
            "stats_fingerprint": self.stats_fingerprint,
            "calibration_ids": list(self.calibration_ids),
            "holdout_ids": list(self.holdout_ids),
            "host_scales": {o: s for o, s in sorted(self.host_scales.items())},
            "calibration_source": dict(self.calibration_source),
            "pinned_nodes": list(self.pinned_nodes),
            "plan": self.plan,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConversionRecord:
        scales = data.get("tensor_scales") or {}
        return cls(
            source=Source(str(data["source_fingerprint"]),
                          {str(t): float(v) for t, v in scales.items()}),
            target=str(data["target"]), precision=str(data["precision"]),
            gates=Gates.from_dict(data["gates"]), plan=dict(data["plan"]),
            passed=bool(data["passed"]), cause=str(data.get("cause") or ""),
            stats_fingerprint=data.get("stats_fingerprint"),
            calibration_ids=tuple(str(i) for i in data.get("calibration_ids") or ()),
            holdout_ids=tuple(str(i) for i in data.get("holdout_ids") or ()),
            host_scales={str(o): float(v) for o, v in (data.get("host_scales") or {}).items()},
            calibration_source=dict(data.get("calibration_source") or {}),
            pinned_nodes=tuple(str(n) for n in data.get("pinned_nodes") or ()),
            version=int(data.get("version", RECORD_VERSION)),
        )


def record_conversion(proto: onnx.ModelProto, record: ConversionRecord) -> None:
    """Write (or replace) the conversion record, and the source record it contains."""
    record_source(proto, record.source.fingerprint, record.source.tensor_scales)
    props = {p.key: p.value for p in proto.metadata_props}
    # numpy numbers and non-finite floats as report.json writes them (npuprep.json_io)
    props[RECORD_KEY] = json.dumps(to_jsonable(record.to_dict()), sort_keys=True,
                                   separators=(",", ":"), allow_nan=False)
    onnx.helper.set_model_props(proto, props)


def read_conversion(proto: onnx.ModelProto) -> ConversionRecord | None:
    """The conversion record of a model npuprep converted; None for any other model, one
    converted before the record existed, or a record that does not parse."""
    props = {p.key: p.value for p in proto.metadata_props}
    text = props.get(RECORD_KEY)
    if not text:
        return None
    try:
        return ConversionRecord.from_dict(json.loads(text))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def stats_fingerprint(stats: dict[str, Any]) -> str:
    """A digest of calibration statistics (CalibrationStats.to_dict()): the same statistics,
    wherever they were saved, give the same digest."""
    text = json.dumps(stats, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
