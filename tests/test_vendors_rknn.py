"""rknn-toolkit2 as a subprocess: log parsing always, builds and simulator runs with the venv."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from npuprep.errors import NpuprepError
from npuprep.vendors.rockchip import error_lines, range_warnings, run_rknn, vendor_python

LOG = (
    "I rknn building ...\n"
    "\x1b[1;33mW\x1b[0m \x1b[1;33minference: The range [0.0, inf] of 'r1' is out of the "
    "float16!\x1b[0m\n"
    "E build: Traceback (most recent call last):\n"
    "  File \"rknn/api/rknn_base.py\", line 2065, in build\n"
    "ValueError: The input shape ['batch', 3] of 'images' is not support!\n"
    "E rknn-toolkit2 version: 2.5.0\n"
)


def _conv_relu(gain: float) -> onnx.ModelProto:
    """x[1,4,8,8] -> Conv(w * gain, 3x3) -> c1 -> Relu -> y"""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((4, 4, 3, 3)) * 0.3 * gain)
                                .astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c1"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c1"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    from npuprep.runtime.session import make_session, run

    return run(make_session(model), {"x": x})["y"]


def test_log_parsing_finds_the_refusal_and_the_range_warning():
    assert error_lines(LOG) == ["ValueError: The input shape ['batch', 3] of 'images' is not support!"]
    assert range_warnings(LOG) == [{"tensor": "r1", "lo": "0.0", "hi": "inf"}]


# What rknn-toolkit2 2.5.0 logged for a model with BF16 weights (nudenet_bf16 of the corpus):
# its constant folding runs onnxruntime, whose error it re-raises as `ValueError: Traceback`.
BF16_LOG = (
    "E build: Traceback (most recent call last):\n"
    '  File "rknn/api/graph_optimizer.py", line 970, in fold_constant\n'
    "onnxruntime.capi.onnxruntime_pybind11_state.InvalidArgument: [ONNXRuntimeError] : 2 : "
    "INVALID_ARGUMENT : Unexpected input data type. Actual: (tensor(uint16)) , expected: "
    "(tensor(bfloat16))\n"
    "E rknn-toolkit2 version: 2.5.0\n"
    "During handling of the above exception, another exception occurred:\n"
    "ValueError: Traceback (most recent call last):\n"
    "rknn_job: failed in build\n"
)


def test_the_refusal_is_the_real_exception_not_the_toolkits_rewrapping():
    assert error_lines(BF16_LOG) == [
        "onnxruntime.capi.onnxruntime_pybind11_state.InvalidArgument: [ONNXRuntimeError] : 2 : "
        "INVALID_ARGUMENT : Unexpected input data type. Actual: (tensor(uint16)) , expected: "
        "(tensor(bfloat16))"]


def test_a_vendor_crash_names_the_signal_and_the_step_it_crashed_in(tmp_path):
    """A stand-in for the vendor python that reaches build and dies of SIGSEGV, as
    rknn-toolkit2 2.5.0 does building the corpus's diffusion UNet."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'rknn_job: stage load_onnx' >&2\n"
                    "echo 'rknn_job: stage build' >&2\nkill -SEGV $$\n")
    fake.chmod(0o755)
    run = run_rknn(_conv_relu(1.0), [{"x": np.ones((1, 4, 8, 8), np.float32)}], python=fake,
                   work_dir=tmp_path / "work")
    assert not run
    assert run.stage == "build (crashed)"
    assert run.refusal == "the vendor process crashed (signal 11) in build"


def test_a_missing_vendor_python_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("NPUPREP_RKNN_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(NpuprepError, match="NPUPREP_RKNN_PYTHON.*make_rknn_venv.sh"):
        vendor_python()


def test_simulator_matches_fp32_on_a_small_conv(rknn_python, tmp_path):
    model = _conv_relu(1.0)
    x = np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32)
    run = run_rknn(model, [{"x": x}], python=rknn_python, accuracy=True, work_dir=tmp_path)
    assert run, run.log[-2000:]
    ref = _reference(model, x)
    got = run.outputs[0]["y"].reshape(ref.shape)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-3
    assert "[Conv] c1" in run.accuracy_report


def test_simulator_overflow_is_loud_and_warned(rknn_python, tmp_path):
    model = _conv_relu(1e5)
    x = np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32)
    assert np.abs(_reference(model, x)).max() > 65504
    run = run_rknn(model, [{"x": x}], python=rknn_python, accuracy=True, work_dir=tmp_path)
    assert run
    assert np.isinf(run.outputs[0]["y"]).any()
    # accuracy_analysis warns about the tensor that left FP16, and marks its rows q_inf.
    assert "y" in {w["tensor"] for w in run.range_warnings}
    assert "q_inf" in run.accuracy_report or "q_nan" in run.accuracy_report


def test_a_refused_model_reports_the_stage_and_the_vendor_message(rknn_python, tmp_path):
    """x[N?,4] -> If(cond) reading an outer tensor in its branch: the toolkit's build fails."""
    outer = helper.make_node("Relu", ["x"], ["h"])
    branch = helper.make_graph([helper.make_node("ReduceMean", ["h"], ["m"], keepdims=0)], "b",
                               [], [helper.make_tensor_value_info("m", TensorProto.FLOAT, None)])
    node = helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)
    graph = helper.make_graph(
        [outer, node], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    run = run_rknn(model, [{"x": np.ones((2, 4), np.float32), "c": np.array(True)}],
                   python=rknn_python, work_dir=tmp_path)
    assert not run
    assert run.stage in ("load_onnx", "build")
    assert run.refusal
