"""Remedies that keep the compute in FP16, converted end to end and judged under emulated FP16.

Residual scale domains, If branches whose output exceeds FP16, underflowing logits, a
written-out softmax, a value short of headroom next to matmuls, and the FP32-share gate.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from conftest import run_cli
from onnx import TensorProto, helper, numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.convert import ConversionResult, convert
from npuprep.data import load_samples
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import get_format
from npuprep.plan import Rescale, SoftmaxShift
from npuprep.plan.plan import dump_plan
from npuprep.profiles import load_profile
from npuprep.report.render_md import action_target
from npuprep.runtime.session import make_session, run
from npuprep.verify.emulate import emulate

GENERIC = load_profile("generic")
F16 = get_format("fp16")
LINEAR = {"Conv", "ConvTranspose", "MatMul", "Gemm"}


def _model(text: str, **weights: np.ndarray) -> onnx.ModelProto:
    proto = parser.parse_model(text)
    for name, value in weights.items():
        proto.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    onnx.checker.check_model(proto, full_check=True)
    return proto


def _data(tmp_path: Path, feeds: list[dict[str, np.ndarray]]) -> Path:
    data = tmp_path / f"data_{len(list(tmp_path.iterdir()))}"
    data.mkdir()
    for i, feed in enumerate(feeds):
        np.savez(data / f"sample_{i:03d}.npz", **feed)
    return data


def _convert(tmp_path: Path, proto: onnx.ModelProto, feeds: list[dict[str, np.ndarray]],
             **kw: object) -> ConversionResult:
    model = Model(proto, "model.onnx", fingerprint(proto))
    samples = load_samples(_data(tmp_path, feeds), proto)
    return convert(model, GENERIC, list(samples), stats=calibrate(model, samples), **kw)


def _ops(proto: onnx.ModelProto) -> dict[str, str]:
    return {n.name: n.op_type for n in proto.graph.node}


def _worst_rel_l2(result: ConversionResult) -> float:
    outputs = result.output_check.outputs.values()
    assert all(o["nonfinite"] == 0 for o in outputs)
    return max(o["rel_l2"] for o in outputs)


def _naive(proto: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    session = make_session(emulate(proto, F16, saturate=False).model)
    return [run(session, f) for f in feeds]


# x -> MatMul(W, outlier column) -> p -> Add(b) -> pb -> Add(pb, x) -> h -> LayerNorm -> n -> MatMul(W2) -> y
RESIDUAL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[8, 16] x) => (float[8, 16] y) {
    [proj] p = MatMul (x, W)
    [bias] pb = Add (p, b)
    [res] h = Add (pb, x)
    [ln] n = LayerNormalization <axis = -1> (h, gamma, beta)
    [out] y = MatMul (n, W2)
}
"""


def test_a_residual_branch_reading_the_entry_input_scales_the_whole_domain(tmp_path):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 16)) / 4).astype(np.float32)
    w[:, 3] = rng.standard_normal(16).astype(np.float32) * 2e4  # the outlier column
    proto = _model(RESIDUAL, W=w, b=rng.standard_normal(16).astype(np.float32),
                   W2=(rng.standard_normal((16, 16)) / 4).astype(np.float32),
                   gamma=np.ones(16, np.float32), beta=np.zeros(16, np.float32))
    feeds = [{"x": (rng.standard_normal((8, 16)) * 2).astype(np.float32)} for _ in range(6)]
    bad = _naive(proto, feeds)
    assert any(not np.isfinite(b["y"]).all() for b in bad), "the planted overflow must show"
    result = _convert(tmp_path, proto, feeds)
    assert result, result.share.verdict()
    # The nearest entry 'proj' cannot carry the domain (its input x joins it through the
    # residual add); the domain starts at x and ends at the scale-invariant LayerNorm.
    (rs,) = result.plan.rescales()
    assert rs.entry == "x" and rs.absorbers == ("ln",) and rs.k > 0
    assert any(d.target == "proj" and "own scale domain" in d.reason for d in result.plan.declined)
    assert result.share.flops == 0.0 and result.share.macs == 0.0 and not result.pinned_nodes
    assert _worst_rel_l2(result) <= 1e-3


