"""An STFT written as a Conv on raw audio whose chunks span 50 dB: no one 8-bit scale holds its
input (INT8 flushes the quiet chunks, FP8's noise floor drowns the weak bins of the loud ones),
two INT8 passes (the input rounded, and its residual) do."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.model_io import Model
from npuprep.numerics import eight_bit_format
from npuprep.pipeline.stages import CALIBRATE, convert
from npuprep.plan.plan import load_plan, save_plan
from npuprep.profiles import load_profile
from npuprep.rewrite.input_split import split_input
from npuprep.runtime.session import make_session, run
from npuprep.verify.output_errors import worst_pooled_rel_l2
from npuprep.verify.qdq_model import activation_scale, quantise

WINDOW, HOP, BINS, LENGTH = 64, 32, 33, 512


def stft_model() -> onnx.ModelProto:
    # audio [1,1,512] -> Conv(Hann-windowed DFT basis, 66 ch) -> re^2 + im^2 -> Log(+1e-5)
    #   -> Conv 1x1 (33 -> 4) -> features
    n = np.arange(WINDOW)
    hann = 0.5 - 0.5 * np.cos(2 * np.pi * n / WINDOW)
    k = np.arange(BINS)[:, None]
    basis = np.concatenate([np.cos(2 * np.pi * k * n / WINDOW) * hann,
                            -np.sin(2 * np.pi * k * n / WINDOW) * hann])[:, None, :]
    mix = np.random.default_rng(0).normal(size=(4, BINS, 1)) / np.sqrt(BINS)
    inits = [numpy_helper.from_array(basis.astype(np.float32), "basis"),
             numpy_helper.from_array(mix.astype(np.float32), "mix"),
             numpy_helper.from_array(np.array([BINS], np.int64), "half"),
             numpy_helper.from_array(np.array([2 * BINS], np.int64), "end"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "axis"),
             numpy_helper.from_array(np.array(1e-5, np.float32), "eps")]
    nodes = [
        helper.make_node("Conv", ["audio", "basis"], ["spec"], name="stft",
                         kernel_shape=[WINDOW], strides=[HOP]),
        helper.make_node("Slice", ["spec", "zero", "half", "axis"], ["re"], name="re"),
        helper.make_node("Slice", ["spec", "half", "end", "axis"], ["im"], name="im"),
        helper.make_node("Mul", ["re", "re"], ["re2"], name="re2"),
        helper.make_node("Mul", ["im", "im"], ["im2"], name="im2"),
        helper.make_node("Add", ["re2", "im2"], ["power"], name="power"),
        helper.make_node("Add", ["power", "eps"], ["floored"], name="floored"),
        helper.make_node("Log", ["floored"], ["log_power"], name="log"),
        helper.make_node("Conv", ["log_power", "mix"], ["features"], name="mix"),
    ]
    graph = helper.make_graph(
        nodes, "stft", [helper.make_tensor_value_info("audio", TensorProto.FLOAT, [1, 1, LENGTH])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [1, 4, 15])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def chunks(seed: int, count: int) -> list[dict[str, np.ndarray]]:
    """Voiced speech (harmonics falling 12 dB per octave, peak about 0.4) and silence (noise at
    2e-3), alternately."""
    rng = np.random.default_rng(seed)
    t = np.arange(LENGTH) / 16000
    out = []
    for i in range(count):
        if i % 2 == 0:
            f0 = rng.uniform(110, 220)
            x = sum(np.cos(2 * np.pi * h * f0 * t + rng.uniform(0, 6.3)) / h**2
                    for h in range(1, 30))
            x = 0.25 * x + 1e-4 * rng.normal(size=LENGTH)
        else:
            x = 2e-3 * rng.normal(size=LENGTH)
        out.append({"audio": x.astype(np.float32).reshape(1, 1, LENGTH)})
    return out


def test_split_is_exact_in_fp32_and_holds_what_one_scale_cannot() -> None:
    from npuprep.calibrate.executors import calibrate

    model, feeds = stft_model(), chunks(1, 6)
    # Calibration forks its runs: before this process holds a session.
    stats = calibrate(Model(model, "", "stft"), feeds, detail="all")
    # At the scale the rounded part's own pair takes (abs-max, the samples' spread as headroom).
    int8 = eight_bit_format("int8")
    split = split_input(model, "stft", activation_scale(stats.tensors["audio"], int8, "absmax"),
                        int8)
    # The rounded part reads as its input does; the residual and the parts are measured.
    parts = [str(split.details["residual"]), *split.details["parts"]]  # type: ignore[misc]
    split_stats = replace(stats, tensors={
        **stats.tensors, str(split.details["rounded"]): stats.tensors["audio"],
        **calibrate(Model(split.model, "", "split"), feeds, detail="all", tensors=parts).tensors})
    ref_session = make_session(model)
    refs = [run(ref_session, f) for f in feeds]
    assert split and split.details["layer"] == "stft_residual"
    got = [run(make_session(split.model), f) for f in feeds]
    assert worst_pooled_rel_l2(got, refs) < 1e-5

    def worst_sample(m: onnx.ModelProto) -> float:
        session = make_session(m)
        return max(worst_pooled_rel_l2([run(session, f)], [r]) for f, r in zip(feeds, refs, strict=True))

    alone = {name: worst_sample(quantise(model, ["stft"], stats, eight_bit_format(name),
                                         saturate=True).model)
             for name in ("int8", "fp8_e4m3")}
    pair = worst_sample(quantise(split.model, ["stft", "stft_residual"], split_stats,
                                 eight_bit_format("int8"), saturate=True,
                                 rule="absmax").model)
    # One scale for both loud and quiet chunks errs past the 5e-2 gate in either format.
    assert min(alone.values()) > 0.1, alone
    assert pair < min(alone.values()) / 2, (pair, alone)



def test_convert_runs_the_stft_in_two_int8_passes() -> None:
    # The quiet chunks underflow FP16: the plan rescales the audio by 2 at the input
    # (audio__scaled), which the 8-bit decision must read too.
    result = convert(Model(stft_model(), "", "stft"), load_profile("a2000"), chunks(2, 8),
                     holdout=chunks(3, 4), stats=CALIBRATE, precision="int8")
    assert result.eight_bit is not None
    layers = {x.node: x.precision for x in result.plan.eight_bit}
    assert layers["stft"] == "int8" and layers["stft_residual"] == "int8", result.notes
    # Before: the STFT FP16 ("input 'audio__scaled' was not measured"), 3% in 8 bits, FAILED.
    assert result.eight_bit.eight_bit_share >= 0.9
    assert result.holdout is not None and result.holdout.worst_rel_l2 <= 5e-2
    assert result, result.verdict


def test_the_written_plan_splits_again(tmp_path: Path) -> None:
    # plan.yaml names the residual pass, a node only the conversion makes: it loads, and
    # convert with it makes the same split (no measurement: the plan decided it).
    model = Model(stft_model(), "", "stft")
    first = convert(model, load_profile("a2000"), chunks(2, 8), holdout=chunks(3, 4),
                    stats=CALIBRATE, precision="int8")
    plan = load_plan(save_plan(first.plan, tmp_path / "plan.yaml"), model)
    again = convert(model, load_profile("a2000"), chunks(2, 8), holdout=chunks(3, 4),
                    stats=CALIBRATE, precision="int8", plan=plan)
    assert again.eight_bit is not None and again, again.verdict
    assert again.eight_bit.eight_bit_share == first.eight_bit.eight_bit_share == 1.0
    assert again.holdout is not None and first.holdout is not None
    assert abs(again.holdout.worst_rel_l2 - first.holdout.worst_rel_l2) < 1e-3
