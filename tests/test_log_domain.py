"""A log of a floored power spectrum: the scale rides through the squares and the Log absorbs it."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.model_io import Model
from npuprep.plan.actions import Hazard
from npuprep.profiles import load_profile
from npuprep.rewrite.rescale import apply_rescale
from npuprep.runtime.session import make_session, run

FRAME, HOP, BINS, FRAMES = 256, 128, 8, 8
CHAIN = {"sq_re", "sq_im", "power", "floor", "log"}


def _spectrum_model(floor_op: str = "Max") -> onnx.ModelProto:
    # wav -> Conv(cos|sin) -> re, im -> re*re + im*im -> Max(., 1e-12) -> Log -> MatMul -> y
    t = np.arange(FRAME)
    freqs = np.arange(1, BINS + 1)
    window = np.hanning(FRAME)
    cos = (np.cos(2 * np.pi * np.outer(freqs, t) / FRAME) * window)[:, None, :]
    sin = (np.sin(2 * np.pi * np.outer(freqs, t) / FRAME) * window)[:, None, :]
    kernel = numpy_helper.from_array(np.concatenate([cos, sin]).astype(np.float32), "stft")
    proj = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((BINS, 4)).astype(np.float32) * 0.1, "proj_w")
    floor = numpy_helper.from_array(np.array(1e-12 if floor_op == "Max" else 1e-10, np.float32),
                                    "floor_c")
    consts = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (
        ("s0", [0]), ("s8", [BINS]), ("s16", [2 * BINS]), ("ax", [1]))]
    nodes = [
        helper.make_node("Conv", ["wav", "stft"], ["spec"], name="stft_conv", strides=[HOP]),
        helper.make_node("Slice", ["spec", "s0", "s8", "ax"], ["re"], name="take_re"),
        helper.make_node("Slice", ["spec", "s8", "s16", "ax"], ["im"], name="take_im"),
        helper.make_node("Mul", ["re", "re"], ["re2"], name="sq_re"),
        helper.make_node("Mul", ["im", "im"], ["im2"], name="sq_im"),
        helper.make_node("Add", ["re2", "im2"], ["pw"], name="power"),
        helper.make_node(floor_op, ["pw", "floor_c"], ["floored"], name="floor"),
        helper.make_node("Log", ["floored"], ["logpw"], name="log"),
        helper.make_node("Transpose", ["logpw"], ["frames"], name="frames", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["frames", "proj_w"], ["y"], name="proj"),
    ]
    graph = helper.make_graph(
        nodes, "power_spectrum",
        [helper.make_tensor_value_info("wav", TensorProto.FLOAT, [1, 1, (FRAMES - 1) * HOP + FRAME])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, FRAMES, 4])],
        [kernel, proj, floor, *consts])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _loud_audio(n: int, seed: int, silent: bool = False,
                peak: float = 32767.0) -> list[dict[str, np.ndarray]]:
    """A tone on every bin at int16 scale, random phases and loudness: power up to ~1e11;
    `silent` zeroes the first frames."""
    rng = np.random.default_rng(seed)
    t = np.arange((FRAMES - 1) * HOP + FRAME)
    out = []
    for _ in range(n):
        amps = rng.uniform(0.3, 1.0, BINS)
        phases = rng.uniform(0, 2 * np.pi, BINS)
        wav = sum(a * np.cos(2 * np.pi * f * t / FRAME + p)
                  for f, a, p in zip(range(1, BINS + 1), amps, phases, strict=True))
        # Peaks at int16 scale, as audio read from a file.
        wav = (wav / np.abs(wav).max() * rng.uniform(0.6, 1.0) * peak).reshape(1, 1, -1)
        if silent:
            wav[..., : 2 * HOP + FRAME] = 0.0
        out.append({"wav": wav.astype(np.float32)})
    return out


def _rel_l2(model: onnx.ModelProto, cand: onnx.ModelProto, samples) -> float:
    a, b = make_session(model), make_session(cand)
    worst = 0.0
    for s in samples:
        r, c = run(a, s)["y"], run(b, s)["y"]
        worst = max(worst, float(np.linalg.norm(c - r) / np.linalg.norm(r)))
    return worst


def test_log_offset_keeps_the_function_of_a_scaled_spectrum():
    # stft_conv weights x 2^-10 -> power x 2^-20, floor x 2^-20 -> Log + 20 ln 2: same y in FP32
    proto = _spectrum_model()
    done = apply_rescale(proto, "stft_conv", 10)
    assert done, done.reason
    assert {"node": "log", "kind": "log_offset", "exponent": -20} in done.details["absorbers"]
    assert _rel_l2(proto, done.model, _loud_audio(2, 3)) < 1e-5


def test_power_spectrum_into_log_converts_with_every_node_fp16():
    # power up to ~1e11 -> plan: rescale at stft_conv absorbed by log; nothing FP32; held out too
    proto = _spectrum_model()
    model = Model(proto=proto, path="spectrum.onnx", digest="spectrum")
    samples = _loud_audio(6, 1)
    stats = calibrate(model, samples)
    assert stats.tensors["pw"].absmax > 1e10
    result = convert(model, load_profile("generic"), samples, stats=stats,
                     holdout=_loud_audio(3, 2))
    assert result, result.to_dict()["verification"]
    (rescale,) = result.plan.rescales()
    assert "log" in rescale.absorbers and rescale.k > 0
    assert not result.pinned_nodes
    for check in (result.output_check, result.holdout):
        (y,) = check.outputs.values()
        assert y["nonfinite"] == 0 and y["rel_l2"] <= 1e-2


def test_floor_reached_by_silence_keeps_only_the_chain_wide():
    # silent frames put 1e-10 at the Log: no scale keeps both it and 1e11 -> the chain is pinned
    # (quiet audio: the STFT itself fits FP16, so the chain is all that must stay wide)
    proto = _spectrum_model("Add")
    model = Model(proto=proto, path="spectrum.onnx", digest="spectrum")
    samples = _loud_audio(6, 1, silent=True, peak=1024.0)
    result = convert(model, load_profile("generic"), samples, stats=calibrate(model, samples),
                     max_fp32_share=1.0)
    declined = [d.reason for d in result.plan.declined if d.target == "log"]
    assert declined and "wider than the fp16 normal range" in declined[0]
    assert result.output_check, result.output_check.to_dict()
    (y,) = result.output_check.outputs.values()
    assert y["nonfinite"] == 0 and y["rel_l2"] <= 1e-2
    assert {"sq_re", "sq_im", "power", "log"} <= set(result.pinned_nodes) <= CHAIN


def test_loud_stft_is_scaled_into_fp16_while_the_chain_stays_wide():
    # loud audio + silence: re, im reach 1e5 -> stft_conv x 2^-k (FP16), squares..Log pinned
    proto = _spectrum_model("Add")
    model = Model(proto=proto, path="spectrum.onnx", digest="spectrum")
    samples = _loud_audio(6, 1, silent=True)
    stats = calibrate(model, samples)
    assert stats.tensors["re"].absmax > 65504
    result = convert(model, load_profile("generic"), samples, stats=stats, max_fp32_share=1.0)
    assert [r.entry for r in result.plan.rescales()] == ["stft_conv"]
    assert set(result.plan.pinned_nodes()) == CHAIN
    assert "stft_conv" not in result.pinned_nodes
    assert result.output_check, result.output_check.to_dict()


def test_target_that_cannot_pin_scales_the_chain_and_floors_the_log_input():
    # rk3588: tones -> rescale absorbed by log, passes; + silence -> floor at the smallest
    # subnormal: finite, and the clamp says only a pin keeps the silent frames' log
    rk = load_profile("rk3588")
    model = Model(proto=_spectrum_model("Add"), path="spectrum.onnx", digest="spectrum")
    tones = _loud_audio(6, 1)
    result = convert(model, rk, tones, stats=calibrate(model, tones))
    assert result, result.output_check.to_dict()
    silent = _loud_audio(6, 1, silent=True)
    result = convert(model, rk, silent, stats=calibrate(model, silent))
    (clamp,) = result.plan.clamps()
    assert clamp.tensor == "floored" and clamp.kind == "log" and clamp.lo > 0
    assert "only an FP32 pin of the chain into log" in clamp.why
    # the pin it cannot make, typed: what a failure would name as its cause
    (needed,) = result.plan.unpinnable
    assert (needed.hazard, needed.tensor) == (Hazard.LOG_FLOOR, "floored")
    assert set(needed.nodes) == CHAIN and clamp.why.endswith(needed.why)
    (y,) = result.output_check.outputs.values()
    assert y["nonfinite"] == 0