def _if_model() -> onnx.ModelProto:
    then_branch = parser.parse_graph(
        "thenb () => (float[8, 4] t) <float three = {3.0}> { [m3] x3 = Mul (x, three) [exp3] t = Exp (x3) }")
    else_branch = parser.parse_graph("elseb () => (float[8, 4] e) { [neg] e = Neg (x) }")
    proto = parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[8, 4] x, bool c) => (float[8, 4] y) { [branch] y = If (c) }
    """)
    proto.graph.node[0].attribute.extend([helper.make_attribute("then_branch", then_branch),
                                          helper.make_attribute("else_branch", else_branch)])
    onnx.checker.check_model(proto, full_check=True)
    return proto


def test_an_if_branch_output_beyond_fp16_stays_fp32_with_only_its_exp_pinned(tmp_path):
    # x, c -> If(c): then Exp(3x) (x up to 5: 3.3e6), else Neg(x) -> y (a graph output)
    proto = _if_model()
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.uniform(-5, 5, (8, 4)).astype(np.float32), "c": np.array(True)}
             for _ in range(6)]
    feeds[0]["x"][0, 0] = 5.0
    result = _convert(tmp_path, proto, feeds)
    assert result, result.output_check.to_dict()
    (pin,) = result.plan.pins()
    assert pin.nodes == ("exp3",) and "stays FP32 up to the graph output" in pin.why
    assert not result.plan.clamps()
    assert set(result.pinned_nodes) == {"exp3"}  # not the If, not its Mul, not the else branch
    assert result.lowered.fp32_output_nodes == ("branch",)
    lowered = result.lowered.model
    assert lowered.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    branch = next(n for n in lowered.graph.node if n.op_type == "If")
    bodies = {a.name: a.g for a in branch.attribute}
    assert all(o.type.tensor_type.elem_type == TensorProto.FLOAT
               for g in bodies.values() for o in g.output)
    # The Neg of the else branch still runs in FP16: its output is cast up at the border.
    casts = [n for n in bodies["else_branch"].node if n.op_type == "Cast"]
    assert [helper.get_attribute_value(c.attribute[0]) for c in casts] == [TensorProto.FLOAT16,
                                                                           TensorProto.FLOAT]
    assert _worst_rel_l2(result) <= 1e-2
    # The share gate names the Exp and shows its FLOPs, but does not hold it against the
    # conversion: the true range of its output needs FP32.
    (island,) = result.share.islands
    assert island.required and island.nodes == ("exp3",) and result.share.avoidable == 0.0
    assert "required in FP32 by range or op support: exp3" in result.share.verdict()
    ref = run(make_session(proto), feeds[0])["y"]
    out = run(make_session(lowered), feeds[0])["y"]
    assert np.abs(ref).max() > F16.max and np.isfinite(out).all()


# x -> Gemm(W ~ 3e-10, b ~ 1e-9) -> y   (the logits of a randomly initialised classifier)
CLASSIFIER = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[8, 16] x) => (float[8, 10] y) {
    [fc] y = Gemm (x, W, b)
}
"""


def test_underflowing_logits_are_scaled_up_and_compensated_on_the_host(tmp_path):
    rng = np.random.default_rng(2)
    proto = _model(CLASSIFIER, W=(rng.standard_normal((16, 10)) * 3e-10).astype(np.float32),
                   b=(rng.standard_normal(10) * 1e-9).astype(np.float32))
    feeds = [{"x": rng.standard_normal((8, 16)).astype(np.float32)} for _ in range(6)]
    assert all(np.abs(b["y"]).max() < F16.min_subnormal for b in _naive(proto, feeds))
    result = _convert(tmp_path, proto, feeds)
    assert result, result.output_check.to_dict()
    (rs,) = result.plan.rescales()
    assert rs.entry == "fc" and rs.k < 0 and rs.absorbers == ("y",)
    # The plan says where the multiply-back happens: on the host, not after the output Cast.
    assert f"y leaves the device scaled, the host multiplies it back by 2^{rs.k}" in rs.why
    assert "after the output Cast" not in rs.why
    assert _worst_rel_l2(result) <= 1e-2
    # The compensation leaves the device (every target, pins or not): the FP16 logits are
    # cast up and the host multiplies them back by 2^k.
    assert result.host_scales == {"y": 2.0 ** rs.k}
    lowered = result.lowered.model
    made = {o: n for n in lowered.graph.node for o in n.output}
    cast = made["y"]
    assert cast.op_type == "Cast" and helper.get_attribute_value(cast.attribute[0]) == TensorProto.FLOAT
    assert made[cast.input[0]].op_type == "Gemm"


