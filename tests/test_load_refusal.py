"""A model onnx.checker accepts and onnxruntime refuses: calibration's one-line error names the
user's file and the node, never npuprep's temporary calibration graph beside it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from npuprep.runtime.session import refusal
from tests.conftest import run_cli


def broken(folder: Path, *, external: bool) -> Path:
    """x[1,4] -> Relu -> MatMul(w[3,3000]) -> y: the checker (no shape inference) passes it,
    onnxruntime's shape inference refuses the MatMul. `external`: w in m.data beside it (the
    calibration graph is then written into that folder for onnxruntime to map the weights)."""
    w = numpy_helper.from_array(np.ones((3, 3000), np.float32), "w")
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                           helper.make_node("MatMul", ["r", "w"], ["y"], name="bad_mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3000])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    path = folder / "m.onnx"
    onnx.save(model, path, save_as_external_data=external, location="m.data", size_threshold=0)
    return path


@pytest.mark.parametrize("external", [True, False], ids=["external_data", "inline"])
def test_calibration_names_the_users_file_and_the_node(tmp_path: Path, external: bool) -> None:
    broken(tmp_path, external=external)
    before = sorted(p.name for p in tmp_path.iterdir())
    done = run_cli("calibrate", "m.onnx", "--synthetic", "2", "-o", "s.json", cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("npuprep: error: m.onnx: onnxruntime cannot load it: node 'bad_mm' "
                                  "(MatMul): [ShapeInferenceError] Incompatible dimensions")
    assert ".npuprep-calibrate" not in done.stderr and "Load model from" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_onnxruntime_s_wording_is_trimmed_to_the_node_and_the_reason() -> None:
    assert refusal("[ONNXRuntimeError] : 1 : FAIL : Load model from /tmp/.npuprep-calibrate-x.onnx "
                   "failed:Node (mm) Op (MatMul) [ShapeInferenceError] Incompatible dimensions") == \
        "node 'mm' (MatMul): [ShapeInferenceError] Incompatible dimensions"
    assert refusal("[ONNXRuntimeError] : 1 : FAIL : Type Error: Type parameter (T) of Optype (Add) "
                   "bound to different types (tensor(float) and tensor(int64) in node (add).") == \
        "node 'add': Type Error: Type parameter (T) of Optype (Add) bound to different types " \
        "(tensor(float) and tensor(int64)"
    # No node named: the reason as onnxruntime gives it, less its status prefix.
    assert refusal("[ONNXRuntimeError] : 10 : INVALID_GRAPH : This is an invalid model.") == \
        "This is an invalid model."


def test_a_kernel_onnxruntime_cannot_build_is_the_user_s_model_refused_in_one_line(tmp_path: Path) -> None:
    # x [2, 5, 3] (batch first) -> GRU(layout=1) -> y: valid ONNX, no CPU kernel for layout 1
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((1, 12, 3)).astype(np.float32), "w")
    r = numpy_helper.from_array(rng.standard_normal((1, 12, 4)).astype(np.float32), "r")
    g = helper.make_graph([helper.make_node("GRU", ["x", "w", "r"], ["y"], name="gru",
                                            hidden_size=4, layout=1)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 1, 4])],
                          [w, r])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    onnx.checker.check_model(model)
    onnx.save(model, tmp_path / "m.onnx")
    for metric in ("auto", "rel-l2"):
        done = run_cli("convert", "m.onnx", "--target", "a2000", "--synthetic", "4",
                       "--metric", metric, "--out", "o.onnx", cwd=tmp_path)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert done.stderr.startswith("npuprep: error: m.onnx: onnxruntime cannot load it: "
                                      "layout_ == 0 was false. Batchwise recurrent operations")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
