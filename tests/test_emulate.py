"""Emulated target numerics: rounding, overflow (Inf, saturation, NaN), pinning, subgraphs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from conftest import model_from_text
from onnx import TensorProto, helper, numpy_helper

from npuprep.errors import NpuprepError
from npuprep.numerics import get_format
from npuprep.runtime.session import make_session, run
from npuprep.verify.emulate import SUFFIX, emulate

FP16 = get_format("fp16")
E4M3 = get_format("fp8_e4m3")


def run_model(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return run(make_session(model), feeds)


SQUARE = """
<ir_version: 8, opset_import: ["" : {opset}]>
g (float[N] x) => (float[N] y) {{
  y = Mul(x, x)
}}"""


def square(opset: int = 17) -> onnx.ModelProto:
    # x -> Mul(x, x) -> y
    return model_from_text(SQUARE.format(opset=opset))


X = np.array([1.0001, 3.3333, 255.0, 256.0, 300.0, -300.0], np.float32)


def test_fp16_ieee_overflow_gives_inf_and_rounds_like_numpy():
    y = run_model(emulate(square(), FP16, saturate=False).model, {"x": X})["y"]
    with np.errstate(over="ignore"):
        expected = (X.astype(np.float16).astype(np.float32) ** 2).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(y, expected)
    # 255^2 = 65025 fits; 256^2 = 65536 is past 65520 and becomes Inf.
    assert np.isfinite(y[:3]).all() and np.isinf(y[3:]).all()


def test_fp16_saturating_overflow_clips_to_max():
    y = run_model(emulate(square(), FP16, saturate=True).model, {"x": X})["y"]
    assert y[4] == FP16.max and y[5] == FP16.max  # (-300)^2 is positive
    assert np.isfinite(y).all()
    # 256^2 = 65536 would be Inf under IEEE rounding; a saturating target stops at 65504.
    assert y[3] == FP16.max


def test_fp8_e4m3_gives_nan_without_saturation_and_448_with_it():
    x = np.array([2.0, 21.0, 22.0, 30.0], np.float32)
    loud = run_model(emulate(square(19), E4M3, saturate=False).model, {"x": x})["y"]
    quiet = run_model(emulate(square(19), E4M3, saturate=True).model, {"x": x})["y"]
    # 22^2 = 484 lies where onnxruntime's own FP8 Cast wrongly returns 448; the guard fixes it.
    assert loud[0] == 4.0 and np.isnan(loud[2:]).all()
    assert quiet[0] == 4.0 and (quiet[2:] == E4M3.max).all()
    # 21 is stored as 20 and 20^2 = 400 as 384: rounding, not overflow, either way.
    assert loud[1] == quiet[1] == 384.0


def test_fp8_e5m2_overflow_gives_signed_inf():
    # 250^2 = 62500 is past E5M2's threshold 61440 (onnxruntime's Cast alone gives NaN there).
    x = np.array([2.0, 200.0, 250.0, -250.0], np.float32)
    y = run_model(emulate(square(19), get_format("fp8_e5m2"), saturate=False).model, {"x": x})["y"]
    assert y[0] == 4.0 and y[1] == 32768.0 and np.isposinf(y[2:]).all()  # 200 -> 192, 192^2 -> 32768
    neg = run_model(emulate(model_from_text(SQUARE.replace("Mul(x, x)", "Neg(x)").format(opset=19)),
                            get_format("fp8_e5m2"), saturate=False).model,
                    {"x": np.array([70000.0], np.float32)})["y"]
    assert np.isneginf(neg).all()


def test_fp8_on_an_old_opset_is_upgraded_with_names_kept():
    emu = emulate(square(17), E4M3, saturate=False)
    assert emu.upgraded_from_opset == 17
    y = run_model(emu.model, {"x": np.array([30.0], np.float32)})["y"]
    assert np.isnan(y).all()


def test_fp8_upgrade_failure_is_one_clear_error(monkeypatch):
    from onnx import version_converter

    def broken(model, opset):
        raise RuntimeError("no adapter for op Foo")

    monkeypatch.setattr(version_converter, "convert_version", broken)
    with pytest.raises(NpuprepError, match="opset 17.*no adapter for op Foo"):
        emulate(square(17), E4M3, saturate=False)


def test_bf16_rounding_matches_ml_dtypes():
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32) * 100
    y = run_model(emulate(square(), get_format("bf16"), saturate=False).model, {"x": x})["y"]
    def r(v: np.ndarray) -> np.ndarray:
        return v.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(y, r(r(x) * r(x)))


def test_fp32_is_refused():
    with pytest.raises(NpuprepError, match="fp32"):
        emulate(square(), get_format("fp32"), saturate=False)


def _weights_model() -> onnx.ModelProto:
    # x -> Mul(x, w) [pinned "keep"] -> a ;  x -> Mul(x, w) [free] -> b ; w shared
    return model_from_text("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2] x) => (float[2] a, float[2] b) <float[2] w = {1.0001, 3.0}> {
      [keep] a = Mul(x, w)
      [free] b = Mul(x, w)
    }""")