# x -> Add(bias) -> l -> Exp -> e -> ReduceSum -> s ; Div(e, s) -> y   (no max subtracted)
SOFTMAX = """
<ir_version: 8, opset_import: ["" : 18]>
g (float[8, 10] x) => (float[8, 10] y) {
    [bias] l = Add (x, b)
    [exp] e = Exp (l)
    [sum] s = ReduceSum <keepdims = 1> (e, ax)
    [div] y = Div (e, s)
}
"""


def test_a_written_out_softmax_is_shifted_and_its_exp_stays_fp16(tmp_path):
    rng = np.random.default_rng(3)
    proto = _model(SOFTMAX, b=rng.uniform(-1, 1, 10).astype(np.float32), ax=np.array([1], np.int64))
    feeds = [{"x": rng.uniform(-39, 39, (8, 10)).astype(np.float32)} for _ in range(6)]
    assert any(not np.isfinite(b["y"]).all() for b in _naive(proto, feeds))
    # A graph of nothing but elementwise nodes: its FLOPs share says little, its MACs none.
    result = _convert(tmp_path, proto, feeds, max_fp32_share=1.0)
    assert result, result.output_check.to_dict()
    shift = next(a for a in result.plan.actions if isinstance(a, SoftmaxShift))
    assert shift.exp == "exp" and shift.covers == ("e", "s", "y") and shift.fp32_shift
    # Logits up to 40 are too coarse in FP16 for exp: the bias Add and the subtraction stay
    # FP32 (elementwise); the Exp, its sum and the division run in FP16.
    assert {"exp", "sum", "div"}.isdisjoint(result.pinned_nodes)
    assert "bias" in result.pinned_nodes and result.share.macs == 0.0
    lowered = result.lowered.model
    made = {o: n for n in lowered.graph.node for o in n.output}
    exp = next(n for n in lowered.graph.node if n.op_type == "Exp")
    to_f16 = made[exp.input[0]]
    assert to_f16.op_type == "Cast" and helper.get_attribute_value(to_f16.attribute[0]) == TensorProto.FLOAT16
    assert _worst_rel_l2(result) <= 1e-2


def test_a_softmax_shift_never_pins_the_matmul_that_makes_the_logits(tmp_path):
    # x -> MatMul(W) -> l (up to ~30) -> Exp -> ReduceSum -> Div -> y
    rng = np.random.default_rng(4)
    text = SOFTMAX.replace("[bias] l = Add (x, b)", "[fc] l = MatMul (x, W)").replace(
        "float[8, 10] x", "float[8, 16] x")
    proto = _model(text, W=(rng.standard_normal((16, 10)) * 2.5).astype(np.float32),
                   ax=np.array([1], np.int64))
    feeds = [{"x": rng.standard_normal((8, 16)).astype(np.float32)} for _ in range(6)]
    result = _convert(tmp_path, proto, feeds)
    assert result, result.output_check.to_dict()
    assert [type(a) for a in result.plan.actions] == [SoftmaxShift]
    assert not result.pinned_nodes and result.share.flops == 0.0


