"""BF16 everywhere: widened to FP32 exactly for onnxruntime, gone from the converted model."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper

from npuprep.bf16 import has_bf16, widen_bf16
from npuprep.runtime.session import make_session, run
from tests.conftest import run_cli

RNG = np.random.default_rng(5)


def bf(name: str, a: np.ndarray) -> onnx.TensorProto:
    a = np.asarray(a, ml_dtypes.bfloat16)
    return helper.make_tensor(name, TensorProto.BFLOAT16, a.shape, a.view(np.uint16).tobytes(), raw=True)


def bf16_mlp() -> onnx.ModelProto:
    """BF16 weights behind Casts (8 KB: handed to onnxruntime as arrays), a BF16 Constant, a
    BF16 round trip inside, a BF16 output.

    x -> MatMul(Cast32(W1_bf16)) -> +Cast32(Constant_bf16) -> Relu -> CastBF16 -> Cast32 -> MatMul(Cast32(W2_bf16)) -> y -> CastBF16 -> yb
    """
    nodes = [
        helper.make_node("Constant", [], ["cb"], name="cbias", value=bf("cbv", RNG.standard_normal(64))),
        helper.make_node("Cast", ["w1_bf16"], ["w1"], name="cast_w1", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Cast", ["cb"], ["cb32"], name="cast_cb", to=TensorProto.FLOAT),
        helper.make_node("Add", ["h", "cb32"], ["hb"], name="bias"),
        helper.make_node("Relu", ["hb"], ["r"], name="relu"),
        helper.make_node("Cast", ["r"], ["rb"], name="to_bf16", to=TensorProto.BFLOAT16),
        helper.make_node("Cast", ["rb"], ["r2"], name="from_bf16", to=TensorProto.FLOAT),
        helper.make_node("Cast", ["w2_bf16"], ["w2"], name="cast_w2", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["r2", "w2"], ["y"], name="fc2"),
        helper.make_node("Cast", ["y"], ["yb"], name="out_bf16", to=TensorProto.BFLOAT16),
    ]
    graph = helper.make_graph(
        nodes, "bf16_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8]),
         helper.make_tensor_value_info("yb", TensorProto.BFLOAT16, [4, 8])],
        [bf("w1_bf16", RNG.standard_normal((64, 64)) * 3e3), bf("w2_bf16", RNG.standard_normal((64, 8)))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def bf16_io_with_if() -> onnx.ModelProto:
    """A BF16 graph input, BF16 compute in the main graph and in an If branch (a BF16 Constant).

    x:bf16 -> ReduceSum -> s -> Greater(0) -> If(then: x*3 (bf16 Constant), else: x) -> yb:bf16 -> Cast32 -> y
    """
    then_b = helper.make_graph(
        [helper.make_node("Constant", [], ["k"], value=bf("kv", np.full(8, 3.0))),
         helper.make_node("Mul", ["x", "k"], ["t"])], "then", [],
        [helper.make_tensor_value_info("t", TensorProto.BFLOAT16, [2, 8])])
    else_b = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.BFLOAT16, [2, 8])])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["yb"], then_branch=then_b, else_branch=else_b),
             helper.make_node("Cast", ["yb"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(
        nodes, "bf16_io", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8]),
         helper.make_tensor_value_info("yb", TensorProto.BFLOAT16, [2, 8])], [bf("zero", np.array(0.0))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def test_widening_is_exact_and_keeps_bf16_rounding():
    model = bf16_mlp()
    wide = widen_bf16(model)
    assert has_bf16(model) and not has_bf16(wide)
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    got = run(make_session(wide), {"x": x})
    # numpy reference with ml_dtypes: BF16 weights exact in FP32, the BF16 Casts round.
    init = {i.name: onnx.numpy_helper.to_array(i).astype(np.float32) for i in model.graph.initializer}
    cb = onnx.numpy_helper.to_array(model.graph.node[0].attribute[0].t).astype(np.float32)
    r = np.maximum(x @ init["w1_bf16"] + cb, 0)
    r2 = r.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert not np.array_equal(r, r2)  # the round trip matters on these values
    y = r2 @ init["w2_bf16"]
    np.testing.assert_allclose(got["y"], y, rtol=1e-5, atol=1e-3)
    np.testing.assert_array_equal(got["yb"], got["y"].astype(ml_dtypes.bfloat16).astype(np.float32))


def test_a_proto_with_bf16_runs_on_onnxruntime_through_make_session():
    model = bf16_io_with_if()
    x = (RNG.standard_normal((2, 8)) * 100).astype(ml_dtypes.bfloat16)
    out = run(make_session(model), {"x": x})
    want = x.astype(np.float32) * (3.0 if x.astype(np.float32).sum() > 0 else 1.0)
    np.testing.assert_array_equal(out["yb"], want.astype(ml_dtypes.bfloat16).astype(np.float32))


def _samples(tmp_path, name: str, make) -> str:
    folder = tmp_path / name
    folder.mkdir()
    for i in range(3):
        np.savez(folder / f"{i:03d}.npz", **make(i))
    return str(folder)


def test_bf16_weights_convert_for_a2000_with_no_bf16_left(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(bf16_mlp(), str(path))
    data = _samples(tmp_path, "data", lambda i: {"x": RNG.standard_normal((4, 64)).astype(np.float32)})
    out = tmp_path / "out" / "mlp.a2000.onnx"
    for command in (("calibrate", path, "--data", data, "-o", tmp_path / "s.json"),
                    ("check", path, "--target", "a2000", "--data", data),
                    ("compare", path, "--emulate", "--target", "a2000", "--data", data),
                    ("convert", path, "--target", "a2000", "--data", data, "-o", out)):
        done = run_cli(*command)
        assert done.returncode in (0, 1), (command[0], done.stderr[-2000:])
        assert "Traceback" not in done.stderr
    converted = onnx.load(str(out))
    assert not has_bf16(converted)
    onnx.checker.check_model(converted, full_check=True)
    make_session(converted)


def test_bf16_graph_io_and_subgraphs_convert(tmp_path):
    path = tmp_path / "io.onnx"
    onnx.save(bf16_io_with_if(), str(path))
    # .npz keeps BF16 arrays as raw 2-byte values: the loader reads them back as BF16.
    data = _samples(tmp_path, "data", lambda i: {
        "x": (RNG.standard_normal((2, 8)) * 100).astype(ml_dtypes.bfloat16)})
    out = tmp_path / "io.a2000.onnx"
    done = run_cli("convert", path, "--target", "a2000", "--data", data, "-o", out)
    assert done.returncode == 0, done.stderr[-2000:]
    converted = onnx.load(str(out))
    assert not has_bf16(converted)
    onnx.checker.check_model(converted, full_check=True)
    compared = run_cli("compare", path, out, "--data", data)
    assert compared.returncode == 0, compared.stdout[-2000:] + compared.stderr[-2000:]


def test_lowering_reads_each_cast_target_as_written_every_time():
    # bf16_mlp with `bias` pinned FP32 and its Cast'ed BF16 Constant input not: the Cast must
    # stay FP32 for the pinned Add. Cast targets keyed by id() of dropped wrappers once made
    # this depend on memory reuse (it failed on every pass of this loop).
    from npuprep.numerics import get_format
    from npuprep.rewrite.lower import lower

    model = bf16_mlp()
    pins = ["bias", "fc1", "fc2", "from_bf16", "out_bf16", "relu", "to_bf16"]
    for _ in range(10):
        lowered = lower(model, get_format("fp16"), pinned_nodes=pins).model
        onnx.checker.check_model(lowered, full_check=True)
