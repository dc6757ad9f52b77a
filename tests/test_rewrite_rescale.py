"""Rescale: power-of-two scales enter, travel and are absorbed exactly; declines say why."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from rewrite_util import C, RandomChain, build, outputs, rel_err

from npuprep.errors import NpuprepError
from npuprep.numerics import get_format
from npuprep.rewrite.rescale import apply_rescale, check_rescale
from npuprep.verify.emulate import emulate

RNG = np.random.default_rng(7)
HEAD = '<ir_version: 8, opset_import: ["" : 17]>'


def _w(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.normal(size=shape) * scale).astype(np.float32)


def _same_function(ref: onnx.ModelProto, cand: onnx.ModelProto, feeds: dict) -> float:
    a, b = outputs(ref, feeds), outputs(cand, feeds)
    return max(rel_err(a[k], b[k]) for k in a)


def conv_chain() -> onnx.ModelProto:
    # x -> Conv(W1 large) -> Relu -> MaxPool -> Conv(W2) -> y
    return build(HEAD + """
    g (float[1,3,6,6] x) => (float[1,4,6,6] y) <float[4,3,3,3] W1, float[4] B1, float[4,4,1,1] W2, float[4] B2> {
      a = Conv<pads=[1,1,1,1]>(x, W1, B1)
      r = Relu(a)
      p = MaxPool<kernel_shape=[3,3], pads=[1,1,1,1]>(r)
      y = Conv(p, W2, B2)
    }""", W1=_w(4, 3, 3, 3, scale=3000), B1=_w(4, scale=100), W2=_w(4, 4, 1, 1, scale=0.01), B2=_w(4))


def test_conv_chain_is_scaled_and_absorbed_exactly():
    model = conv_chain()
    before = model.SerializeToString(deterministic=True)
    check = check_rescale(model, "node_of_a", 6)
    assert check and check.exponents == {"a": -6, "r": -6, "p": -6, "y": 0}
    assert [a.node for a in check.absorbers] == ["node_of_y"]
    result = apply_rescale(model, "node_of_a", 6)
    assert result.modified and "node_of_y" in result.reason
    assert result.details["tensor_scales"] == {"a": 2**-6, "r": 2**-6, "p": 2**-6}
    weights = {i.name: numpy_helper.to_array(i) for i in result.model.graph.initializer}
    original = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    np.testing.assert_array_equal(weights["W1"], original["W1"] / 64)
    np.testing.assert_array_equal(weights["W2"], original["W2"] * 64)
    feeds = {"x": RNG.normal(size=(1, 3, 6, 6)).astype(np.float32)}
    assert _same_function(model, result.model, feeds) <= 1e-5
    # The input is untouched and the output is byte-identical across runs.
    assert model.SerializeToString(deterministic=True) == before
    again = apply_rescale(model, "node_of_a", 6).model
    assert again.SerializeToString(deterministic=True) == result.model.SerializeToString(deterministic=True)


def test_rescale_removes_fp16_overflow_in_emulation():
    model = conv_chain()
    feeds = {"x": RNG.normal(size=(1, 3, 6, 6)).astype(np.float32) * 4}
    fp16 = get_format("fp16")
    before = outputs(emulate(model, fp16, saturate=False).model, feeds)["y"]
    assert not np.isfinite(before).all()
    result = apply_rescale(model, "node_of_a", 8)
    after = outputs(emulate(result.model, fp16, saturate=False).model, feeds)["y"]
    ref = outputs(model, feeds)["y"]
    assert np.isfinite(after).all()
    assert rel_err(ref, after) < 1e-2


def bev_model() -> onnx.ModelProto:
    # p, q (decimetres) -> Sub -> Mul(d, d) -> ReduceSum -> Mul(-1/sigma2) -> Exp -> w
    return build(HEAD + """
    g (float[8,1,2] p, float[1,8,2] q) => (float[8,8] w) <float nsig> {
      d = Sub(p, q)
      d2 = Mul(d, d)
      s = ReduceSum<keepdims=0>(d2, ax)
      z = Mul(s, nsig)
      w = Exp(z)
    }""".replace("<float nsig>", "<float nsig, int64[1] ax>"),
        nsig=np.array(-1.0 / 2e5, np.float32), ax=np.array([2]))


def test_graph_input_entries_and_constant_absorber_for_exp():
    model = bev_model()
    result = apply_rescale(model, "p", 5)
    assert result.modified
    # The residual Sub pulls q into the domain; the Exp's constant factor takes s^2.
    assert {e["name"] for e in result.details["entries"]} == {"p", "q"}
    assert result.details["absorbers"] == [{"node": "node_of_z", "kind": "constant", "exponent": -10}]
    assert sorted(result.details["fp32_nodes"]) == ["rescale_in_p", "rescale_in_q"]
    assert result.details["tensor_scales"]["d2"] == 2.0**-10
    assert "p" not in result.details["tensor_scales"]
    feeds = {"p": RNG.uniform(0, 1000, (8, 1, 2)).astype(np.float32),
             "q": RNG.uniform(0, 1000, (1, 8, 2)).astype(np.float32)}
    assert _same_function(model, result.model, feeds) <= 1e-5
    fp16 = get_format("fp16")
    naive = outputs(emulate(model, fp16, saturate=False).model, feeds)["w"]
    fixed = emulate(result.model, fp16, saturate=False, pinned_nodes=result.details["fp32_nodes"])
    out = outputs(fixed.model, feeds)["w"]
    ref = outputs(model, feeds)["w"]
    # Naive FP16: d*d overflows to inf and Exp(-inf) silently flattens weights to 0.
    assert rel_err(ref, naive) > 0.5
    assert np.isfinite(out).all() and rel_err(ref, out) < 1e-2


def decomposed_layernorm() -> onnx.ModelProto:
    # x -> MatMul(W) -> Add(b) -> (h - mean) / Sqrt(ReduceMean((h - mean)^2) + eps) -> MatMul(W2) -> y
    return build(HEAD + """
    g (float[2,16] x) => (float[2,4] y) <float[16,16] W, float[16] b, float eps, float[16,4] W2> {
      h = MatMul(x, W)
      hb = Add(h, b)
      mu = ReduceMean<axes=[-1]>(hb)
      c = Sub(hb, mu)
      c2 = Mul(c, c)
      v = ReduceMean<axes=[-1]>(c2)
      ve = Add(v, eps)
      sd = Sqrt(ve)
      n = Div(c, sd)
      y = MatMul(n, W2)
    }""", W=_w(16, 16, scale=300), b=_w(16, scale=100), eps=np.array(1e-5, np.float32), W2=_w(16, 4))


@pytest.mark.parametrize("k", [5, 6, -3])
def test_decomposed_layernorm_ratio_and_epsilon(k):
    model = decomposed_layernorm()
    result = apply_rescale(model, "node_of_h", k)
    assert result.modified
    assert result.details["absorbers"] == [{"node": "node_of_n", "kind": "ratio", "exponent": -k}]
    eps = {i.name: numpy_helper.to_array(i) for i in result.model.graph.initializer}["eps"]
    assert float(eps) == pytest.approx(1e-5 * 4.0**-k, rel=1e-6)
    assert result.details["scaled_constants"]["eps"]["exponent"] == -2 * k
    assert result.details["tensor_scales"]["v"] == 4.0**-k
    feeds = {"x": RNG.normal(size=(2, 16)).astype(np.float32)}
    assert _same_function(model, result.model, feeds) <= 1e-5


def test_layernorm_and_batchnorm_absorb_with_epsilon():
    # x -> Conv -> BatchNorm -> Relu -> Conv -> LayerNorm -> y
    model = build(HEAD + """
    g (float[1,3,4,4] x) => (float[1,4,4,4] y) <float[4,3,1,1] W, float[4] g1, float[4] b1, float[4] m1, float[4] v1, float[4,4,1,1] W2, float[4] g2, float[4] b2> {
      a = Conv(x, W)
      n = BatchNormalization<epsilon=1e-3>(a, g1, b1, m1, v1)
      r = Relu(n)
      c = Conv(r, W2)
      y = LayerNormalization<axis=-1, epsilon=1e-5>(c, g2, b2)
    }""", W=_w(4, 3, 1, 1, scale=500), g1=_w(4), b1=_w(4), m1=_w(4, scale=100),
        v1=np.abs(_w(4, scale=1e4)), W2=_w(4, 4, 1, 1, scale=100), g2=_w(4), b2=_w(4))
    bn = check_rescale(model, "node_of_a", 8)
    assert bn and [(a.node, a.kind) for a in bn.absorbers] == [("node_of_n", "batchnorm")]
    ln = apply_rescale(model, "node_of_c", 4)
    assert [(a["node"], a["kind"]) for a in ln.details["absorbers"]] == [("node_of_y", "epsilon")]
    node = next(n for n in ln.model.graph.node if n.op_type == "LayerNormalization")
    assert helper.get_attribute_value(node.attribute[1]) == pytest.approx(1e-5 / 256, rel=1e-6)
    feeds = {"x": RNG.normal(size=(1, 3, 4, 4)).astype(np.float32)}
    assert _same_function(model, ln.model, feeds) <= 1e-5
    assert _same_function(model, apply_rescale(model, "node_of_a", 8).model, feeds) <= 1e-5


def test_residual_add_pulls_the_other_branch_into_the_domain():
    # x -> Conv1 -> a;  x -> Conv2 -> b;  Add(a, Relu(b)) -> Conv3 -> y
    model = build(HEAD + """
    g (float[1,2,4,4] x) => (float[1,2,4,4] y) <float[2,2,1,1] W1, float[2,2,1,1] W2, float[2] B2, float[2,2,1,1] W3> {
      a = Conv(x, W1)
      b = Conv(x, W2, B2)
      rb = Relu(b)
      s = Add(a, rb)
      y = Conv(s, W3)
    }""", W1=_w(2, 2, 1, 1), W2=_w(2, 2, 1, 1), B2=_w(2), W3=_w(2, 2, 1, 1))
    result = apply_rescale(model, "node_of_a", 3)
    assert {e["name"] for e in result.details["entries"]} == {"node_of_a", "node_of_b"}
    assert set(result.details["tensor_scales"]) == {"a", "b", "rb", "s"}
    feeds = {"x": RNG.normal(size=(1, 2, 4, 4)).astype(np.float32)}
    assert _same_function(model, result.model, feeds) <= 1e-5


def test_graph_output_gets_an_fp32_exit():
    # x -> Gemm -> Relu -> y (graph output)
    model = build(HEAD + """
    g (float[2,8] x) => (float[2,4] y) <float[8,4] W, float[4] B> {
      h = Gemm(x, W, B)
      y = Relu(h)
    }""", W=_w(8, 4, scale=1e3), B=_w(4))
    result = apply_rescale(model, "node_of_h", 4)
    assert result.details["exits"] == ["y"] and result.details["fp32_nodes"] == ["rescale_out_y"]
    assert "y" not in result.details["tensor_scales"] and result.details["tensor_scales"]["h"] == 1 / 16
    feeds = {"x": RNG.normal(size=(2, 8)).astype(np.float32)}
    assert _same_function(model, result.model, feeds) <= 1e-5


@pytest.mark.parametrize("text, entry, k, says", [
    # x -> Conv -> Sigmoid -> y
    ("""g (float[1,2,4,4] x) => (float[1,2,4,4] y) <float[2,2,1,1] W> {
          a = Conv(x, W)
          y = Sigmoid(a)
        }""", "node_of_a", 2, "Sigmoid 'node_of_y' reads scaled tensor 'a'"),
    # x -> Conv -> a; Add(a, Sigmoid(x)) -> y
    ("""g (float[1,2,4,4] x) => (float[1,2,4,4] y) <float[2,2,1,1] W> {
          a = Conv(x, W)
          sx = Sigmoid(x)
          y = Add(a, sx)
        }""", "node_of_a", 2, "producer Sigmoid 'node_of_sx' cannot be scaled exactly"),
    # x -> Conv(W) -> Relu -> Conv(W) -> y  (W shared)
    ("""g (float[1,2,4,4] x) => (float[1,2,4,4] y) <float[2,2,1,1] W> {
          a = Conv(x, W)
          r = Relu(a)
          y = Conv(r, W)
        }""", "node_of_a", 2, "shared with other nodes"),
    # x -> MatMul -> Sqrt -> y  (odd exponent cannot be halved)
    ("""g (float[2,2] x) => (float[2,2] y) <float[2,2] W> {
          a = MatMul(x, W)
          y = Sqrt(a)
        }""", "node_of_a", 3, "not an integer power of two"),
])
def test_declines_with_a_reason(text, entry, k, says):
    model = build(HEAD + text, W=_w(*([2, 2, 1, 1] if "Conv" in text else [2, 2])))
    check = check_rescale(model, entry, k)
    assert not check and says in check.reason
    result = apply_rescale(model, entry, k)
    assert not result.modified and result.model is model and says in result.reason


def test_scaled_tensor_read_inside_if_body_declines():
    # x -> MatMul -> a; If(c) { then: Relu(a) else: Neg(a) } -> y
    model = build(HEAD + """
    g (float[2,2] x, bool c) => (float[2,2] y) <float[2,2] W> {
      a = MatMul(x, W)
      y = If(c) <then_branch = t () => (float[2,2] o1) { o1 = Relu(a) },
                 else_branch = e () => (float[2,2] o2) { o2 = Neg(a) }>
    }""", W=_w(2, 2))
    check = check_rescale(model, "node_of_a", 2)
    assert not check and "If/Loop/Scan body" in check.reason


def test_unknown_entry_and_zero_k_are_user_errors():
    model = conv_chain()
    with pytest.raises(NpuprepError, match="nowhere"):
        check_rescale(model, "nowhere", 2)
    with pytest.raises(NpuprepError, match="non-zero"):
        check_rescale(model, "node_of_a", 0)


# ---- randomised graphs: seeded chains and residual blocks (rewrite_util.RandomChain) ----


def test_randomised_graphs_compute_the_same_function():
    feasible = declined = 0
    for seed in range(40):
        model, kinds, first = RandomChain(seed).model()
        k = int(np.random.default_rng(seed).choice([-4, -2, 2, 4, 6]))
        result = apply_rescale(model, f"n_{first}", k)
        if not result.modified:
            declined += 1
            assert result.reason and result.model is model
            # Declines happen only where the scale really cannot pass.
            assert "tanh" in kinds or "sigmoid_after_mul" in kinds or "not exact" in result.reason, (
                seed, kinds, result.reason)
            continue
        feasible += 1
        feeds = {"x": np.random.default_rng(seed).normal(size=(1, C, 4, 4)).astype(np.float32)}
        err = _same_function(model, result.model, feeds)
        assert err <= 1e-5, (seed, kinds, k, err)
        assert result.details["tensor_scales"][first] == 2.0**-k
    assert feasible >= 25 and declined >= 1


def test_bf16_weight_cast_in_graph_is_a_constant_entry():
    # W (bf16) -> Cast(float) -> Gemm(x, W) -> Relu -> Gemm(V) -> y
    import ml_dtypes

    model = build(HEAD + """
    g (float[2,4] x) => (float[2,3] y) <bfloat16[4,4] W, float[4,3] V> {
      wf = Cast<to=1>(W)
      h = Gemm(x, wf)
      r = Relu(h)
      y = Gemm(r, V)
    }""", W=(RNG.normal(size=(4, 4)) * 3e4).astype(ml_dtypes.bfloat16), V=_w(4, 3, scale=1e-3))
    result = apply_rescale(model, "node_of_h", 3)
    assert result.modified and result.details["tensor_scales"] == {"h": 0.125, "r": 0.125}
    feeds = {"x": RNG.normal(size=(2, 4)).astype(np.float32)}
    assert _same_function(model, result.model, feeds) <= 1e-5


def test_group_normalization_absorbs_with_epsilon():
    # x -> Conv(W large) -> GroupNormalization -> y
    model = build("""<ir_version: 10, opset_import: ["" : 21]>
    g (float[1,4,3,3] x) => (float[1,4,3,3] y) <float[4,4,1,1] W, float[4] s, float[4] b> {
      a = Conv(x, W)
      y = GroupNormalization<num_groups=2, epsilon=1e-5>(a, s, b)
    }""", W=_w(4, 4, 1, 1, scale=1e4), s=_w(4), b=_w(4))
    result = apply_rescale(model, "node_of_a", 4)
    assert result.details["absorbers"] == [{"node": "node_of_y", "kind": "epsilon", "exponent": -4}]
    feeds = {"x": RNG.normal(size=(1, 4, 3, 3)).astype(np.float32)}
    assert _same_function(model, result.model, feeds) <= 1e-5


# ---- a constant factor absorbs for a reader that is not scale-free; shared weights ----


def risk_model(constant_factor: bool) -> onnx.ModelProto:
    # traj -> Unsqueeze -> Sub(obst) -> Pow 2 -> ReduceSum = d2 -> [Mul(d2, nsig) -> Add(prior) |
    #   Sub(prior, d2)] -> Exp -> softmax = attn;  Mul(attn, d2) -> ReduceSum -> risk_cost
    logits = ("z = Mul(d2, nsig)\n      logits = Add(z, prior)" if constant_factor
              else "logits = Sub(prior, d2)")
    return build(HEAD + f"""
    g (float[1,4,2] traj) => (float[1,4] risk_cost, float[1,4,3] attn)
      <float[1,1,3,2] obst, float two, float nsig, float prior, int64[1] ax, int64[1] ax2> {{
      tu = Unsqueeze(traj, ax2)
      off = Sub(tu, obst)
      sq = Pow(off, two)
      d2 = ReduceSum<keepdims=0>(sq, ax)
      {logits}
      e = Exp(logits)
      tot = ReduceSum<keepdims=1>(e, ax)
      attn = Div(e, tot)
      rw = Mul(attn, d2)
      risk_cost = ReduceSum<keepdims=0>(rw, ax)
    }}""", obst=RNG.uniform(0, 1000, (1, 1, 3, 2)).astype(np.float32), two=np.array(2.0, np.float32),
        nsig=np.array(-1e-5, np.float32), prior=np.array(8.0, np.float32),
        ax=np.array([-1]), ax2=np.array([2]))


def test_constant_factor_absorbs_for_exp_while_the_other_reader_carries_the_scale_out():
    model = risk_model(constant_factor=True)
    result = apply_rescale(model, "traj", 4)
    assert result.modified
    # Mul(d2, nsig) takes s^2 for the Exp; Mul(attn, d2) carries it to the output's FP32 exit.
    assert result.details["absorbers"] == [{"node": "node_of_z", "kind": "constant", "exponent": -8}]
    assert result.details["exits"] == ["risk_cost"]
    scales = result.details["tensor_scales"]
    assert scales["d2"] == scales["rw"] == 2.0**-8 and "logits" not in scales and "attn" not in scales
    weights = {i.name: numpy_helper.to_array(i) for i in result.model.graph.initializer}
    assert float(weights["nsig"]) == np.float32(-1e-5) * 256
    feeds = {"traj": RNG.uniform(0, 1000, (1, 4, 2)).astype(np.float32)}
    assert _same_function(model, result.model, feeds) <= 1e-5
    # Naive FP16: d2 (up to 2e6) overflows; scaled, every stored tensor fits.
    fp16 = get_format("fp16")
    ref = outputs(model, feeds)["risk_cost"]
    naive = outputs(emulate(model, fp16, saturate=False).model, feeds)["risk_cost"]
    fixed = emulate(result.model, fp16, saturate=False, pinned_nodes=result.details["fp32_nodes"])
    out = outputs(fixed.model, feeds)["risk_cost"]
    assert not np.isfinite(naive).all()
    assert np.isfinite(out).all() and rel_err(ref, out) < 1e-2


def test_exp_without_a_constant_factor_before_it_declines():
    model = risk_model(constant_factor=False)
    check = check_rescale(model, "traj", 4)
    assert not check
    assert "Exp 'node_of_e' reads scaled tensor 'logits' (2^-8)" in check.reason
    assert not apply_rescale(model, "traj", 4).modified


def test_constant_factor_absorbs_before_an_add_of_a_tensor_that_cannot_join():
    # x -> MatMul(W) = h (output) -> Mul(c) -> Add(., Sigmoid(x)) -> y
    model = build(HEAD + """
    g (float[2,4] x) => (float[2,4] y, float[2,4] h) <float[4,4] W, float c> {
      h = MatMul(x, W)
      hc = Mul(h, c)
      sx = Sigmoid(x)
      y = Add(hc, sx)
    }""", W=_w(4, 4, scale=1e3), c=np.array(0.01, np.float32))
    result = apply_rescale(model, "node_of_h", 3)
    assert result.modified and result.details["exits"] == ["h"]
    assert result.details["absorbers"] == [{"node": "node_of_hc", "kind": "constant", "exponent": -3}]
    feeds = {"x": RNG.normal(size=(2, 4)).astype(np.float32)}
    assert _same_function(model, result.model, feeds) <= 1e-5


def _ln_branch(prefix: str, features: str) -> str:
    """MatMul(features, W) + b, then a decomposed LayerNorm; writes `<prefix>n`."""
    p = prefix
    return f"""
      {p}h = MatMul({features}, W)
      {p}hb = Add({p}h, b)
      {p}mu = ReduceMean<axes=[-1]>({p}hb)
      {p}c = Sub({p}hb, {p}mu)
      {p}c2 = Pow({p}c, two)
      {p}v = ReduceMean<axes=[-1]>({p}c2)
      {p}ve = Add({p}v, eps)
      {p}sd = Sqrt({p}ve)
      {p}n = Div({p}c, {p}sd)"""


def guidance_model(uncond_tail: str) -> onnx.ModelProto:
    # xc -> MatMul(W) + b -> LayerNorm = cn;  xu -> MatMul(W) + b -> <uncond_tail> = un;
    # Sub(cn, un) -> y  (W and b shared by both branches of classifier-free guidance)
    return build(HEAD + f"""
    g (float[2,8] xc, float[2,8] xu) => (float[2,8] y) <float[8,8] W, float[8] b, float two, float eps> {{
      {_ln_branch("c", "xc")}
      {uncond_tail}
      y = Sub(cn, un)
    }}""", W=_w(8, 8, scale=300), b=_w(8, scale=100), two=np.array(2.0, np.float32),
        eps=np.array(1e-5, np.float32))


def test_shared_weight_scales_every_reader_and_each_branch_absorbs():
    model = guidance_model(_ln_branch("u", "xu"))
    result = apply_rescale(model, "node_of_ch", 5)
    assert result.modified
    assert [(e["name"], e["kind"]) for e in result.details["entries"]] == [
        ("node_of_ch", "weights"), ("node_of_uh", "weights")]
    assert sorted((a["node"], a["kind"]) for a in result.details["absorbers"]) == [
        ("node_of_cn", "ratio"), ("node_of_un", "ratio")]
    # One scaled W serves both readers: edited in place, no copy, the name kept.
    weights = {i.name: numpy_helper.to_array(i) for i in result.model.graph.initializer}
    original = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert set(weights) == set(original)
    np.testing.assert_array_equal(weights["W"], original["W"] / 32)
    np.testing.assert_array_equal(weights["b"], original["b"] / 32)
    assert result.details["tensor_scales"]["uv"] == 2.0**-10
    feeds = {"xc": RNG.normal(size=(2, 8)).astype(np.float32),
             "xu": RNG.normal(size=(2, 8)).astype(np.float32)}
    assert _same_function(model, result.model, feeds) <= 1e-5


def test_shared_weight_reaching_a_reader_that_cannot_absorb_declines():
    # The unconditional branch ends in Tanh(MatMul(xu, W)): scaling W would reach it unabsorbed.
    model = guidance_model("uh = MatMul(xu, W)\n      un = Tanh(uh)")
    check = check_rescale(model, "node_of_ch", 5)
    assert not check
    assert "Tanh 'node_of_un' reads scaled tensor 'uh'" in check.reason
    assert "MatMul 'node_of_uh' reads 'W', scaled for 'node_of_ch'" in check.reason
    result = apply_rescale(model, "node_of_ch", 5)
    assert not result.modified and result.model is model


def test_tied_weight_read_through_transpose_carries_the_scale_to_an_exit():
    # x -> MatMul(W) -> LayerNorm -> y1;  x2 -> MatMul(Transpose(W)) -> y2 (one tied weight)
    model = build(HEAD + """
    g (float[2,4] x, float[2,4] x2) => (float[2,4] y1, float[2,4] y2) <float[4,4] W, float[4] g1, float[4] b1> {
      h = MatMul(x, W)
      y1 = LayerNormalization<axis=-1, epsilon=1e-5>(h, g1, b1)
      wt = Transpose(W)
      y2 = MatMul(x2, wt)
    }""", W=_w(4, 4, scale=1e3), g1=_w(4), b1=_w(4))
    result = apply_rescale(model, "node_of_h", 4)
    assert result.modified and result.details["exits"] == ["y2"]
    assert result.details["tensor_scales"]["wt"] == 2.0**-4
    assert [i.name for i in result.model.graph.initializer if i.name.startswith("W")] == ["W"]
    feeds = {"x": RNG.normal(size=(2, 4)).astype(np.float32),
             "x2": RNG.normal(size=(2, 4)).astype(np.float32)}
    assert _same_function(model, result.model, feeds) <= 1e-5


def test_constant_factor_absorbs_rather_than_an_output_exit():
    # x -> Mul(x, x) -> s -> Div(s, c) -> y (graph output): c takes 2^-2k, no FP32 exit Mul
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4, 8] x) => (float[4, 8] y) <float c = {200000.0}> {
        [sq] s = Mul (x, x)
        [scale] y = Div (s, c)
    }
    """)
    check = check_rescale(model, "x", 4)
    assert check and check.exits == ()
    assert [a.node for a in check.absorbers] == ["scale"]
    result = apply_rescale(model, "x", 4)
    assert result.details["scaled_constants"]["c"]["absmax"] == 200000.0 * 2.0**-8
    feeds = {"x": (np.random.default_rng(0).standard_normal((4, 8)) * 1000).astype(np.float32)}
    assert _same_function(model, result.model, feeds) <= 1e-6


