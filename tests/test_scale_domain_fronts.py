"""What real audio front ends hold between an STFT and its Log: the scale that keeps a power
spectrum in FP16 rides through each of them, and the Log absorbs it with one constant."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.model_io import Model
from npuprep.plan.decide import plan_for
from npuprep.profiles import load_profile

FRAME, HOP, BINS, FRAMES, MELS = 256, 128, 8, 8, 4


def _i64(name: str, values: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _f32(name: str, value: object) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _front(case: str) -> onnx.ModelProto:
    """wav -> Conv(cos|sin) -> spec -> [case's layout] -> re, im -> re^2 + im^2 -> [case's
    Sqrt/Pow/filter bank/floor] -> Log -> y (one diagram per case in CASES)."""
    t = np.arange(FRAME)
    freqs = np.arange(1, BINS + 1)
    window = np.hanning(FRAME)
    cos = (np.cos(2 * np.pi * np.outer(freqs, t) / FRAME) * window)[:, None, :]
    sin = (np.sin(2 * np.pi * np.outer(freqs, t) / FRAME) * window)[:, None, :]
    inits = [numpy_helper.from_array(np.concatenate([cos, sin]).astype(np.float32), "stft"),
             _i64("s0", [0]), _i64("s8", [BINS]), _i64("s16", [2 * BINS]), _i64("ax1", [1]),
             _i64("ax0", [0]), _i64("ax2", [2])]
    nodes = [helper.make_node("Conv", ["wav", "stft"], ["spec"], name="stft_conv", strides=[HOP])]
    src = "spec"
    if case == "unsqueeze_transpose":
        # spec -> Unsqueeze(0) -> Transpose -> Squeeze(0) -> (re, im)
        nodes += [helper.make_node("Unsqueeze", ["spec", "ax0"], ["u"], name="unsq"),
                  helper.make_node("Transpose", ["u"], ["tr"], name="tr", perm=[0, 1, 2, 3]),
                  helper.make_node("Squeeze", ["tr", "ax0"], ["sq"], name="squeeze")]
        src = "sq"
    nodes += [helper.make_node("Slice", [src, "s0", "s8", "ax1"], ["re"], name="take_re"),
              helper.make_node("Slice", [src, "s8", "s16", "ax1"], ["im"], name="take_im"),
              helper.make_node("Pow", ["re", "two"], ["re2"], name="sq_re"),
              helper.make_node("Mul", ["im", "im"], ["im2"], name="sq_im")]
    inits.append(_f32("two", 2.0))
    if case == "concat_reducesum":
        # re2, im2 -> Unsqueeze -> Concat -> ReduceSum -> power
        nodes += [helper.make_node("Unsqueeze", ["re2", "ax0"], ["re2u"], name="u_re"),
                  helper.make_node("Unsqueeze", ["im2", "ax0"], ["im2u"], name="u_im"),
                  helper.make_node("Concat", ["re2u", "im2u"], ["both"], name="cat", axis=0),
                  helper.make_node("ReduceSum", ["both", "ax0"], ["pw"], name="power", keepdims=0)]
    else:
        nodes.append(helper.make_node("Add", ["re2", "im2"], ["pw"], name="power"))
    last = "pw"
    if case == "sqrt_pow":
        # power -> Sqrt -> magnitude -> Pow(1.5)
        nodes += [helper.make_node("Sqrt", ["pw"], ["mag"], name="mag"),
                  helper.make_node("Pow", ["mag", "p"], ["comp"], name="compress")]
        inits.append(_f32("p", 1.5))
        last = "comp"
    if case == "filter_bank":
        # power [1, BINS, FRAMES] -> Transpose -> MatMul(non-negative mel bank) -> Transpose
        bank = np.abs(np.random.default_rng(0).standard_normal((BINS, MELS))).astype(np.float32)
        inits.append(_f32("mel", bank))
        nodes += [helper.make_node("Transpose", ["pw"], ["pwt"], name="to_frames", perm=[0, 2, 1]),
                  helper.make_node("MatMul", ["pwt", "mel"], ["melt"], name="mel_bank"),
                  helper.make_node("Transpose", ["melt"], ["mels"], name="to_bins", perm=[0, 2, 1])]
        last = "mels"
    floor = {"clip": "Clip", "add_eps": "Add"}.get(case, "Max")
    # The floor: Max(x, 1e-10), Clip(x, min=1e-10) (torch's clamp_min), or Add(x, 1e-10).
    inits.append(_f32("floor_c", 1e-10))
    nodes += [helper.make_node(floor, [last, "floor_c"], ["floored"], name="floor"),
              helper.make_node("Log", ["floored"], ["y"], name="log")]
    out_bins = MELS if case == "filter_bank" else BINS
    graph = helper.make_graph(
        nodes, f"front_{case}",
        [helper.make_tensor_value_info("wav", TensorProto.FLOAT, [1, 1, (FRAMES - 1) * HOP + FRAME])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, out_bins, FRAMES])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _audio(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Tones on every bin at int16 scale: power up to ~1e11, never near the floor."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        wav = _tones(rng)
        wav = wav / np.abs(wav).max() * rng.uniform(0.6, 1.0) * 32767.0
        out.append({"wav": wav.reshape(1, 1, -1).astype(np.float32)})
    return out


def _tones(rng: np.random.Generator) -> np.ndarray:
    """A tone on every bin, random amplitude and phase, over the frames' samples."""
    t = np.arange((FRAMES - 1) * HOP + FRAME)
    return sum(rng.uniform(0.3, 1.0) * np.cos(2 * np.pi * f * t / FRAME + rng.uniform(0, 6.28))
               for f in range(1, BINS + 1))


