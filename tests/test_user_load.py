"""The model convert writes loads and runs in onnxruntime with default session options, as a
user loads it (npuprep.runtime.user_load, the pipeline's user_load stage)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from npuprep.convert import convert
from npuprep.model_io import Model, fingerprint
from npuprep.plan import PinFp32, Plan
from npuprep.profiles import load_profile
from npuprep.rewrite.default_session import squares_as_products, transposes_in_fp32
from npuprep.runtime.session import make_session, run
from npuprep.runtime.user_load import load_as_users_do

RNG = np.random.default_rng(37)


def _default_session_outputs(proto: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def _gru_ir6() -> onnx.ModelProto:
    # x[T,1,8] -> GRU(16, linear_before_reset) -> Squeeze -> MatMul -> Sigmoid -> Mul x (a mask)
    f, h = 8, 16
    inits = [numpy_helper.from_array(RNG.normal(0, .3, shape).astype(np.float32), name)
             for name, shape in (("W", (1, 3 * h, f)), ("R", (1, 3 * h, h)), ("B", (1, 6 * h)), ("P", (h, f)))]
    nodes = [helper.make_node("GRU", ["x", "W", "R", "B"], ["Y", "Yh"], hidden_size=h, linear_before_reset=1),
             helper.make_node("Squeeze", ["Y"], ["ys"], axes=[1]),
             helper.make_node("MatMul", ["ys", "P"], ["m"]), helper.make_node("Sigmoid", ["m"], ["g"]),
             helper.make_node("Mul", ["g", "x"], ["out"])]
    graph = helper.make_graph(nodes, "gru", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 1, f])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", 1, f])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=6)


def test_ir6_opset11_gru_converts_and_loads_with_default_session_options():
    proto = _gru_ir6()
    model = Model(proto=proto, path="gru.onnx", digest=fingerprint(proto))
    feeds = [{"x": RNG.normal(0, 1, (12, 1, 8)).astype(np.float32)} for _ in range(4)]
    result = convert(model, load_profile("a2000"), feeds, stats="calibrate")
    assert result, result.verdict.said
    written = result.lowered.model
    assert written.ir_version == 6 and written.opset_import[0].version == 11
    for feed in feeds:
        (got,) = _default_session_outputs(written, feed)
        (ref,) = _default_session_outputs(proto, feed)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


_NORM = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 32] x) => (float[N, 32] y) <float[32,32] w1, float[32] gam, float[32] bet, float[32,32] w2,
                                         float[1] two, float[1] eps> {
  a = MatMul(x, w1)
  mu = ReduceMean<axes=[-1]>(a)
  d = Sub(a, mu)
  sq = Pow(d, two)
  var = ReduceMean<axes=[-1]>(sq)
  ve = Add(var, eps)
  sd = Sqrt(ve)
  n = Div(d, sd)
  s = Mul(n, gam)
  t = Add(s, bet)
  y = MatMul(t, w2)
}
"""
_NORM_NODES = ("mu", "d", "sq", "var", "ve", "sd", "n", "s", "t")


def _norm_model() -> Model:
    # x -> MatMul (FP16) -> decomposed LayerNorm (kept FP32) -> MatMul (FP16) -> y
    proto = onnx.parser.parse_model(_NORM)
    proto.graph.initializer.extend(numpy_helper.from_array(v.astype(np.float32), n) for n, v in (
        ("w1", RNG.normal(0, 1, (32, 32))), ("gam", RNG.uniform(.5, 1.5, 32)), ("bet", RNG.normal(0, .1, 32)),
        ("w2", RNG.normal(0, .2, (32, 32))), ("two", np.array([2.0])), ("eps", np.array([1e-5]))))
    for i, node in enumerate(proto.graph.node):
        node.name = f"n{i}_{node.output[0]}"
    return Model(proto=proto, path="norm.onnx", digest=fingerprint(proto))


def _norm_plan(model: Model) -> Plan:
    names = {n.output[0]: n.name for n in model.proto.graph.node}
    return Plan(fingerprint=model.fingerprint, target="a2000", precision="fp16",
                actions=(PinFp32(nodes=tuple(names[o] for o in _NORM_NODES), forced=True),))


def test_a_pinned_norm_behind_fp16_is_written_so_onnxruntime_loads_it():
    model = _norm_model()
    feeds = [{"x": RNG.normal(0, 1, (4, 32)).astype(np.float32)} for _ in range(4)]
    result = convert(model, load_profile("a2000"), feeds, plan=_norm_plan(model))
    assert result, result.verdict.said
    written = result.lowered.model
    square = next(n for n in written.graph.node if n.output[0] == "sq")
    assert square.op_type == "Mul" and square.input[0] == square.input[1]
    assert any("LayerNormFusion" in note for note in result.notes)
    for feed in feeds:
        (got,) = _default_session_outputs(written, feed)
        (ref,) = _default_session_outputs(model.proto, feed)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


