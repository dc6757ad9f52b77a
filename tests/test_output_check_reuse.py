"""The output check takes the emulated outputs the compare pass already computed: on a target
that cannot pin they are the same emulation's; elsewhere only where the lowered model's own
emulation gives the first of them bit for bit, else it runs on every sample."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import npuprep.verify.output_check as output_check
from npuprep.convert import convert
from npuprep.model_io import load_model
from npuprep.numerics import get_format
from npuprep.profiles import Pinning, load_profile
from npuprep.rewrite.lower import lower
from npuprep.runtime.session import make_session, run
from npuprep.verify.compare import compare_models
from npuprep.verify.emulate import emulate
from npuprep.verify.output_check import check_output_sets

FP16 = get_format("fp16")
RNG = np.random.default_rng(33)


def _model() -> onnx.ModelProto:
    # x[2,64] -> MatMul(W) -> Exp -> Mul(x) -> y : FP16 rounding shows in y
    w = (RNG.standard_normal((64, 64)) * 0.3).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
         helper.make_node("Exp", ["h"], ["e"], name="exp"),
         helper.make_node("Mul", ["e", "x"], ["y"], name="mul")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])],
        [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _samples(n: int) -> list[dict[str, np.ndarray]]:
    return [{"x": RNG.uniform(-1, 1, (2, 64)).astype(np.float32)} for _ in range(n)]


def _alone(model: onnx.ModelProto, samples: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    session = make_session(model)
    return [run(session, feed, ["y"])["y"] for feed in samples]


def test_the_compare_pass_hands_back_the_candidates_outputs():
    model, samples = _model(), _samples(3)
    emulation = emulate(model, FP16, saturate=False, weights_in_graph=True).model
    reference, candidate = [], []
    compare_models(model, emulation, samples, rtol=1e-2, atol=1e-3, fmt=FP16,
                   reference_outputs=reference, candidate_outputs=candidate)
    assert [set(c) for c in candidate] == [{"y"}] * 3
    for got, want in zip(candidate, _alone(emulation, samples), strict=True):
        np.testing.assert_array_equal(got["y"], want)
    for got, want in zip(reference, _alone(model, samples), strict=True):
        np.testing.assert_array_equal(got["y"], want)
    # The emulation rounds: its outputs are not the reference's.
    assert not np.array_equal(candidate[0]["y"], reference[0]["y"])


def _counted_runs(monkeypatch) -> list[tuple[str | None, int]]:
    calls: list[tuple[str | None, int]] = []
    real = output_check._outputs

    def counted(model, samples, optimize=True, produced=None, source=None):
        calls.append((produced, len(samples)))
        return real(model, samples, optimize=optimize, produced=produced, source=source)

    monkeypatch.setattr(output_check, "_outputs", counted)
    return calls


def _lowered_and_plan_outputs(samples):
    model = _model()
    lowered = lower(model, FP16).model
    plan_emulation = emulate(model, FP16, saturate=False, weights_in_graph=True).model
    return model, lowered, [{"y": y} for y in _alone(plan_emulation, samples)]


def test_outputs_the_lowered_emulation_reproduces_are_not_run_again(monkeypatch):
    calib, held = _samples(5), _samples(2)
    model, lowered, given = _lowered_and_plan_outputs(calib)
    full = check_output_sets(model, lowered, FP16, [calib, held], saturate=False, rtol=1e-2)
    calls = _counted_runs(monkeypatch)
    reused = check_output_sets(model, lowered, FP16, [calib, held], saturate=False, rtol=1e-2,
                               emulated_outputs=given)
    # The lowered model's emulation ran on the first calibration sample and the held-out ones.
    assert ("the emulated model", 1 + len(held)) in calls
    assert sum(n for who, n in calls if who == "the emulated model") == 1 + len(held)
    assert reused[0].from_compare == len(calib) and reused[1].from_compare == 0
    assert reused[0].to_dict()["samples_emulated_in_compare"] == len(calib)
    for a, b in zip(full, reused, strict=True):
        assert a.outputs == b.outputs and bool(a) == bool(b)


def test_outputs_the_lowered_emulation_does_not_reproduce_are_run_again(monkeypatch):
    calib, held = _samples(4), _samples(1)
    model, lowered, given = _lowered_and_plan_outputs(calib)
    off = [{"y": o["y"] + np.float32(0.5)} for o in given]  # not what the lowered model computes
    full = check_output_sets(model, lowered, FP16, [calib, held], saturate=False, rtol=1e-2)
    calls = _counted_runs(monkeypatch)
    checked = check_output_sets(model, lowered, FP16, [calib, held], saturate=False, rtol=1e-2,
                                emulated_outputs=off)
    assert sum(n for who, n in calls if who == "the emulated model") == len(calib) + len(held)
    assert checked[0].from_compare == 0
    for a, b in zip(full, checked, strict=True):
        assert a.outputs == b.outputs


def test_outputs_of_the_same_emulation_are_taken_as_given(monkeypatch):
    # A target that cannot pin: the check runs the compare pass's own emulation, so its
    # outputs on the calibration samples are used as they are (shown by a deliberate offset).
    calib = _samples(3)
    model, lowered, given = _lowered_and_plan_outputs(calib)
    everywhere = emulate(model, FP16, saturate=False, weights_in_graph=True).model
    calls = _counted_runs(monkeypatch)
    honest = check_output_sets(model, lowered, FP16, [calib], saturate=False, rtol=1e-2,
                               emulated=everywhere, emulated_outputs=given)[0]
    off = check_output_sets(model, lowered, FP16, [calib], saturate=False, rtol=1e-2,
                            emulated=everywhere, emulated_outputs=[{"y": o["y"] * 2} for o in given])[0]
    assert not [c for c in calls if c[0] == "the emulated model" and c[1]]
    assert honest and honest.from_compare == 3
    assert not off and off.outputs["y"]["rel_l2"] > 0.5


@pytest.mark.parametrize("target", ["a2000", "rk3588"])
def test_convert_takes_the_compare_pass_outputs_with_the_same_verdict(tmp_path, monkeypatch, target):
    path = tmp_path / "m.onnx"
    onnx.save(_model(), str(path))
    calib, held = _samples(6), _samples(2)
    profile = load_profile(target)
    calls = _counted_runs(monkeypatch)
    result = convert(load_model(path), profile, calib, holdout=held)
    assert result.output_check.from_compare == len(calib)
    assert sum(n for who, n in calls if who == "the emulated model") <= 1 + len(held)
    # The same numbers as the check without them (a target that cannot pin runs the compare
    # pass's own emulation of every node).
    monkeypatch.undo()
    everywhere = emulate(result.rewritten, FP16, saturate=profile.resolve().saturate, weights_in_graph=True).model \
        if profile.fp32_pinning is Pinning.NONE else None
    full = check_output_sets(load_model(path).proto, result.lowered.model, FP16, [calib, held],
                             saturate=profile.resolve().saturate, rtol=result.output_check.rtol,
                             emulated=everywhere, host_scales=result.host_scales)
    assert full[0].outputs == result.output_check.outputs
    assert full[1].outputs == result.holdout.outputs
