"""INT8 clipping probe: a value past the calibrated range comes back clipped, wrapped or whole.

    x (calibrated on |x| <= 1, then fed up to 4x that) -> Conv(1x1, identity) -> y

INT8 has no overflow of its own: its scale is set from calibration and a value beyond it is
what the quantiser does with it. `emulate` runs the graph as QDQ (QuantizeLinear clamps to
+-127, the ONNX semantics npuprep's QDQ models carry); `rknn` builds the FP32 graph with
rknn-toolkit2's own INT8 quantisation on a dataset of the calibration samples and runs its
simulator. Verdicts: `saturate` (past-range values come back at the clip, sign kept), `wrap`
(sign flipped), `no-clip` (they come back whole: the unit is wider than its calibration),
`other-finite`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.errors import NpuprepError

CALIBRATED = 1.0
CHANNELS = 4
# Past-range magnitudes fed after calibration, as multiples of the calibrated abs-max.
PAST = (1.5, 2.0, 4.0)
# A clipped value lands within this share of the clip (the toolkit's scale may round it).
CLIP_RTOL = 0.1
VERDICTS = ("saturate", "wrap", "no-clip", "other-finite")


@dataclass(frozen=True)
class ClipProbe:
    """What the backend did with past-range values; `pairs` are (FP32, observed)."""

    backend: str
    verdict: str
    reason: str
    calibrated: float
    clip: float
    pairs: tuple[tuple[float, float], ...]
    in_range_error: float

    def to_dict(self) -> dict[str, Any]:
        return {"name": "int8_clip", "unit": "INT8 quantiser past the calibrated range",
                "backend": self.backend, "verdict": self.verdict, "reason": self.reason,
                "calibrated_absmax": self.calibrated, "observed_clip": self.clip,
                "pairs": [list(p) for p in self.pairs], "in_range_max_abs_error": self.in_range_error}


def _model(qdq: bool) -> onnx.ModelProto:
    """x [1,4,2,4] -> Conv(identity 1x1) -> y; with `qdq`, x and W through int8 Q/DQ."""
    w = np.eye(CHANNELS, dtype=np.float32).reshape(CHANNELS, CHANNELS, 1, 1)
    inits = [numpy_helper.from_array(w, "W")]
    nodes = []
    x, weight = "x", "W"
    if qdq:
        scale = CALIBRATED / 127
        inits += [numpy_helper.from_array(np.array(scale, np.float32), "xs"),
                  numpy_helper.from_array(np.array(0, np.int8), "xz"),
                  numpy_helper.from_array(np.full(CHANNELS, 1 / 127, np.float32), "ws"),
                  numpy_helper.from_array(np.zeros(CHANNELS, np.int8), "wz")]
        nodes += [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
                  helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
                  helper.make_node("QuantizeLinear", ["W", "ws", "wz"], ["wq"], axis=0),
                  helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0)]
        x, weight = "xd", "wd"
    nodes.append(helper.make_node("Conv", [x, weight], ["y"], name="conv"))
    shape = [1, CHANNELS, 2, 4]
    graph = helper.make_graph(nodes, "int8_clip", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    return model


def calibration_feeds(count: int = 8) -> list[dict[str, np.ndarray]]:
    """Samples spanning [-CALIBRATED, CALIBRATED] exactly (every one reaches both ends)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        x = rng.uniform(-CALIBRATED, CALIBRATED, (1, CHANNELS, 2, 4)).astype(np.float32)
        x.flat[0], x.flat[1] = CALIBRATED, -CALIBRATED
        out.append({"x": x})
    return out


def probe_feed() -> dict[str, np.ndarray]:
    """Row 0 of each channel: +-PAST x CALIBRATED; row 1: in-range values."""
    x = np.zeros((1, CHANNELS, 2, 4), np.float32)
    for c in range(CHANNELS):
        past = PAST[c % len(PAST)] * CALIBRATED
        x[0, c, 0] = [past, -past, past, -past]
        x[0, c, 1] = np.array([0.5, -0.25, 0.75, -0.125]) * CALIBRATED
    return {"x": x}