# x -> Mul(x, x) -> q (6.8e4: past FP16) -> Mul(q, 0.56) -> z (3.8e4: within FP16, past the
# headroom) -> MatMul(W) -> y ; x -> Sigmoid -> g   (the Sigmoid keeps x from being rescaled)
HEADROOM = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[8, 16] x) => (float[8, 4] y, float[8, 16] g) <float c = {0.56}> {
    [sq] q = Mul (x, x)
    [mulc] z = Mul (q, c)
    [mm] y = MatMul (z, W)
    [sig] g = Sigmoid (x)
}
"""


def test_a_value_short_of_headroom_never_pulls_a_matmul_into_an_island(tmp_path):
    rng = np.random.default_rng(5)
    proto = _model(HEADROOM, W=(rng.standard_normal((16, 4)) * 1e-3).astype(np.float32))
    feeds = [{"x": rng.standard_normal((8, 16)).astype(np.float32)} for _ in range(6)]
    feeds[0]["x"][0, 0] = 260.0
    result = _convert(tmp_path, proto, feeds, max_fp32_share=1.0)
    z = result.stats.tensors["z"].absmax
    assert GENERIC.resolve().limit < z < F16.max  # 3.8e4 against a limit of 32752
    assert result, result.output_check.to_dict()
    (pin,) = result.plan.pins()
    assert pin.nodes == ("sq", "mulc") and "z leaves it short of headroom but within fp16" in pin.why
    assert "mm" not in result.pinned_nodes and result.share.macs == 0.0
    ops = _ops(result.rewritten)
    assert all(ops[n] not in LINEAR for n in result.pinned_nodes)


def test_scale_ups_read_as_powers_of_two():
    assert action_target({"action": "rescale", "entry": "fc", "k": -4}) == "fc (x2^4)"
    assert action_target({"action": "rescale", "entry": "fc", "k": 4}) == "fc (x2^-4)"
    from npuprep.plan.plan import Plan

    plan = Plan("f", "generic", "fp16", actions=(Rescale("fc", -4, why="w"),))
    assert "rescale fc by 2^4 (user)" in dump_plan(plan) and "2^--" not in dump_plan(plan)


# x -> MatMul(W: channel 0 x 1e5, others x 2e-4) -> h -> Relu -> r -> MatMul(V) -> y
WIDE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[64, 4] x) => (float[64, 3] y) <float[4, 4] W = {100000.0,0.0,0.0,0.0, 0.0,0.0002,0.0,0.0, 0.0,0.0,0.0002,0.0, 0.0,0.0,0.0,0.0002}, float[4, 3] V = {0.00001,0.0,0.0, 0.0,1.0,0.0, 0.0,0.0,1.0, 0.0,1.0,1.0}> {
    [mm1] h = MatMul (x, W)
    [relu] r = Relu (h)
    [mm2] y = MatMul (r, V)
}
"""


def test_the_fp32_share_gate_names_the_costliest_island_and_its_declined_remedy(tmp_path):
    # A rescale of mm1 would flush channels 1-3 under FP16's normals: the island takes both
    # matmuls, and the conversion fails on its FP32 share although its outputs are exact.
    proto = parser.parse_model(WIDE)
    path = tmp_path / "wide.onnx"
    onnx.save(proto, path)
    rng = np.random.default_rng(6)
    data = _data(tmp_path, [{"x": rng.standard_normal((64, 4)).astype(np.float32)} for _ in range(2)])
    proc = run_cli("convert", path, "--target", "generic", "--data", data, "-o", tmp_path / "o.onnx")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.strip().splitlines()
    verdict = " ".join(" ".join(lines[next(i for i, t in enumerate(lines) if t.startswith("FAILED")):]).split())
    assert verdict.startswith("FAILED: 100% of FLOPs stay FP32 (over 10%); costliest island "
                              "mm1, relu, mm2 (100%): rescale declined; report: ")
    assert len(verdict.split("; report: ")[0]) <= 100 and max(map(len, lines)) <= 100
    report = json.loads((tmp_path / "o.report.json").read_text())
    assert report["passed"] is False and report["verification"]["passed"] is True
    # The report carries the whole reason.
    assert "rescale declined: 2^-" in report["fp32_verdict"]
    assert "below the smallest fp16 normal" in report["fp32_verdict"]
    md = (tmp_path / "o.report.md").read_text()
    assert "**FAILED**" in md and "## FP32 islands, costliest first" in md
    ok = run_cli("convert", path, "--target", "generic", "--data", data, "-o", tmp_path / "p.onnx",
                 "--max-fp32-share", "100%")
    assert ok.returncode == 0, ok.stdout
    assert ok.stdout.strip().splitlines()[-1].startswith("PASSED")
    bad = run_cli("convert", path, "--target", "generic", "--data", data, "--max-fp32-share", "x")
    assert bad.returncode == 2 and "--max-fp32-share" in bad.stderr


