"""Lowering to FP16: islands stay FP32, the converter traps are avoided, the result runs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper
from rewrite_util import C, RandomChain, build, outputs, rel_err

from npuprep.errors import NpuprepError
from npuprep.graph import walk_graphs
from npuprep.numerics import get_format
from npuprep.rewrite.lower import lower
from npuprep.rewrite.pin import grow_island
from npuprep.verify.emulate import emulate

HEAD = '<ir_version: 8, opset_import: ["" : 17]>'
RNG = np.random.default_rng(3)
FP16 = get_format("fp16")


def _w(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.normal(size=shape) * scale).astype(np.float32)


def _inits(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {i.name: i for s in walk_graphs(model.graph) for i in s.graph.initializer}


def _ops(model: onnx.ModelProto, op: str) -> list[onnx.NodeProto]:
    return [n for s in walk_graphs(model.graph) for n in s.graph.node if n.op_type == op]


def mlp():
    # x -> MatMul(W1) -> Add(b) -> Relu -> MatMul(W1 shared) -> y
    return build(HEAD + """
    g (float[2,8] x) => (float[2,8] y) <float[8,8] W1, float[8] b> {
      h = MatMul(x, W1)
      hb = Add(h, b)
      r = Relu(hb)
      y = MatMul(r, W1)
    }""", W1=_w(8, 8), b=_w(8))


def test_lowered_model_runs_keeps_fp32_io_and_is_deterministic():
    model = mlp()
    first = lower(model, "fp16")
    again = lower(model, FP16)
    assert first.model.SerializeToString(deterministic=True) == again.model.SerializeToString(
        deterministic=True)
    assert first.cast_count == 2 and first.pinned_nodes == ()
    assert first.model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert first.model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert {i.data_type for i in _inits(first.model).values()} == {TensorProto.FLOAT16}
    feeds = {"x": RNG.normal(size=(2, 8)).astype(np.float32)}
    assert rel_err(outputs(model, feeds)["y"], outputs(first.model, feeds)["y"]) < 1e-2
    onnx.checker.check_model(first.model, full_check=True)


def test_io_types_target():
    lowered = lower(mlp(), "fp16", io_types="target")
    assert lowered.cast_count == 0
    assert lowered.model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    out = outputs(lowered.model, {"x": RNG.normal(size=(2, 8)).astype(np.float16)})["y"]
    assert out.dtype == np.float16


def test_pinned_node_keeps_its_fp32_copy_of_a_shared_initialiser():
    model = mlp()
    lowered = lower(model, "fp16", pinned_nodes=["node_of_y"])
    inits = _inits(lowered.model)
    assert lowered.duplicated_initialisers == ("W1",)
    assert inits["W1"].data_type == TensorProto.FLOAT and inits["W1__fp16"].data_type == TensorProto.FLOAT16
    pinned = next(n for n in lowered.model.graph.node if n.name == "" and n.output[0] == "y")
    assert list(pinned.input) == ["r__to_fp32", "W1"]
    assert lowered.pinned_nodes == ("node_of_y",) and lowered.cast_count == 2


def test_weights_beyond_range_pin_their_node_instead_of_clipping():
    # x -> Mul(x, 1e6) -> Div(., 1e6) -> y ; BatchNorm variance 9.8e7 kept FP32
    model = build(HEAD + """
    g (float[1,2,2,2] x) => (float[1,2,2,2] y) <float big, float[2] g, float[2] b, float[2] m, float[2] v> {
      n = BatchNormalization(x, g, b, m, v)
      y = Relu(n)
    }""", big=np.array(1e6, np.float32), g=_w(2), b=_w(2), m=_w(2), v=np.array([9.8e7, 1.0], np.float32))
    lowered = lower(model, "fp16")
    assert "node_of_n" in lowered.forced_fp32 and "9.8e+07" in lowered.forced_fp32["node_of_n"]
    assert "node_of_n" in lowered.pinned_nodes
    v = numpy_helper.to_array(_inits(lowered.model)["v"])
    assert v.dtype == np.float32 and v[0] == np.float32(9.8e7)
    feeds = {"x": RNG.normal(size=(1, 2, 2, 2)).astype(np.float32)}
    assert rel_err(outputs(model, feeds)["y"], outputs(lowered.model, feeds)["y"]) < 1e-2


def test_additive_mask_becomes_minus_max():
    # scores + mask(FP32 lowest) -> Softmax -> p
    mask = np.where(np.triu(np.ones((4, 4)), 1) > 0, np.finfo(np.float32).min, 0).astype(np.float32)
    model = build(HEAD + """
    g (float[4,4] s) => (float[4,4] p) <float[4,4] mask> {
      a = Add(s, mask)
      p = Softmax(a)
    }""", mask=mask)
    lowered = lower(model, "fp16")
    assert lowered.mapped_masks == {"mask": 6} and not lowered.forced_fp32
    low = numpy_helper.to_array(_inits(lowered.model)["mask"])
    assert low.dtype == np.float16 and low.min() == -FP16.max
    feeds = {"s": RNG.normal(size=(4, 4)).astype(np.float32)}
    out = outputs(lowered.model, feeds)["p"]
    assert np.isfinite(out).all()
    assert rel_err(outputs(model, feeds)["p"], out) < 1e-2


def test_shape_computation_resize_constants_and_casts():
    # x -> Shape -> Cast(float) -> Mul(scale) -> Cast(int64) -> sizes of Resize(Conv(x));
    # Constant * x; ConstantOfShape(-inf) as a Max floor; Cast(to=float) lowered with its node
    model = build(HEAD + """
    g (float[1,2,4,4] x) => (float[1,2,8,8] y, float[1,2,4,4] z) <float[4] sc, float[2,2,1,1] W> {
      s = Shape(x)
      sf = Cast<to=1>(s)
      s2 = Mul(sf, sc)
      si = Cast<to=7>(s2)
      a = Conv(x, W)
      y = Resize<mode="linear">(a, , , si)
      k = Constant<value=float {3.0}>()
      z0 = Mul(x, k)
      zs = ConstantOfShape<value=float[1] {-inf}>(s)
      z1 = Max(z0, zs)
      z = Cast<to=1>(z1)
    }""", sc=np.array([1, 1, 2, 2], np.float32), W=_w(2, 2, 1, 1))
    lowered = lower(model, "fp16")
    assert {"node_of_sf", "node_of_s2", "node_of_si"} <= set(lowered.forced_fp32)
    nodes = {n.output[0]: n for n in lowered.model.graph.node}
    assert nodes["s2"].input[0] == "sf" and nodes["si"].input[0] == "s2"
    assert nodes["k"].attribute[0].t.data_type == TensorProto.FLOAT16
    assert nodes["zs"].attribute[0].t.data_type == TensorProto.FLOAT16
    assert nodes["z__fp16"].attribute[0].i == TensorProto.FLOAT16
    feeds = {"x": RNG.normal(size=(1, 2, 4, 4)).astype(np.float32)}
    ref, out = outputs(model, feeds), outputs(lowered.model, feeds)
    assert out["y"].shape == (1, 2, 8, 8)
    assert max(rel_err(ref[k], out[k]) for k in ref) < 1e-2


def test_if_and_loop_bodies_are_lowered_consistently():
    # If(c) { then: Mul(x, W) } else { Neg(x) } -> y ; Loop(n) { v * w, + x } -> l, ls
    model = build(HEAD + """
    g (float[2] x, bool c, int64 n) => (float[2] y, float[2] l, float[3,2] ls) <float[2] w> {
      y = If(c) <then_branch = t () => (float[2] o1) { o1 = Mul(x, w) },
                 else_branch = e () => (float[2] o2) { o2 = Neg(x) }>
      t = Constant<value=bool {1}>()
      l, ls = Loop(n, t, x) <body = b (int64 i, bool cin, float[2] v) => (bool cout, float[2] vo, float[2] so) {
          cout = Identity(cin)
          vo = Mul(v, w)
          so = Add(vo, x)
      }>
    }""", w=np.array([1.5, 0.5], np.float32))
    lowered = lower(model, "fp16")
    bodies = [s.graph for s in walk_graphs(lowered.model.graph) if not s.is_main]
    for body in bodies:
        floats = [o for o in body.output if o.type.tensor_type.elem_type in (1, 10)]
        assert {o.type.tensor_type.elem_type for o in floats} == {TensorProto.FLOAT16}
    for c in (True, False):
        feeds = {"x": np.array([1.0, -2.0], np.float32), "c": np.array(c), "n": np.array(3)}
        ref, out = outputs(model, feeds), outputs(lowered.model, feeds)
        assert max(rel_err(ref[k], out[k]) for k in ref) < 1e-2


def test_pinned_node_inside_a_body():
    # If(c) { then: Mul(x, x) -> Sqrt } else { Neg(x) } -> y, with the square pinned
    model = build(HEAD + """
    g (float[3] x, bool c) => (float[3] y) {
      y = If(c) <then_branch = t () => (float[3] o1) { sq = Mul(x, x)
                                                       o1 = Sqrt(sq) },
                 else_branch = e () => (float[3] o2) { o2 = Neg(x) }>
    }""")
    lowered = lower(model, "fp16", pinned_nodes=["node_of_sq", "node_of_o1"])
    feeds = {"x": np.array([300.0, 1.0, -400.0], np.float32), "c": np.array(True)}
    out = outputs(lowered.model, feeds)["y"]
    np.testing.assert_allclose(out, [300.0, 1.0, 400.0], rtol=1e-3)
    emu = emulate(model, FP16, saturate=False, pinned_nodes=lowered.pinned_nodes).model
    assert np.isfinite(outputs(emu, feeds)["y"]).all()


def test_bf16_weights_and_casts_are_normalised():
    # x -> Cast(bf16) -> Cast(float) -> Mul(W bf16) -> y
    w = np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16)
    model = build(HEAD + """
    g (float[3] x) => (float[3] y) <bfloat16[3] W> {
      xb = Cast<to=16>(x)
      wf = Cast<to=1>(W)
      xf = Cast<to=1>(xb)
      y = Mul(xf, wf)
    }""", W=w)
    lowered = lower(model, "fp16")
    assert "W" in lowered.normalised_bf16
    assert all(n.attribute[0].i != TensorProto.BFLOAT16 for n in _ops(lowered.model, "Cast"))
    feeds = {"x": np.array([1.0, 2.0, -1.0], np.float32)}
    np.testing.assert_allclose(outputs(lowered.model, feeds)["y"], [1.5, -4.0, -3.25])


def test_decomposed_layernorm_island_removes_inf():
    # x -> Sub(mean) -> Mul(c, c) -> ReduceMean -> Add(eps) -> Sqrt -> Div -> y
    model = build(HEAD + """
    g (float[2,16] x) => (float[2,16] y) <float eps> {
      mu = ReduceMean<axes=[-1]>(x)
      c = Sub(x, mu)
      c2 = Mul(c, c)
      v = ReduceMean<axes=[-1]>(c2)
      ve = Add(v, eps)
      sd = Sqrt(ve)
      y = Div(c, sd)
    }""", eps=np.array(1e-5, np.float32))
    feeds = {"x": (RNG.normal(size=(2, 16)) * 600).astype(np.float32)}
    ref = outputs(model, feeds)["y"]
    limit = 0.5 * FP16.max
    big = {t for t, v in _intermediates(model, feeds).items() if np.abs(v).max() > limit}
    island = grow_island(model, "node_of_c2", lambda t: t not in big)
    assert island.nodes == ("node_of_c2", "node_of_v", "node_of_ve", "node_of_sd")
    naive = outputs(emulate(model, FP16, saturate=False).model, feeds)["y"]
    fixed = outputs(emulate(model, FP16, saturate=False, pinned_nodes=island.nodes).model, feeds)["y"]
    assert not np.isfinite(naive).all() or rel_err(ref, naive) > 0.5
    assert np.isfinite(fixed).all() and rel_err(ref, fixed) < 1e-2
    lowered = lower(model, "fp16", pinned_nodes=island.nodes)
    assert lowered.cast_count == 4
    assert rel_err(ref, outputs(lowered.model, feeds)["y"]) < 1e-2


def _intermediates(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    known = {o.name for o in exposed.graph.output}
    for node in exposed.graph.node:
        for out in node.output:
            if out not in known:
                exposed.graph.output.append(onnx.helper.make_empty_tensor_value_info(out))
    return outputs(exposed, feeds)


def test_large_model_path_is_checked_from_disk(monkeypatch):
    import npuprep.rewrite.graph_ops as graph_ops
    import npuprep.rewrite.lower as lower_mod

    # Pretend the protobuf limit is tiny, so the external-data branches run on a small model.
    monkeypatch.setattr(graph_ops, "PROTOBUF_LIMIT", 64 * 2**20 + 16)
    monkeypatch.setattr(lower_mod, "PROTOBUF_LIMIT", 64 * 2**20 + 16)
    lowered = lower(mlp(), "fp16")
    assert _inits(lowered.model)["W1"].data_type == TensorProto.FLOAT16


def test_bad_format_and_io_types_are_user_errors():
    with pytest.raises(NpuprepError, match="fp8_e4m3"):
        lower(mlp(), "fp8_e4m3")
    with pytest.raises(NpuprepError, match="io_types"):
        lower(mlp(), "fp16", io_types="fp64")


def test_tiny_weights_are_reported_when_they_flush():
    # x -> Mul(x, [1e-9, -1e-9, 1, 0, -0, 6e-8]) -> y : two flush, zeros were zeros already
    model = build(HEAD + """
    g (float[6] x) => (float[6] y) <float[6] t> { y = Mul(x, t) }""",
        t=np.array([1e-9, -1e-9, 1.0, 0.0, -0.0, 6e-8], np.float32))
    assert lower(model, "fp16").flushed_weights == {"t": 2}


def test_bf16_target_lowers_and_passes_the_checker():
    lowered = lower(mlp(), "bf16")
    assert {i.data_type for i in _inits(lowered.model).values()} == {TensorProto.BFLOAT16}
    assert {n.attribute[0].i for n in _ops(lowered.model, "Cast")} == {TensorProto.BFLOAT16,
                                                                        TensorProto.FLOAT}


def test_initialiser_that_is_also_a_graph_input_keeps_its_type():
    model = mlp()
    w = onnx.helper.make_tensor_value_info("W1", TensorProto.FLOAT, [8, 8])
    model.graph.input.append(w)
    lowered = lower(model, "fp16")
    assert _inits(lowered.model)["W1"].data_type == TensorProto.FLOAT
    feeds = {"x": RNG.normal(size=(2, 8)).astype(np.float32)}
    assert rel_err(outputs(model, feeds)["y"], outputs(lowered.model, feeds)["y"]) < 1e-2


def test_scan_body_with_a_pinned_node():
    # Scan(s0, xs) { t = Mul(x, w) [pinned]; so = Add(s, t); yo = so } -> sf, ys
    model = build(HEAD + """
    g (float[2] s0, float[3,2] xs) => (float[2] sf, float[3,2] ys) <float[2] w> {
      sf, ys = Scan(s0, xs) <num_scan_inputs=1, body = b (float[2] s, float[2] x) => (float[2] so, float[2] yo) {
          t = Mul(x, w)
          so = Add(s, t)
          yo = Identity(so)
      }>
    }""", w=np.array([2.0, 0.5], np.float32))
    lowered = lower(model, "fp16", pinned_nodes=["node_of_t"])
    body = next(s.graph for s in walk_graphs(lowered.model.graph) if not s.is_main)
    assert {i.type.tensor_type.elem_type for i in body.input} == {TensorProto.FLOAT16}
    assert _inits(lowered.model)["w"].data_type == TensorProto.FLOAT
    feeds = {"s0": np.array([1, 2], np.float32), "xs": np.arange(6, dtype=np.float32).reshape(3, 2)}
    ref, out = outputs(model, feeds), outputs(lowered.model, feeds)
    assert max(rel_err(ref[k], out[k]) for k in ref) < 1e-3


def test_resize_scales_stay_fp32_and_shared_constant_node_is_duplicated():
    # k = Constant(3); Mul(x, k) -> Resize(scales sc) -> y ; Add(x, k) [pinned] -> z
    model = build(HEAD + """
    g (float[1,2,4,4] x) => (float[1,2,8,8] y, float[1,2,4,4] z) <float[4] sc> {
      k = Constant<value=float {3.0}>()
      a = Mul(x, k)
      z = Add(x, k)
      y = Resize<mode="nearest">(a, , sc)
    }""", sc=np.array([1, 1, 2, 2], np.float32))
    lowered = lower(model, "fp16", pinned_nodes=["node_of_z"])
    nodes = {n.output[0]: n for n in lowered.model.graph.node}
    assert _inits(lowered.model)["sc"].data_type == TensorProto.FLOAT
    assert nodes["k"].attribute[0].t.data_type == TensorProto.FLOAT
    assert nodes["k__fp16"].attribute[0].t.data_type == TensorProto.FLOAT16
    assert list(nodes["a"].input) == ["x__to_fp16", "k__fp16"] and list(nodes["z"].input) == ["x", "k"]
    feeds = {"x": RNG.normal(size=(1, 2, 4, 4)).astype(np.float32)}
    ref, out = outputs(model, feeds), outputs(lowered.model, feeds)
    assert max(rel_err(ref[k], out[k]) for k in ref) < 1e-3


def test_cast_of_a_bf16_initialiser_is_folded_into_a_weight():
    # W (bf16, beyond FP16 range) -> Cast(float) -> MatMul(x, W) -> y : the MatMul stays FP32
    w = (np.eye(3) * 1e5).astype(ml_dtypes.bfloat16)
    model = build(HEAD + """
    g (float[1,3] x) => (float[1,3] y) <bfloat16[3,3] W> {
      wf = Cast<to=1>(W)
      y = MatMul(x, wf)
    }""", W=w)
    lowered = lower(model, "fp16")
    assert "node_of_wf" in lowered.normalised_bf16 and _ops(lowered.model, "Cast") == []
    assert "node_of_y" in lowered.forced_fp32 and _inits(lowered.model)["wf"].data_type == TensorProto.FLOAT
    out = outputs(lowered.model, {"x": np.array([[0.5, 1.0, 2.0]], np.float32)})["y"]
    np.testing.assert_allclose(out, [[w.astype(np.float32)[0, 0] * 0.5, w.astype(np.float32)[1, 1], w.astype(np.float32)[2, 2] * 2]])


def test_randomised_graphs_lower_load_and_run():
    for seed in range(16):
        model, kinds, _ = RandomChain(seed).model()
        rng = np.random.default_rng(seed)
        labels = [n.name for n in model.graph.node]
        pinned = [n for n in labels if rng.random() < 0.3]
        lowered = lower(model, "fp16", pinned_nodes=pinned)
        assert set(pinned) <= set(lowered.pinned_nodes)
        feeds = {"x": rng.normal(size=(1, C, 4, 4)).astype(np.float32)}
        err = rel_err(outputs(model, feeds)["y"], outputs(lowered.model, feeds)["y"])
        assert err < 2e-2, (seed, kinds, pinned, err)


def test_inserted_names_never_collide_with_existing_ones():
    # x -> Relu -> x__to_fp16 -> Mul(x__to_fp16, x) -> y
    model = build(HEAD + """
    g (float[2] x) => (float[2] y) {
      x__to_fp16 = Relu(x)
      y = Mul(x__to_fp16, x)
    }""")
    lowered = lower(model, "fp16")
    produced = [o for n in lowered.model.graph.node for o in n.output]
    assert len(produced) == len(set(produced)) and "x__to_fp16_2" in produced
    out = outputs(lowered.model, {"x": np.array([2.0, -1.0], np.float32)})["y"]
    np.testing.assert_array_equal(out, [4.0, 0.0])


def test_data_that_meets_a_computed_shape_is_still_lowered():
    # ids:int64 -> OneHot(ids, depth = Shape(ids)[1], [0, 1]) -> hot -> MatMul(W) -> y
    # (a jax2tf export's input): the MatMul computes data, not a shape; it must not stay FP32.
    from onnx import parser

    model = parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (int64[1,8] ids) => (float[1,8,4] y) {
            s = Shape(ids)
            one = Constant<value = int64[1] {1}>()
            depth = Gather(s, one)
            values = Constant<value = float[2] {0, 1}>()
            hot = OneHot(ids, depth, values)
            w = Constant<value = float[8,4] {1,2,3,4, 5,6,7,8, 1,2,3,4, 5,6,7,8, 1,2,3,4, 5,6,7,8, 1,2,3,4, 5,6,7,8}>()
            y = MatMul(hot, w)
        }
    """)
    onnx.checker.check_model(model, full_check=True)
    low = lower(model, get_format("fp16"))
    matmul = next(n for n in low.model.graph.node if n.op_type == "MatMul")
    assert all("MatMul" not in reason for reason in low.forced_fp32.values())
    types = {i.name: i.data_type for i in low.model.graph.initializer}
    consts = {n.output[0]: n.attribute[0].t.data_type for n in low.model.graph.node if n.op_type == "Constant"}
    assert types.get(matmul.input[1], consts.get(matmul.input[1])) == TensorProto.FLOAT16