def test_the_fused_norm_is_refused_with_pow_and_loads_with_mul_computing_the_same():
    # x -> Cast fp16 -> Cast fp32 -> decomposed LayerNorm (FP32 weights): what lowering writes
    model = _norm_model().proto
    widened = helper.make_node("Cast", ["a16"], ["a32"], to=TensorProto.FLOAT)
    narrowed = helper.make_node("Cast", ["a"], ["a16"], to=TensorProto.FLOAT16)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name == "a":
                node.input[i] = "a32"
    model.graph.node.insert(1, narrowed)
    model.graph.node.insert(2, widened)
    feed = {"x": RNG.normal(0, 1, (3, 32)).astype(np.float32)}
    said = load_as_users_do(model, feed).refused
    assert said is not None and said.startswith("loading it") and "LayerNormFusion" in said
    fixed, squares = squares_as_products(model)
    assert squares == ["n3_sq"] and "two" not in {t.name for t in fixed.graph.initializer}
    assert load_as_users_do(fixed, feed).refused is None
    # Both computed with the fusions off (npuprep's own sessions): the same values, bit for bit.
    runs = [run(make_session(m), feed)["y"] for m in (model, fixed)]
    np.testing.assert_array_equal(runs[0], runs[1])


def test_a_model_onnxruntime_refuses_is_one_line_from_the_child():
    # x -> Add(x, "missing") where "missing" is nobody's output: onnxruntime refuses it at load
    graph = helper.make_graph([helper.make_node("Add", ["x", "missing"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    said = load_as_users_do(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), None).refused
    assert said is not None and said.startswith("loading it: ") and "\n" not in said


_TIME_MAJOR = """
<ir_version: 8, opset_import: ["" : 13]>
g (float[5, 3, 8] x) => (float[3, 5, 4] y) <float[8, 4] w> {
  t = Transpose<perm=[1, 0, 2]>(x)
  y = MatMul(t, w)
}
"""


def _time_major(fp16: bool) -> onnx.ModelProto:
    # x[T,B,F] -> Transpose(1,0,2) -> MatMul(w) -> y: a GRU's output turned batch-major before
    # its dense layer (AECMOS); `fp16`: the whole graph in FP16, as lowering writes it
    text = _TIME_MAJOR.replace("float[", "float16[") if fp16 else _TIME_MAJOR
    proto = onnx.parser.parse_model(text)
    w = RNG.normal(0, .3, (8, 4)).astype(np.float16 if fp16 else np.float32)
    proto.graph.initializer.append(numpy_helper.from_array(w, "w"))
    proto.graph.node[0].name = "turn"
    return proto


def test_an_fp16_transpose_before_a_matmul_crashes_the_default_session_and_loads_between_casts():
    model = _time_major(fp16=True)
    feed = {"x": RNG.normal(0, 1, (5, 3, 8)).astype(np.float16)}
    said = load_as_users_do(model, feed).refused
    assert said is not None and "crashed" in said
    fixed, moved = transposes_in_fp32(model)
    assert moved == ["turn"]
    assert [n.op_type for n in fixed.graph.node] == ["Cast", "Transpose", "Cast", "MatMul"]
    assert load_as_users_do(fixed, feed).refused is None
    # Computed with the fusions off (npuprep's own sessions): the same values, bit for bit.
    runs = [run(make_session(m), feed)["y"] for m in (model, fixed)]
    np.testing.assert_array_equal(runs[0], runs[1])


def test_a_time_major_dense_layer_converts_to_fp16_and_is_written():
    proto = _time_major(fp16=False)
    model = Model(proto=proto, path="time_major.onnx", digest=fingerprint(proto))
    feeds = [{"x": RNG.normal(0, 1, (5, 3, 8)).astype(np.float32)} for _ in range(4)]
    result = convert(model, load_profile("a2000"), feeds, stats="calibrate")
    assert result, result.verdict.said
    assert any("Transpose" in note and "crashes" in note for note in result.notes)
    written = result.lowered.model
    assert load_as_users_do(written, feeds[0]).refused is None
    for feed in feeds:
        (got,) = _default_session_outputs(written, feed)
        ref = np.transpose(feed["x"], (1, 0, 2)) @ numpy_helper.to_array(proto.graph.initializer[0])
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2