def test_shared_initialiser_keeps_fp32_for_the_pinned_node_only():
    emu = emulate(_weights_model(), FP16, saturate=False, pinned_nodes=["keep"])
    out = run_model(emu.model, {"x": np.array([1.0, 1.0], np.float32)})
    assert out["a"][0] == np.float32(1.0001)
    assert out["b"][0] == np.float32(np.float16(1.0001))
    assert emu.rounded_weights == ("w",)
    inits = {i.name: numpy_helper.to_array(i) for i in emu.model.graph.initializer}
    assert inits["w"][0] == np.float32(1.0001)  # the original stays for the pinned reader


def test_constant_read_only_by_pinned_nodes_stays_fp32():
    # Constant(1.0001) -> c ; x -> Mul(x, c) [pinned] -> y
    model = model_from_text("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1] x) => (float[1] y) {
      [const] c = Constant <value = float {1.0001}> ()
      [keep] y = Mul(x, c)
    }""")
    feeds = {"x": np.array([1.0], np.float32)}
    assert run_model(emulate(model, FP16, saturate=False, pinned_nodes=["keep"]).model, feeds)["y"][0] \
        == np.float32(1.0001)
    assert run_model(emulate(model, FP16, saturate=False).model, feeds)["y"][0] == np.float32(np.float16(1.0001))


def test_weights_rounded_in_place_when_no_pinned_reader():
    emu = emulate(_weights_model(), FP16, saturate=False)
    inits = {i.name: numpy_helper.to_array(i) for i in emu.model.graph.initializer}
    assert list(inits) == ["w"] and inits["w"][0] == np.float32(np.float16(1.0001))


def test_pinned_node_output_is_rounded_where_it_enters_a_free_node():
    # x -> Mul(x, x) [pinned] -> sq -> Div(sq, 10) -> y ; sq is also an output
    model = model_from_text("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1] x) => (float[1] y, float[1] sq) <float ten = {10.0}> {
      [square] sq = Mul(x, x)
      [shrink] y = Div(sq, ten)
    }""")
    x = {"x": np.array([300.0], np.float32)}
    emu = emulate(model, FP16, saturate=False, pinned_nodes=["square"])
    out = run_model(emu.model, x)
    assert out["sq"][0] == 90000.0  # the pinned node itself stays FP32
    assert np.isinf(out["y"][0])  # the Cast at the island border overflows
    assert run_model(emulate(model, FP16, saturate=True, pinned_nodes=["square"]).model, x)["y"][0] \
        == np.float32(np.float16(FP16.max / 10))


def test_graph_outputs_keep_their_names_and_rounding_chain_writes_them():
    emu = emulate(square(), FP16, saturate=False)
    assert [o.name for o in emu.model.graph.output] == ["y"]
    producers = {o: n for n in emu.model.graph.node for o in n.output}
    assert producers["y"].op_type == "Cast" and ("y" + SUFFIX) in producers
    onnx.checker.check_model(emu.model)