@pytest.mark.parametrize(("ending", "extra"), [
    # decomposed RMSNorm: h / sqrt(mean(h^2) + eps), eps scaled by s^2
    ("q = Mul(h, h)\n      m = ReduceMean<axes=[1]>(q)\n      v = Add(m, eps)\n"
     "      d = Sqrt(v)\n      y = Div(h, d)", "float eps = {0.00001}"),
    ("n = ReduceL2<axes=[1]>(h)\n      y = Div(h, n)", ""),  # L2 normalisation, written out
    ("y = LpNormalization<axis=1, p=2>(h)", ""),
    ("y = Sign(h)", ""),
    ("i = ArgMax<axis=1>(h)\n      f = Cast<to=1>(i)\n      y = Expand(f, shape)", "int64[2] shape = {2, 4}"),
    ("b = Greater(h, zero)\n      y = Cast<to=1>(b)", "float zero = {0.0}"),
])
def test_scale_invariant_consumers_end_the_domain_with_nothing_to_compensate(ending, extra):
    # x -> MatMul(W large) -> h -> <scale-invariant ending> -> y   (no FP32 exit, no absorber weights)
    inits = "float[4,4] W" + (f", {extra}" if extra else "")
    model = build(HEAD + f"""
    g (float[2,4] x) => (float[2,4] y) <{inits}> {{
      h = MatMul(x, W)
      {ending}
    }}""", W=_w(4, 4, scale=3e4))
    check = check_rescale(model, "node_of_h", 3)
    assert check, check.reason
    assert check.exits == () and all(p == 0 for t, p in check.exponents.items() if t == "y")
    done = apply_rescale(model, "node_of_h", 3)
    feeds = {"x": _w(2, 4)}
    assert _same_function(model, done.model, feeds) <= 1e-6


