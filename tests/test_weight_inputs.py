"""Weights an old exporter also listed as graph inputs (overridable initialisers) in 8 bits.

The 8-bit model's weights are quantised constants under new names: the graph input of the
same name would be left with no value (required by onnxruntime, fed by no sample).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.graph import without_weight_inputs
from npuprep.runtime.session import make_session, run
from tests.conftest import run_cli


def legacy_model() -> onnx.ModelProto:
    """x, w(input and initialiser) -> Conv -> a -> MaxPool -> y   (opset 10, IR 4)"""
    w = numpy_helper.from_array(
        np.random.default_rng(3).standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3, "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["a"], pads=[1, 1, 1, 1]),
         helper.make_node("MaxPool", ["a"], ["y"], kernel_shape=[2, 2], strides=[2, 2])],
        "legacy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8]),
                   helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 3, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 10)])
    model.ir_version = 4
    onnx.checker.check_model(model)
    return model


def test_weight_inputs_are_dropped_and_named():
    model = legacy_model()
    kept, listed = without_weight_inputs(model)
    assert listed == ["w"] and [i.name for i in kept.graph.input] == ["x"]
    assert [i.name for i in model.graph.input] == ["x", "w"]  # the caller's model untouched
    again, none = without_weight_inputs(kept)
    assert again is kept and none == []


def test_an_8bit_conversion_of_a_model_listing_its_weights_as_inputs(tmp_path):
    model = legacy_model()
    path = tmp_path / "legacy.onnx"
    onnx.save(model, str(path))
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1, 3, 8, 8)).astype(np.float32) for _ in range(4)]
    for i, x in enumerate(xs):
        np.savez(data / f"{i}.npz", x=x)
    for precision in ("int8", "fp8_e4m3"):
        out = tmp_path / f"legacy.{precision}.onnx"
        done = run_cli("convert", path, "--target", "a2000", "--precision", precision,
                       "--data", data, "-o", out)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "'w') are constants" in " ".join(done.stdout.split())
        written = onnx.load(str(out))
        assert [i.name for i in written.graph.input] == ["x"]
        want = run(make_session(model), {"x": xs[0]})["y"]
        got = run(make_session(written), {"x": xs[0]})["y"]
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05


def test_the_saturation_probe_amplifies_a_weight_listed_as_an_input(tmp_path):
    path = tmp_path / "legacy.onnx"
    onnx.save(legacy_model(), str(path))
    done = run_cli("probe", path, "--target", "a2000", "--json")
    assert done.returncode in (0, 1), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "please report" not in done.stderr
    assert "Conv" in done.stdout