def test_data_movement_ops_get_no_rounding_chain_and_resize_scales_stay_fp32():
    # x -> Mul(x, x) -> sq -> Reshape -> r -> Resize(scales=s) -> y
    model = model_from_text("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1, 1, 2, 2] x) => (float[1, 1, 4, 4] y)
      <int64[4] shape = {1, 1, 2, 2}, float[4] s = {1.0, 1.0, 2.0, 2.0}> {
      sq = Mul(x, x)
      r = Reshape(sq, shape)
      y = Resize <mode = "nearest"> (r, , s)
    }""")
    emu = emulate(model, FP16, saturate=False)
    assert "sq" in emu.rounded_tensors
    # A nearest Resize copies values, like the Reshape: the value is still FP16's (below).
    assert "r" not in emu.rounded_tensors and "y" not in emu.rounded_tensors
    assert "s" not in emu.rounded_weights
    linear = onnx.ModelProto()
    linear.CopyFrom(model)
    linear.graph.node[-1].attribute[0].s = b"linear"
    assert "y" in emulate(linear, FP16, saturate=False).rounded_tensors
    x = np.full((1, 1, 2, 2), 1.0001, np.float32)
    y = run_model(emu.model, {"x": x})["y"]
    assert y.shape == (1, 1, 4, 4) and (y == np.float32(np.float16(np.float16(1.0001) ** 2))).all()


def _if_model() -> onnx.ModelProto:
    # c ? (x -> Mul(x, x) -> y) : (x -> Add(x, x) -> y)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    c = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    then_g = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["t"], name="then_mul")], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1])])
    else_g = helper.make_graph([helper.make_node("Add", ["x", "x"], ["e"], name="else_add")], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1])])
    node = helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then_g, else_branch=else_g)
    model = helper.make_model(helper.make_graph([node], "g", [x, c], [y]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def test_if_bodies_are_emulated():
    emu = emulate(_if_model(), FP16, saturate=False)
    x = np.array([300.0], np.float32)
    assert np.isinf(run_model(emu.model, {"x": x, "c": np.array(True)})["y"]).all()
    assert run_model(emu.model, {"x": x, "c": np.array(False)})["y"][0] == 600.0
    assert {"t", "e"} <= set(emu.rounded_tensors)


def test_pinned_node_inside_an_if_body_stays_fp32():
    feeds = {"x": np.array([300.0], np.float32), "c": np.array(True)}
    emu = emulate(_if_model(), FP16, saturate=False, pinned_nodes=["then_mul", "branch"])
    assert run_model(emu.model, feeds)["y"][0] == 90000.0
    # Pinning only the body's Mul: the If node itself still stores its output in FP16.
    emu = emulate(_if_model(), FP16, saturate=False, pinned_nodes=["then_mul"])
    assert np.isinf(run_model(emu.model, feeds)["y"]).all()


def test_loop_body_is_emulated():
    # acc_0 = 1; 9 times: acc = Mul(acc, 4) -> 4^9 = 262144 overflows FP16 at 4^8 = 65536
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Mul", ["acc_in", "four"], ["acc_out"], name="times4")],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(np.array([4.0], np.float32), "four")],
    )
    loop = helper.make_node("Loop", ["n", "", "acc0"], ["acc"], name="loop", body=body)
    model = helper.make_model(
        helper.make_graph([loop], "g",
                          [helper.make_tensor_value_info("acc0", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("acc", TensorProto.FLOAT, [1])],
                          [numpy_helper.from_array(np.array(9, np.int64), "n")]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    feeds = {"acc0": np.array([1.0], np.float32)}
    assert run_model(model, feeds)["acc"][0] == 4.0 ** 9
    assert np.isinf(run_model(emulate(model, FP16, saturate=False).model, feeds)["acc"]).all()
    assert run_model(emulate(model, FP16, saturate=True).model, feeds)["acc"][0] == FP16.max


def test_emulation_of_a_safe_graph_matches_the_real_fp16_lowering():
    # x -> MatMul(w1) -> Add(b1) -> Relu -> MatMul(w2) -> Add(b2) -> y, all values O(1..10)
    from onnxconverter_common import float16

    rng = np.random.default_rng(3)
    inits = {
        "w1": rng.standard_normal((16, 32)).astype(np.float32) / 4,
        "b1": rng.standard_normal(32).astype(np.float32),
        "w2": rng.standard_normal((32, 8)).astype(np.float32) / 6,
        "b2": rng.standard_normal(8).astype(np.float32),
    }
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["a"]), helper.make_node("MatMul", ["a", "w2"], ["o"]),
             helper.make_node("Add", ["o", "b2"], ["y"])]
    model = helper.make_model(
        helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    lowered = float16.convert_float_to_float16(model, keep_io_types=True)
    assert any(i.data_type == TensorProto.FLOAT16 for i in lowered.graph.initializer)
    x = (rng.standard_normal((4, 16)) * 2).astype(np.float32)
    real = run_model(lowered, {"x": x})["y"]
    emulated = run_model(emulate(model, FP16, saturate=False).model, {"x": x})["y"]
    fp32 = run_model(model, {"x": x})["y"]
    scale = np.abs(fp32).max()
    # Both round to FP16 (different accumulation order inside MatMul): a few FP16 ulps apart.
    np.testing.assert_allclose(emulated, real, rtol=0, atol=8 * FP16.eps * scale)
    assert not np.array_equal(emulated, fp32)  # the emulation did round


@pytest.mark.parametrize(("fmt", "saturate"), [(FP16, False), (FP16, True), (E4M3, True)])
def test_weights_rounded_in_the_graph_give_the_same_numbers_and_keep_the_initialisers(fmt, saturate):
    # x -> MatMul(x, W)[mm] -> h -> Add(h, W2)[add, pinned] -> y ; W2 also read by mm2: h2 = x @ W2
    # ; Gather(E, ids) -> g ; Max(x, M) -> m (ops that only move or select: their outputs round)
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((4, 4)) * 300).astype(np.float32)  # beyond E4M3's 448 once multiplied
    w2 = rng.standard_normal((4, 4)).astype(np.float32) * 1.001
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
         helper.make_node("Add", ["h", "W2"], ["y"], name="add"),
         helper.make_node("MatMul", ["x", "W2"], ["h2"], name="mm2"),
         helper.make_node("Gather", ["E", "ids"], ["g"], name="lookup"),
         helper.make_node("Max", ["x", "M"], ["m"], name="max")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4]),
         helper.make_tensor_value_info("h2", TensorProto.FLOAT, [4, 4]),
         helper.make_tensor_value_info("g", TensorProto.FLOAT, [3, 4]),
         helper.make_tensor_value_info("m", TensorProto.FLOAT, [4, 4])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(w2, "W2"),
         numpy_helper.from_array((rng.standard_normal((8, 4)) * 300).astype(np.float32), "E"),
         numpy_helper.from_array(np.array([1, 5, 7], dtype=np.int64), "ids"),
         numpy_helper.from_array((rng.standard_normal((4, 4)) * 1.001).astype(np.float32), "M")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    copies = emulate(model, fmt, saturate=saturate, pinned_nodes=["add"])
    in_graph = emulate(model, fmt, saturate=saturate, pinned_nodes=["add"], weights_in_graph=True)
    assert [i.SerializeToString() for i in in_graph.model.graph.initializer] == \
        [i.SerializeToString() for i in model.graph.initializer]
    assert set(in_graph.rounded_weights) == set(copies.rounded_weights) == {"W", "W2", "E", "M"}
    feed = {"x": rng.standard_normal((4, 4)).astype(np.float32)}
    a, b = run_model(copies.model, feed), run_model(in_graph.model, feed)
    for name in ("y", "h2", "g", "m"):
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(b["g"], numpy_helper.to_array(model.graph.initializer[2])[[1, 5, 7]])


def test_a_lowered_models_large_weights_are_widened_by_a_cast_and_emulate_the_same():
    # x -> MatMul(x, W:fp16 as stored) -> y, W 64x512 (64 KiB in FP16: widened in the graph)
    from npuprep.verify.emulate_lowered import emulate_lowered

    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 512)).astype(np.float16)
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16, name="in_cast"),
         helper.make_node("MatMul", ["x16", "W"], ["y16"], name="mm"),
         helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT, name="out_cast")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 512])],
        [numpy_helper.from_array(w, "W")])
    lowered = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    emulation = emulate_lowered(lowered, FP16, saturate=False).model
    stored = {i.name: i.data_type for i in emulation.graph.initializer}
    assert stored == {"W__stored": TensorProto.FLOAT16}
    x = rng.standard_normal((2, 64)).astype(np.float32)
    expected = (x.astype(np.float16).astype(np.float32) @ w.astype(np.float32)).astype(np.float16)
    np.testing.assert_allclose(run_model(emulation, {"x": x})["y"], expected.astype(np.float32),
                               rtol=2e-3, atol=2e-3)


def test_a_lowered_lookup_widens_the_rows_it_reads_not_its_table():
    # ids -> Gather(T:fp16 256x256, 128 KiB) -> e16 -> Mul(e16, e16) -> y16 -> Cast -> y
    from npuprep.verify.emulate_lowered import emulate_lowered

    rng = np.random.default_rng(9)
    table = (rng.standard_normal((256, 256)) * 200).astype(np.float16)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["T", "ids"], ["e16"], name="lookup"),
         helper.make_node("Mul", ["e16", "e16"], ["y16"], name="square"),
         helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT, name="out_cast")],
        "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 256])],
        [numpy_helper.from_array(table, "T")])
    lowered = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    emulation = emulate_lowered(lowered, FP16, saturate=False).model
    assert {i.name: i.data_type for i in emulation.graph.initializer} == {"T": TensorProto.FLOAT16}
    assert not any(n.op_type == "Cast" and n.input[0] == "T" for n in emulation.graph.node)
    ids = np.array([0, 7, 255], dtype=np.int64)
    got = run_model(emulation, {"ids": ids})["y"]
    rows = table[ids].astype(np.float32)
    with np.errstate(over="ignore"):
        want = (rows * rows).astype(np.float16).astype(np.float32)  # overflows to Inf past 65504
    np.testing.assert_array_equal(got, want)
    assert np.isinf(got).any()


def _loop_gathering_outer_table() -> onnx.ModelProto:
    # table (outer initialiser); Loop(3) { row = Gather(table, i); acc' = acc + row } -> y
    body = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["i64"], to=TensorProto.INT64),
         helper.make_node("Gather", ["table", "i64"], ["row"], axis=0),
         helper.make_node("Add", ["acc_in", "row"], ["acc_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [2])])
    table = np.array([[1.0001, 2.0], [3.0, 4.0002], [5.0, 6.0]], np.float32)
    graph = helper.make_graph(
        [helper.make_node("Loop", ["n", "cond", "x"], ["y"], body=body)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(table, "table"),
         numpy_helper.from_array(np.array(3, np.int64), "n"),
         numpy_helper.from_array(np.array(True), "cond")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_loop_body_reading_an_outer_weight_gets_it_rounded():
    """A Gather inside a Loop body reads the outer table (g2p_en's greedy decoder did, and
    emulation crashed): the body reads a rounded copy, so the sum comes out in FP16."""
    model = _loop_gathering_outer_table()
    x = np.zeros(2, np.float32)
    emulation = emulate(model, FP16, saturate=False, weights_in_graph=True)
    got = run_model(emulation.model, {"x": x})["y"]
    table = numpy_helper.to_array(model.graph.initializer[0])
    rounded = table.astype(np.float16).astype(np.float32)
    acc = x.copy()
    for row in rounded:
        acc = (acc + row).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got, acc)
    assert not np.array_equal(got, table.sum(axis=0))
