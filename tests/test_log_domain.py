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


MELS = 4


def _mel_model() -> onnx.ModelProto:
    # wav -> Unsqueeze -> Conv(cos), Conv(sin) -> Unsqueeze, Transpose -> Pow 2 -> Add
    #     -> MatMul(mel filter bank) -> Clip(1e-10, inf) -> Log -> y   (openWakeWord's front end)
    t, freqs, window = np.arange(FRAME), np.arange(1, BINS + 1), np.hanning(FRAME)
    cos = (np.cos(2 * np.pi * np.outer(freqs, t) / FRAME) * window)[:, None, :]
    sin = (np.sin(2 * np.pi * np.outer(freqs, t) / FRAME) * window)[:, None, :]
    mel_w = np.zeros((BINS, MELS), np.float32)
    for band, b in enumerate((0, 1, 5, 7)):  # two bands on loud bins, two on quiet ones
        mel_w[b, band] = 1e-5
    weights = {"cos_w": cos.astype(np.float32), "sin_w": sin.astype(np.float32), "mel_w": mel_w,
               "two": np.array(2.0, np.float32), "lo": np.array(1e-10, np.float32),
               "hi": np.array(np.inf, np.float32), "ax1": np.array([1], np.int64)}
    nodes = [helper.make_node("Unsqueeze", ["wav", "ax1"], ["wav3"], name="as_channels")]
    for part, w in (("re", "cos_w"), ("im", "sin_w")):
        nodes += [
            helper.make_node("Conv", ["wav3", w], [f"{part}_c"], name=f"conv_{part}", strides=[HOP]),
            helper.make_node("Unsqueeze", [f"{part}_c", "ax1"], [f"{part}_u"], name=f"unsq_{part}"),
            helper.make_node("Transpose", [f"{part}_u"], [part], name=f"tr_{part}", perm=[0, 1, 3, 2]),
            helper.make_node("Pow", [part, "two"], [f"{part}2"], name=f"sq_{part}")]
    nodes += [helper.make_node("Add", ["re2", "im2"], ["pw"], name="power"),
              helper.make_node("MatMul", ["pw", "mel_w"], ["mel"], name="mel"),
              helper.make_node("Clip", ["mel", "lo", "hi"], ["floored"], name="floor"),
              helper.make_node("Log", ["floored"], ["y"], name="log")]
    graph = helper.make_graph(
        nodes, "melspec",
        [helper.make_tensor_value_info("wav", TensorProto.FLOAT, [1, (FRAMES - 1) * HOP + FRAME])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, FRAMES, MELS])],
        [numpy_helper.from_array(v, n) for n, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _tones(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Loud tones on bins 1-3, tones 50 dB down on bins 5-8, peaks at int16 scale."""
    rng = np.random.default_rng(seed)
    t = np.arange((FRAMES - 1) * HOP + FRAME)
    level = np.array([1, 1, 1, 0, 3e-3, 3e-3, 3e-3, 3e-3])
    out = []
    for _ in range(n):
        amps, phases = rng.uniform(0.3, 1.0, BINS) * level, rng.uniform(0, 2 * np.pi, BINS)
        wav = sum(a * np.cos(2 * np.pi * f * t / FRAME + p)
                  for f, a, p in zip(range(1, BINS + 1), amps, phases, strict=True))
        out.append({"wav": (wav / np.abs(wav).max() * 32767).reshape(1, -1).astype(np.float32)})
    return out


def test_stft_through_layout_ops_goes_fp16_when_only_the_chain_is_too_wide():
    # the Log's input (the mel bands) fits FP16's normal range once scaled, the power spectrum
    # before the filter bank does not: the Convs are scaled (through Unsqueeze, Transpose) into
    # FP16 and only the squares..Log chain stays FP32
    proto = _mel_model()
    model = Model(proto=proto, path="mel.onnx", digest="mel")
    samples = _tones(6, 1)
    stats = calibrate(model, samples)
    mel, pw = stats.tensors["mel"], stats.tensors["pw"]
    room = 32752 / 2.0**-14
    assert mel.absmax / mel.min < room < pw.absmax / mel.min
    result = convert(model, load_profile("generic"), samples, stats=stats, holdout=_tones(3, 2))
    assert result, result.to_dict()["verdict"]
    assert set(result.pinned_nodes) == {"sq_re", "sq_im", "power", "mel", "floor", "log"}
    (scaled,) = [r for r in result.plan.rescales() if "log" in r.absorbers]
    assert {"re", "im", "re_u", "im_u"} <= set(scaled.domain)
    for check in (result.output_check, result.holdout):
        (y,) = check.outputs.values()
        assert y["nonfinite"] == 0 and y["rel_l2"] <= 1e-2


def _log_power_model() -> onnx.ModelProto:
    # wav -> Conv(cos), Conv(sin) -> re*re + im*im -> Sqrt -> Pow 2 -> Max(1e-12, .) -> Log
    #     -> Div(ln 10) -> y   (DNSMOS P.835's front end: no overflow, a floor far under FP16)
    t, freqs, window = np.arange(FRAME), np.arange(1, BINS + 1), np.hanning(FRAME)
    cos = (np.cos(2 * np.pi * np.outer(freqs, t) / FRAME) * window)[:, None, :]
    sin = (np.sin(2 * np.pi * np.outer(freqs, t) / FRAME) * window)[:, None, :]
    weights = {"cos_w": cos.astype(np.float32), "sin_w": sin.astype(np.float32),
               "two": np.array(2.0, np.float32), "floor_c": np.array(1e-12, np.float32),
               "ln10": np.array(np.log(10), np.float32)}
    nodes = [helper.make_node("Conv", ["wav", "cos_w"], ["re"], name="stft_re", strides=[HOP]),
             helper.make_node("Conv", ["wav", "sin_w"], ["im"], name="stft_im", strides=[HOP]),
             helper.make_node("Mul", ["re", "re"], ["re2"], name="sq_re"),
             helper.make_node("Mul", ["im", "im"], ["im2"], name="sq_im"),
             helper.make_node("Add", ["re2", "im2"], ["pw"], name="power"),
             helper.make_node("Sqrt", ["pw"], ["mag"], name="magnitude"),
             helper.make_node("Pow", ["mag", "two"], ["pw2"], name="pow"),
             helper.make_node("Max", ["floor_c", "pw2"], ["floored"], name="floor"),
             helper.make_node("Log", ["floored"], ["ln"], name="log"),
             helper.make_node("Div", ["ln", "ln10"], ["y"], name="log10")]
    graph = helper.make_graph(
        nodes, "log_power",
        [helper.make_tensor_value_info("wav", TensorProto.FLOAT, [1, 1, (FRAMES - 1) * HOP + FRAME])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, BINS, FRAMES])],
        [numpy_helper.from_array(v, n) for n, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _faded_speech(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Tones at +-0.6 full scale, a fade-in 80 dB down and zero padding at the end."""
    rng = np.random.default_rng(seed)
    t = np.arange((FRAMES - 1) * HOP + FRAME)
    out = []
    for _ in range(n):
        amps, phases = rng.uniform(0.3, 1.0, BINS), rng.uniform(0, 2 * np.pi, BINS)
        wav = sum(a * np.cos(2 * np.pi * f * t / FRAME + p)
                  for f, a, p in zip(range(1, BINS + 1), amps, phases, strict=True))
        wav = wav / np.abs(wav).max() * 0.6
        wav[: 3 * HOP] *= 1e-4
        wav[-2 * HOP:] = 0.0
        out.append({"wav": wav.reshape(1, 1, -1).astype(np.float32)})
    return out


def test_power_under_fp16_before_a_far_floor_keeps_the_chain_fp32():
    # the power underflows FP16 (quiet frames) and the Log reads a 1e-12 floor (padding): no
    # scale keeps both ends, so squares..Log stay FP32 and the STFT Convs stay FP16; before,
    # FP16 flushed the floor to 0 and the Log gave -inf
    proto = _log_power_model()
    model = Model(proto=proto, path="log_power.onnx", digest="log_power")
    samples = _faded_speech(6, 1)
    stats = calibrate(model, samples)
    assert stats.tensors["pw"].fraction_below(2.0**-14) > 0.01
    assert stats.tensors["floored"].absmax < 65504 and stats.tensors["floored"].min < 1e-11
    result = convert(model, load_profile("generic"), samples, stats=stats,
                     holdout=_faded_speech(3, 2), max_fp32_share=1.0)
    assert result, result.to_dict()["verdict"]
    assert set(result.pinned_nodes) == {"sq_re", "sq_im", "power", "magnitude", "pow", "floor",
                                        "log"}
    for check in (result.output_check, result.holdout):
        (y,) = check.outputs.values()
        assert y["nonfinite"] == 0 and y["rel_l2"] <= 1e-2