def test_an_if_chosen_by_a_shape_still_lowers_its_data():
    # x -> Shape -> [0] == 1 -> c ; If(c: y = x*W, else: y = x) -> ReduceMean -> m (a graph output)
    # silero-vad picks its branch from the input's shape: the branch computes data, and the
    # ReduceMean feeding only a graph output is data too.
    from onnx import helper

    w = numpy_helper.from_array(np.full((4, 4), 0.5, np.float32), "W")
    then_b = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["t"], name="mm")], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 4])])
    else_b = helper.make_graph([helper.make_node("Identity", ["x"], ["e"], name="id")], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, 4])])
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Gather", ["s", "zero"], ["n"], name="first"),
             helper.make_node("Equal", ["n", "one"], ["c"], name="is_one"),
             helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then_b, else_branch=else_b),
             helper.make_node("ReduceMean", ["y"], ["m"], name="mean", keepdims=0)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("m", TensorProto.FLOAT, [])],
        [w, numpy_helper.from_array(np.array(0, np.int64), "zero"),
         numpy_helper.from_array(np.array(1, np.int64), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    low = lower(model, get_format("fp16"))
    assert low.forced_fp32 == {}, low.forced_fp32
    weights = {i.name: i.data_type for s in walk_graphs(low.model.graph) for i in s.graph.initializer}
    assert weights["W"] == TensorProto.FLOAT16


def test_nodes_after_an_ml_op_have_a_type_and_are_lowered():
    # x -> ai.onnx.ml.Scaler -> s -> Sub(mean) -> MatMul(W) -> y: onnx's inference leaves the
    # Scaler output untyped; its spec says tensor(float), so Sub and MatMul lower to FP16.
    from onnx import helper

    nodes = [helper.make_node("Scaler", ["x"], ["s"], domain="ai.onnx.ml", offset=[0.0] * 4,
                              scale=[2.0] * 4, name="scaler"),
             helper.make_node("Sub", ["s", "mean"], ["c"], name="sub"),
             helper.make_node("MatMul", ["c", "W"], ["y"], name="mm")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.ones(4, np.float32), "mean"),
         numpy_helper.from_array(np.ones((4, 3), np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.onnx.ml", 3)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    low = lower(model, get_format("fp16"))
    assert set(low.forced_fp32) == {"scaler"}, low.forced_fp32
    weights = {i.name: i.data_type for i in low.model.graph.initializer}
    assert weights["W"] == TensorProto.FLOAT16


def test_default_fill_of_constant_of_shape_is_lowered_with_its_scatter():
    # x -> Gather(src) -> MatMul(W) = messages; ConstantOfShape(Shape(x)) (no value: FP32 zeros)
    #   -> ScatterElements(add) of the messages -> Where(ok, sum, zeros) -> y
    model = build(HEAD + """
    g (float[6,4] x) => (float[6,4] y) <float[4,4] W, int64[10,4] dst, int64[10] src,
                                        bool[6,4] ok> {
      sh = Shape(x)
      zeros = ConstantOfShape(sh)
      msg = Gather(x, src)
      h = MatMul(msg, W)
      s = ScatterElements<axis=0, reduction="add">(zeros, dst, h)
      y = Where(ok, s, zeros)
    }""", W=_w(4, 4), dst=np.repeat(RNG.integers(0, 6, size=(10, 1)), 4, axis=1),
                  src=RNG.integers(0, 6, size=10), ok=RNG.random((6, 4)) > 0.3)
    low = lower(model, FP16)
    onnx.checker.check_model(low.model, full_check=True)
    # A summing scatter accumulates: it stays FP32 (and onnxruntime has no FP16 kernel).
    assert any("accumulates" in why for why in low.forced_fp32.values())
    fill, = _ops(low.model, "ConstantOfShape")
    assert fill.attribute[0].t.data_type == TensorProto.FLOAT16
    feeds = {"x": RNG.normal(size=(6, 4)).astype(np.float32)}
    assert rel_err(outputs(model, feeds)["y"], outputs(low.model, feeds)["y"]) < 1e-2


@pytest.mark.parametrize("window", ["HannWindow", "HammingWindow", "BlackmanWindow"])
def test_a_generated_window_keeps_its_fp32_type_and_its_reader_a_cast(window):
    # n -> {window}() (FP32 by output_datatype's default) -> Mul(x, w) -> y
    model = build(HEAD + f"""
    g (float[4,16] x) => (float[4,16] y) <int64 n> {{
      w = {window}(n)
      y = Mul(x, w)
    }}""", n=np.array(16, np.int64))
    low = lower(model, FP16)
    onnx.checker.check_model(low.model, full_check=True)
    assert "node_of_w" in low.forced_fp32 and "node_of_y" not in low.pinned_nodes
    feeds = {"x": RNG.normal(size=(4, 16)).astype(np.float32)}
    assert rel_err(outputs(model, feeds)["y"], outputs(low.model, feeds)["y"]) < 1e-2