def run_clip_probe(backend: str = "emulate", *, python: str | Path | None = None,
                   target_platform: str = "rk3588") -> ClipProbe:
    """The probe on `backend` (`emulate`: QDQ in onnxruntime; `rknn`: the toolkit's INT8;
    `openvino`: the QDQ model on OpenVINO's INT8 path)."""
    from npuprep.runtime.session import make_session, run

    feed = probe_feed()
    reference = run(make_session(_model(qdq=False)), feed)["y"]
    if backend == "emulate":
        observed = run(make_session(_model(qdq=True)), feed)["y"]
        name = "emulate (QDQ: QuantizeLinear clamps to int8)"
    elif backend == "rknn":
        from npuprep.vendors.rockchip import run_rknn

        done = run_rknn(_model(qdq=False), [feed], python=python, target_platform=target_platform,
                        quantize_on=calibration_feeds())
        if not done:
            raise NpuprepError(f"probe 'int8_clip': rknn-toolkit2 refused it in {done.stage}: "
                               f"{done.refusal}")
        observed = np.asarray(done.outputs[0]["y"], np.float32).reshape(reference.shape)
        name = f"rknn({target_platform} simulator, INT8 build)"
    elif backend == "openvino":
        from npuprep.vendors.openvino import run_openvino

        # The QDQ model as deployed: OpenVINO's low-precision transformations run it in INT8.
        done = run_openvino(_model(qdq=True), [feed], "fp32")
        observed = np.asarray(done.outputs[0]["y"], np.float32).reshape(reference.shape)
        name = f"openvino({done.device}, QDQ on its INT8 path)"
    else:
        raise NpuprepError(f"the INT8 clipping probe runs on emulate, rknn or openvino, not "
                           f"'{backend}'")
    return classify_clipping(reference, observed, name)


def classify_clipping(reference: np.ndarray, observed: np.ndarray, backend: str) -> ClipProbe:
    """Sort the past-range elements (|FP32| > CALIBRATED) into the verdicts; the most wins."""
    ref, obs = np.asarray(reference, np.float64), np.asarray(observed, np.float64)
    past = np.abs(ref) > CALIBRATED * (1 + CLIP_RTOL)
    inside = ~past
    in_err = float(np.max(np.abs(ref[inside] - obs[inside]))) if inside.any() else 0.0
    r, o = ref[past], obs[past]
    clip = float(np.max(np.abs(obs[inside]), initial=0.0))
    clip = max(clip, float(np.median(np.abs(o)))) if o.size else clip
    counts = dict.fromkeys(VERDICTS, 0)
    for rv, ov in zip(r, o, strict=True):
        if not np.isfinite(ov) or np.sign(ov) != np.sign(rv):
            counts["wrap" if np.isfinite(ov) else "other-finite"] += 1
        elif abs(ov - rv) <= CLIP_RTOL * abs(rv):
            counts["no-clip"] += 1
        elif abs(abs(ov) - CALIBRATED) <= CLIP_RTOL * CALIBRATED:
            counts["saturate"] += 1
        else:
            counts["other-finite"] += 1
    verdict = max(VERDICTS, key=lambda v: counts[v])
    pairs = tuple((float(a), float(b)) for a, b in list(zip(r, o, strict=True))[:4])
    said = {"saturate": f"values past the calibrated |x| <= {CALIBRATED:g} come back at the clip "
                        f"({clip:.3g}), sign kept",
            "wrap": "values past the calibrated range come back with the wrong sign (wrapped)",
            "no-clip": "values past the calibrated range come back whole: computed wider than "
                       "the calibration",
            "other-finite": "values past the calibrated range come back neither clipped nor whole"}
    counted = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    return ClipProbe(backend, verdict, f"{said[verdict]} ({counted} of {len(r)})", CALIBRATED,
                     clip, pairs, in_err)
