"""Models onnx.checker accepts but our zoo never has: each works or is one line, never a traceback."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper
from onnx import numpy_helper as nh

from npuprep.flops import node_flops
from tests.conftest import run_cli

vi = helper.make_tensor_value_info
W = nh.from_array((np.random.default_rng(0).standard_normal((4, 3)) * 300).astype(np.float32), "W")


def _model(name, nodes, ins, outs, inits=(), extra_opsets=()):
    graph = helper.make_graph(nodes, name, ins, outs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), *extra_opsets],
                              ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


ODD = {
    # x[4] -> MatMul(W) -> h[3] -> Mul(h, h) -> y   (rank-1 operand)
    "rank1": (lambda: _model("rank1", [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
                                       helper.make_node("Mul", ["h", "h"], ["y"], name="sq")],
                             [vi("x", T.FLOAT, [4])], [vi("y", T.FLOAT, [3])], [W]),
              lambda r: {"x": r.standard_normal(4).astype(np.float32)}),
    # x[N,T,4] -> MatMul(W) -> Exp -> y   (symbolic dims)
    "dynamic": (lambda: _model("dynamic", [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
                                           helper.make_node("Exp", ["h"], ["y"], name="exp")],
                               [vi("x", T.FLOAT, ["N", "T", 4])], [vi("y", T.FLOAT, ["N", "T", 3])], [W]),
                lambda r: {"x": (r.standard_normal((2, 5, 4)) * 0.01).astype(np.float32)}),
    # x -> ai.onnx.ml.Scaler(x300) -> Mul(s, s) -> ai.onnx.ml.LinearRegressor -> y
    "ml_domain": (lambda: _model(
        "ml_domain",
        [helper.make_node("Scaler", ["x"], ["s"], domain="ai.onnx.ml", offset=[0.0] * 4,
                          scale=[300.0] * 4, name="scaler"),
         helper.make_node("Mul", ["s", "s"], ["sq"], name="sq"),
         helper.make_node("LinearRegressor", ["sq"], ["y"], domain="ai.onnx.ml",
                          coefficients=[1.0] * 4, intercepts=[0.0], name="lr")],
        [vi("x", T.FLOAT, [2, 4])], [vi("y", T.FLOAT, [2, 1])],
        extra_opsets=[helper.make_opsetid("ai.onnx.ml", 3)]),
        lambda r: {"x": r.standard_normal((2, 4)).astype(np.float32)}),
    # x -> MatMul(W) -> com.microsoft.Gelu -> y
    "ms_domain": (lambda: _model(
        "ms_domain", [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
                      helper.make_node("Gelu", ["h"], ["y"], domain="com.microsoft", name="gelu")],
        [vi("x", T.FLOAT, [2, 4])], [vi("y", T.FLOAT, [2, 3])], [W],
        extra_opsets=[helper.make_opsetid("com.microsoft", 1)]),
        lambda r: {"x": r.standard_normal((2, 4)).astype(np.float32)}),
    # a:int64 + b:int64 -> y   (no float tensor at all)
    "no_float": (lambda: _model("no_float", [helper.make_node("Add", ["a", "b"], ["y"], name="add")],
                                [vi("a", T.INT64, [3]), vi("b", T.INT64, [3])], [vi("y", T.INT64, [3])]),
                 lambda r: {"a": r.integers(0, 5, 3), "b": r.integers(0, 5, 3)}),
    # outputs: the input x itself, Relu(x), and the initializer W
    "passthrough": (lambda: _model("passthrough", [helper.make_node("Relu", ["x"], ["r"], name="relu")],
                                   [vi("x", T.FLOAT, [2, 4])],
                                   [vi("x", T.FLOAT, [2, 4]), vi("r", T.FLOAT, [2, 4]),
                                    vi("W", T.FLOAT, [4, 3])], [W]),
                    lambda r: {"x": r.standard_normal((2, 4)).astype(np.float32)}),
}


@pytest.mark.parametrize("name", sorted(ODD))
def test_convert_and_probe_never_trace_back(tmp_path, name):
    build, feed = ODD[name]
    path = tmp_path / f"{name}.onnx"
    onnx.save(build(), str(path))
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        np.savez(data / f"{i}.npz", **feed(np.random.default_rng(i)))
    out = tmp_path / "out" / f"{name}.onnx"
    for command in (("convert", path, "--target", "a2000", "--data", data, "-o", out),
                    ("probe", path, "--target", "a2000")):
        done = run_cli(*command)
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        assert done.returncode in (0, 1, 2)
        if done.returncode == 2:
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    # a FAILED conversion is written beside the requested name
    if not out.is_file():
        out = out.with_suffix(".FAILED.onnx")
    assert out.is_file()
    if name == "ml_domain":
        # Its ai.onnx.ml ops have no FP16 kernels: their FP32 does not fail the share gate.
        assert run_cli("convert", path, "--target", "a2000", "--data", data, "-o",
                       tmp_path / "again.onnx").returncode == 0
    converted = onnx.load(str(out))
    onnx.checker.check_model(converted, full_check=True)


def test_flops_of_rank_0_1_and_unknown_operands():
    # v[4] -> MatMul(v, W) -> h[3];  u[a,b] (symbolic) -> Gemm(u, W2) -> g
    w2 = nh.from_array(np.ones((4, 3), np.float32), "W2")
    model = _model("ranks", [helper.make_node("MatMul", ["v", "W"], ["h"], name="mv"),
                             helper.make_node("Gemm", ["u", "W2"], ["g"], name="gemm")],
                   [vi("v", T.FLOAT, [4]), vi("u", T.FLOAT, ["a", "b"])],
                   [vi("h", T.FLOAT, [3]), vi("g", T.FLOAT, ["a", 3])], [W, w2])
    flops = node_flops(model)
    assert flops["mv"] == 2 * 3 * 4  # a vector times a matrix: 3 outputs of 4 multiply-adds
    assert flops["gemm"] == 1  # unknown shapes count as one element


def test_flops_of_a_dynamic_conv_stack_are_counted_at_the_sample_size():
    # x[1,3,H,W] (dynamic) -> Conv(3x3, 8 out) -> c -> Relu -> y
    w = nh.from_array(np.ones((8, 3, 3, 3), np.float32), "Wc")
    model = _model("dyn", [helper.make_node("Conv", ["x", "Wc"], ["c"], name="conv", pads=[1, 1, 1, 1]),
                           helper.make_node("Relu", ["c"], ["y"], name="relu")],
                   [vi("x", T.FLOAT, [1, 3, "H", "W"])], [vi("y", T.FLOAT, [1, 8, "H", "W"])], [w])
    unsized = node_flops(model)
    sized = node_flops(model, {"x": (1, 3, 48, 320)})
    assert sized["conv"] == 2 * (8 * 48 * 320) * (3 * 3 * 3)
    assert sized["relu"] == 8 * 48 * 320
    assert unsized["conv"] < sized["conv"] // 1000  # without sizes a dynamic Conv is nearly free
    # The model itself keeps its dynamic axes.
    assert model.graph.input[0].type.tensor_type.shape.dim[2].dim_param == "H"
