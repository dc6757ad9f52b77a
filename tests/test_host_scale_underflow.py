"""An output under FP16's smallest normal leaves the device scaled up, on every target."""

from __future__ import annotations

import math

import numpy as np
import pytest

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.model_io import Model, fingerprint
from npuprep.plan.host_scale import host_scaled_outputs
from npuprep.profiles import load_profile
from npuprep.runtime.session import make_session, run
from npuprep.verify.emulate_lowered import emulate_lowered
from tests.conftest import model_from_text

# x[2,8] -> MatMul(w ~1e-10) -> logits ~1e-10 (an untrained classifier's head)
TINY = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2,8] x) => (float[2,4] logits) <float[8,4] w = {{w}}> {
  logits = MatMul(x, w)
}
"""
W = np.random.default_rng(1).standard_normal((8, 4)) * 1e-10


@pytest.fixture(scope="module")
def tiny():
    proto = model_from_text(TINY.replace("{{w}}", "{" + ", ".join(f"{v:.6e}" for v in W.ravel()) + "}"))
    model = Model(proto=proto, path="tiny.onnx", digest=fingerprint(proto))
    rng = np.random.default_rng(0)
    samples = [{"x": rng.standard_normal((2, 8)).astype(np.float32)} for _ in range(6)]
    return model, samples[:4], samples[4:], calibrate(model, samples[:4])


def test_only_outputs_wholly_under_the_smallest_normal_are_scaled_up():
    rk = load_profile("rk3588")
    chosen = host_scaled_outputs(["tiny", "zero", "fits"], {"tiny": 1e-9, "zero": 0.0, "fits": 0.5}, rk.resolve())
    assert chosen.keys() == {"tiny"} and "under the smallest fp16 normal" in chosen["tiny"]
    # A target that can pin scales the tiny output too, but keeps an overflowing one's Mul FP32.
    a2000 = host_scaled_outputs(["tiny", "big"], {"tiny": 1e-9, "big": 1e6}, load_profile("a2000").resolve())
    assert a2000.keys() == {"tiny"} and "subnormals or 0" in a2000["tiny"]


@pytest.mark.parametrize("target", ["rk3588", "a2000"])
def test_tiny_logits_leave_scaled_and_the_host_scale_restores_them(tiny, target):
    model, calib, held, stats = tiny
    result = convert(model, load_profile(target), calib, stats=stats, holdout=held)
    assert result.passed, result.output_check.outputs
    factor = result.host_scales["logits"]
    assert factor < 1 and math.log2(factor).is_integer()
    for check in (result.output_check, result.holdout):
        out = check.outputs["logits"]
        assert out["nonfinite"] == 0 and out["rel_l2"] <= 1e-2
    # Every node rounded to FP16 (Cast pairs in FP32): the device's output sits in FP16's
    # normal range, and divided back on the host it is the FP32 output.
    emulated = emulate_lowered(result.lowered.model, load_profile(target).resolve().fmt,
                               saturate=False).model
    device = run(make_session(emulated), held[0])["logits"]
    assert np.abs(device).min() > 0 and np.abs(device).max() > 6.1e-5
    ref = run(make_session(model.proto), held[0])["logits"]
    assert np.abs(ref).max() < 6.1e-5
    back = device.astype(np.float64) * factor
    assert np.linalg.norm(back - ref) / np.linalg.norm(ref) <= 1e-2
    # No FP32 Mul is left on the device to hold the output's true range.
    assert not any(n.op_type == "Mul" for n in result.lowered.model.graph.node)