def test_a_block_output_without_weights_enters_through_an_exact_mul():
    # x -> Relu -> r (also an output) -> MatMul(W) -> y ; x -> Shape -> s (int64 output)
    model = build(HEAD + """
    g (float[2,4] x) => (float[2,3] y, float[2,4] r, int64[2] s) <float[4,3] W> {
      r = Relu(x)
      y = MatMul(r, W)
      s = Shape(x)
    }""", W=_w(4, 3))
    done = apply_rescale(model, "r", 2)
    assert done, done.reason
    (entry,) = done.details["entries"]
    assert entry["name"] == "r" and entry["kind"] == "tensor"
    assert list(done.details["input_nodes"].values()) == ["r"]
    # r stays the reference for its other reader (the graph output); MatMul absorbs the scale.
    feeds = {"x": _w(2, 4)}
    assert _same_function(model, done.model, feeds) <= 1e-6
    declined = check_rescale(model, "s", 2)
    assert not declined and "not a float tensor" in declined.reason


def test_rescales_skip_the_checker_each_and_apply_plan_checks_the_series_once(monkeypatch):
    # x -> Conv(W1 large) -> Relu -> MaxPool -> Conv(W2) -> y, rescaled twice in one plan
    from types import SimpleNamespace

    from npuprep.rewrite import apply as apply_module
    from npuprep.rewrite import graph_ops

    model = conv_chain()
    checked = apply_rescale(model, "node_of_a", 6)
    unchecked = apply_rescale(model, "node_of_a", 6, run_checker=False)
    assert (unchecked.model.SerializeToString(deterministic=True)
            == checked.model.SerializeToString(deterministic=True))
    assert unchecked.details == checked.details and unchecked.reason == checked.reason
    series = [SimpleNamespace(entry="node_of_a", k=k, findings=()) for k in (6, 2)]
    plan = SimpleNamespace(shifts=list, clamps=list, rescales=lambda: series)
    seen: list[int] = []
    real_check = graph_ops.check_model

    def counted(m: onnx.ModelProto) -> None:
        seen.append(len(m.graph.node))
        real_check(m)

    # Every checker call of the rewrites (graph_ops.finish) and of apply_plan, counted.
    monkeypatch.setattr(graph_ops, "check_model", counted)
    monkeypatch.setattr(apply_module, "check_model", counted)
    applied = apply_module.apply_plan(model, plan)
    assert seen == [len(applied.model.graph.node)]  # once, on the final model
    one_by_one = apply_rescale(apply_rescale(model, "node_of_a", 6).model, "node_of_a", 2).model
    assert (applied.model.SerializeToString(deterministic=True)
            == one_by_one.SerializeToString(deterministic=True))
    assert applied.applied == ("rescale node_of_a by 2^-6", "rescale node_of_a by 2^-2")
    assert applied.tensor_scales == {"a": 2**-8, "r": 2**-8, "p": 2**-8}
    feeds = {"x": RNG.normal(size=(1, 3, 6, 6)).astype(np.float32)}
    assert _same_function(model, applied.model, feeds) <= 1e-5