CASES = ["unsqueeze_transpose", "concat_reducesum", "sqrt_pow", "filter_bank", "clip", "add_eps"]


@pytest.mark.parametrize("case", CASES)
def test_the_scale_rides_through_the_front_end_and_the_log_absorbs_it(case):
    model = Model(proto=_front(case), path=f"{case}.onnx", digest=case)
    samples = _audio(4, 1)
    stats = calibrate(model, samples)
    result = convert(model, load_profile("generic"), samples, stats=stats, holdout=_audio(2, 2))
    assert result, result.to_dict()["verification"]
    (rescale,) = result.plan.rescales()
    assert "log" in rescale.absorbers and rescale.k > 0
    assert not result.pinned_nodes
    for check in (result.output_check, result.holdout):
        (y,) = check.outputs.values()
        assert y["nonfinite"] == 0 and y["rel_l2"] <= 1e-2


def _stft_model() -> onnx.ModelProto:
    """wav -> STFT (opset 17, onesided, Hann window) -> [1, frames, bins, 2] -> Mul(x, x) ->
    ReduceSum(last axis) -> power -> Add(1e-10) -> Log -> MatMul(proj) -> y."""
    window = np.hanning(FRAME).astype(np.float32)
    proj = np.random.default_rng(0).standard_normal((FRAME // 2 + 1, MELS)).astype(np.float32) * 0.1
    inits = [_f32("window", window), numpy_helper.from_array(np.array(HOP, np.int64), "step"),
             _i64("last", [-1]), _f32("eps", 1e-10), _f32("proj", proj),
             _i64("to_signal", [1, -1, 1])]
    nodes = [
        helper.make_node("Reshape", ["wav", "to_signal"], ["signal"], name="to_signal"),
        helper.make_node("STFT", ["signal", "step", "window"], ["spec"], name="stft", onesided=1),
        helper.make_node("Mul", ["spec", "spec"], ["sq"], name="square"),
        helper.make_node("ReduceSum", ["sq", "last"], ["pw"], name="power", keepdims=0),
        helper.make_node("Add", ["pw", "eps"], ["floored"], name="floor"),
        helper.make_node("Log", ["floored"], ["logpw"], name="log"),
        helper.make_node("MatMul", ["logpw", "proj"], ["y"], name="mel_proj"),
    ]
    graph = helper.make_graph(
        nodes, "stft_op",
        [helper.make_tensor_value_info("wav", TensorProto.FLOAT, [1, 1, (FRAMES - 1) * HOP + FRAME])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, FRAMES, MELS])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _noisy_audio(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """_audio with a noise floor at 1% of full scale, as a recording has: no bin is empty."""
    rng = np.random.default_rng(seed + 100)
    return [{"wav": (f["wav"] + 327.67 * rng.standard_normal(f["wav"].shape)).astype(np.float32)}
            for f in _audio(n, seed)]


def test_an_stft_op_takes_the_scale_and_only_the_chain_to_the_log_stays_fp32():
    # The ONNX STFT is linear in its signal: wav x 2^-k brings its bins within FP16, and only
    # the squares..Log chain (whose input spans wider than FP16's normal range) stays FP32.
    model = Model(proto=_stft_model(), path="stft.onnx", digest="stft")
    samples = _noisy_audio(4, 1)
    result = convert(model, load_profile("generic"), samples, stats=calibrate(model, samples),
                     holdout=_noisy_audio(2, 2))
    assert result, result.to_dict()["verification"]
    (rescale,) = result.plan.rescales()
    assert rescale.entry == "wav" and rescale.k > 0 and "log" in rescale.absorbers
    assert set(result.pinned_nodes) == {"square", "power", "floor", "log"}
    # The transform's multiply-adds are counted, and they run in FP16.
    assert result.flops_fp32_share < 0.01


def _transform_log(name: str, window: float, eps: float, norm: float | None = None) -> onnx.ModelProto:
    """wav -> Conv(cos|sin x window) -> spec [-> Transpose -> Mul(norm)] -> re, im -> re*re +
    im*im -> Add(eps) -> Log -> y (bins on axis 1, or on axis 2 after the Transpose)."""
    t = np.arange(FRAME)
    freqs = np.arange(1, BINS + 1)
    taper = np.hanning(FRAME) * window
    cos = (np.cos(2 * np.pi * np.outer(freqs, t) / FRAME) * taper)[:, None, :]
    sin = (np.sin(2 * np.pi * np.outer(freqs, t) / FRAME) * taper)[:, None, :]
    axis = 1 if norm is None else 2
    inits = [numpy_helper.from_array(np.concatenate([cos, sin]).astype(np.float32), "basis"),
             _i64("s0", [0]), _i64("s8", [BINS]), _i64("s16", [2 * BINS]), _i64("ax", [axis]),
             _f32("eps", eps)]
    nodes = [helper.make_node("Conv", ["wav", "basis"], ["spec"], name="transform", strides=[HOP])]
    bins = "spec"
    if norm is not None:
        inits.append(_f32("norm", norm))
        nodes += [helper.make_node("Transpose", ["spec"], ["spec_t"], name="to_time", perm=[0, 2, 1]),
                  helper.make_node("Mul", ["spec_t", "norm"], ["normed"], name="normalise")]
        bins = "normed"
    nodes += [helper.make_node("Slice", [bins, "s0", "s8", "ax"], ["re"], name="take_re"),
              helper.make_node("Slice", [bins, "s8", "s16", "ax"], ["im"], name="take_im"),
              helper.make_node("Mul", ["re", "re"], ["re2"], name="sq_re"),
              helper.make_node("Mul", ["im", "im"], ["im2"], name="sq_im"),
              helper.make_node("Add", ["re2", "im2"], ["pw"], name="power"),
              helper.make_node("Add", ["pw", "eps"], ["floored"], name="floor"),
              helper.make_node("Log", ["floored"], ["y"], name="log")]
    out = [1, BINS, FRAMES] if norm is None else [1, FRAMES, BINS]
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info("wav", TensorProto.FLOAT, [1, 1, (FRAMES - 1) * HOP + FRAME])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _quiet_transform() -> onnx.ModelProto:
    """wav -> Conv(cos|sin x 4e-2: a length-normalised basis, as a CQT has) -> re, im (mostly
    under FP16's smallest normal) -> re*re + im*im -> Add(1e-10) -> Log -> y."""
    return _transform_log("quiet_transform", 4e-2, 1e-10)

def _quiet_audio(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """_audio at unit scale, 30 dB quieter each sample, with the first frames digital silence (the
    Log reads its 1e-10 floor there, so its input spans wider than FP16)."""
    out = []
    for i, f in enumerate(_audio(n, seed)):
        wav = f["wav"] / 32767.0 * 0.03 ** i
        wav[..., : 2 * HOP + FRAME] = 0.0
        out.append({"wav": wav.astype(np.float32)})
    return out


def test_a_transform_under_fp16s_normal_range_is_lifted_into_it_before_its_fp32_log_chain():
    # The Log's input spans 1e-10 .. 0.8: the squares..Log chain stays FP32. The transform's
    # bins, under FP16's smallest normal, would keep a few bits each; the transform's weights
    # x 2^j lift them, the chain carries 2^2j to the Log, which absorbs it.
    model = Model(proto=_quiet_transform(), path="quiet.onnx", digest="quiet")
    samples = _quiet_audio(4, 1)
    stats = calibrate(model, samples)
    assert stats.tensors["floored"].max > 1e-10 * 2 ** 30
    result = convert(model, load_profile("generic"), samples, stats=stats,
                     holdout=_quiet_audio(3, 2))
    assert result, result.to_dict()["verification"]
    lift = next(r for r in result.plan.rescales() if "before the FP32 chain" in r.why)
    assert lift.k < 0 and lift.entry == "transform" and "log" in lift.absorbers
    assert "transform" not in result.pinned_nodes
    assert {"sq_re", "sq_im", "power", "floor", "log"} <= set(result.pinned_nodes)


def _normalised_transform() -> onnx.ModelProto:
    """wav -> Conv(cos|sin x 1e-6) -> spec -> Transpose -> Mul(14: a CQT's length
    normalisation) -> normed -> re, im -> re*re + im*im -> Add(1e-12) -> Log -> y."""
    return _transform_log("normalised_transform", 1e-6, 1e-12, norm=14.0)


def _swelling_audio(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Tones up to 1e4 swelling from e^-14 of that, after digital silence: the transform's
    bins span 7 decades, a third of them under FP16's smallest normal."""
    rng = np.random.default_rng(seed)
    t = np.arange((FRAMES - 1) * HOP + FRAME)
    out = []
    for _ in range(n):
        wav = _tones(rng)
        wav = wav / np.abs(wav).max() * 1e4 * np.exp(-25.0 * (1 - t / t.size))
        wav[: 2 * HOP + FRAME] = 0.0
        out.append({"wav": wav.reshape(1, 1, -1).astype(np.float32)})
    return out


def test_a_lift_before_an_fp32_log_chain_takes_the_place_of_a_lift_inside_it_not_on_top():
    # With every tensor's exponent histogram (as an 8-bit conversion calibrates), the
    # normalising Mul's own underflow is planned first: Mul x 2^8. The lift of the transform
    # feeding the FP32 squares..Log chain then reaches `normed` too; each within the limit
    # alone, both gave 0.46 x 2^24 there, Inf in FP16 (basic_pitch's CQT: its Mul x 2^2 and its
    # Convs x 2^10, 76800; FAILED in FP8 and FP16 alike). The lift now takes the Mul's place.
    model = Model(proto=_normalised_transform(), path="cqt.onnx", digest="cqt")
    samples = _swelling_audio(4, 1)
    stats = calibrate(model, samples, detail="all")
    generic = load_profile("generic")
    plan = plan_for(model, generic.resolve("fp16"), stats, samples).plan
    limit = generic.resolve("fp16").limit
    pinned = plan.pinned_nodes()
    for tensor in ("spec", "normed", "re", "im"):
        assert _total_exponent(plan, tensor) > 0 and tensor not in pinned
        assert stats.tensors[tensor].absmax * 2.0**_total_exponent(plan, tensor) <= limit, (
            tensor, plan.rescales())
    (lift,) = plan.rescales()
    assert lift.entry == "transform"
    assert {ref.tensor for ref in lift.findings} >= {"normed", "re2"}
    holdout = _swelling_audio(2, 2)
    assert convert(model, generic, samples, stats=stats, holdout=holdout)
    fp8 = convert(model, load_profile("a2000"), samples, stats=stats, holdout=holdout,
                  precision="fp8_e4m3")
    assert fp8, fp8.to_dict()["verdict"]


def _total_exponent(plan: object, tensor: str) -> int:
    """The power of two every rescale of `plan` puts on `tensor`, together."""
    return sum(rs.domain.get(tensor, 0) for rs in plan.rescales())  # type: ignore[attr-defined]