def test_the_share_counts_only_fp32_nodes_and_ranks_islands():
    from npuprep.verify.fp32_share import fp32_share

    proto = parser.parse_model(WIDE)
    share = fp32_share(proto, [(("relu",), "relu", ""), (("mm1", "relu"), "mm1", "rescale declined: x")],
                       limit=0.5)
    # mm1: 2*64*4*4 = 2048, relu: 256, mm2: 2*64*3*4 = 1536 FLOPs.
    assert [i.nodes for i in share.islands] == [("mm1",), ("relu",)]
    assert share.flops == (2048 + 256) / (2048 + 256 + 1536)
    assert share.macs == 2048 / (2048 + 1536)
    assert not share and "costliest island mm1 (53.3% of FLOPs): rescale declined: x" in share.verdict()


# x -> Mul(x, x) -> q -> Mul(q, 0.56) -> z (3.8e4) -> MatMul(W) -> h (~300) -> Mul(h, h) -> q2
# -> Sqrt -> r -> Tanh -> y ; x -> Sigmoid -> g   (two islands with a matmul between them)
BETWEEN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[8, 16] x) => (float[8, 16] y, float[8, 16] g) <float c = {0.56}> {
    [sq] q = Mul (x, x)
    [mulc] z = Mul (q, c)
    [mm] h = MatMul (z, W)
    [sq2] q2 = Mul (h, h)
    [root] r = Sqrt (q2)
    [tanh] y = Tanh (r)
    [sig] g = Sigmoid (x)
}
"""


def test_merging_islands_never_bridges_over_the_matmul_between_them(tmp_path):
    rng = np.random.default_rng(7)
    proto = _model(BETWEEN, W=np.full((16, 16), 8e-3, np.float32))
    feeds = [{"x": rng.standard_normal((8, 16)).astype(np.float32)} for _ in range(6)]
    feeds[0]["x"][0, 0] = 260.0
    result = _convert(tmp_path, proto, feeds, max_fp32_share=1.0)
    assert result.stats.tensors["q2"].absmax > F16.max > result.stats.tensors["z"].absmax
    assert result, result.output_check.to_dict()
    assert [p.nodes for p in result.plan.pins()] == [("sq", "mulc"), ("sq2", "root")]
    assert "mm" not in result.pinned_nodes and result.share.macs == 0.0


def test_a_residual_branch_reading_a_block_output_scales_from_that_tensor(tmp_path):
    # x -> MatMul(W0) -> a -> Relu -> blk ; blk -> MatMul(W, outlier column) -> p -> Add(b)
    # -> pb -> Add(pb, blk) -> h -> LayerNorm -> n -> MatMul(W2) -> y
    rng = np.random.default_rng(8)
    text = RESIDUAL.replace("[proj] p = MatMul (x, W)", "[mm0] a = MatMul (x, W0)\n"
                            "    [act] blk = Relu (a)\n    [proj] p = MatMul (blk, W)").replace(
        "[res] h = Add (pb, x)", "[res] h = Add (pb, blk)")
    w = (rng.standard_normal((16, 16)) / 4).astype(np.float32)
    w[:, 3] = rng.standard_normal(16).astype(np.float32) * 2e4
    proto = _model(text, W0=(rng.standard_normal((16, 16)) / 2).astype(np.float32), W=w,
                   b=rng.standard_normal(16).astype(np.float32),
                   W2=(rng.standard_normal((16, 16)) / 4).astype(np.float32),
                   gamma=np.ones(16, np.float32), beta=np.zeros(16, np.float32))
    feeds = [{"x": (rng.standard_normal((8, 16)) * 2).astype(np.float32)} for _ in range(6)]
    result = _convert(tmp_path, proto, feeds)
    assert result, result.share.verdict()
    (rs,) = result.plan.rescales()
    assert rs.entry == "blk" and rs.absorbers == ("ln",)
    # The exact Mul on blk runs in FP16 (blk fits it): nothing stays FP32.
    assert result.share.flops == 0.0 and not result.pinned_nodes
    made = {o: n for n in result.rewritten.graph.node for o in n.output}
    assert made[made["p"].input[0]].op_type == "Mul"
    assert _worst_rel_l2(result) <= 1e-3
