"""Clamp: Exp inputs, squares, denominators and declared bounds; declines when already bounded."""

from __future__ import annotations

import numpy as np
import pytest
from rewrite_util import build, outputs

from npuprep.errors import NpuprepError
from npuprep.numerics import get_format
from npuprep.rewrite.clamp import (
    apply_clamp,
    clamp_exp_input,
    clamp_square_input,
    exp_input_bound,
    guard_denominator,
    square_input_bound,
)
from npuprep.verify.emulate import emulate

HEAD = '<ir_version: 8, opset_import: ["" : 17]>'
FP16 = get_format("fp16")


def hazards():
    # x -> Exp -> e ; x -> Mul(x, x) -> sq ; Div(x, d) -> q ; Sigmoid(x) -> s ; Relu(x) -> r
    return build(HEAD + """
    g (float[6] x, float[6] d) => (float[6] e, float[6] sq, float[6] q, float[6] s, float[6] r) {
      e = Exp(x)
      sq = Mul(x, x)
      q = Div(x, d)
      s = Sigmoid(x)
      r = Relu(x)
    }""")


FEEDS = {"x": np.array([1.0, 20.0, -3.0, 300.0, -400.0, 0.5], np.float32),
         "d": np.array([0.0, 1e-9, -1e-9, 2.0, -4.0, -0.0], np.float32)}


def test_bounds_come_from_the_format():
    assert exp_input_bound(FP16, 0.5) == pytest.approx(np.log(32752.0))
    assert square_input_bound(FP16, 1.0) == pytest.approx(255.94, abs=0.01)


def test_exp_input_clamp_keeps_exp_finite_in_fp16():
    model = hazards()
    result = clamp_exp_input(model, "node_of_e", exp_input_bound(FP16, 0.5))
    assert result.modified and result.details["consumers"] == ["node_of_e"]
    ref = outputs(model, FEEDS)
    out = outputs(result.model, FEEDS)
    emulated = outputs(emulate(result.model, FP16, saturate=False).model, FEEDS)["e"]
    naive = outputs(emulate(model, FP16, saturate=False).model, FEEDS)["e"]
    assert np.isinf(naive).any() and np.isfinite(emulated).all()
    # Only the Exp reads the clipped copy: other readers of x see it unchanged.
    np.testing.assert_array_equal(out["sq"], ref["sq"])
    np.testing.assert_allclose(out["e"][[0, 2, 5]], ref["e"][[0, 2, 5]], rtol=1e-6)
    assert out["e"].max() <= 0.5 * FP16.max


def test_square_input_clamp():
    model = hazards()
    result = clamp_square_input(model, "node_of_sq", square_input_bound(FP16, 1.0))
    out = outputs(result.model, FEEDS)["sq"]
    assert result.modified and out.max() <= FP16.max
    emulated = outputs(emulate(result.model, FP16, saturate=False).model, FEEDS)["sq"]
    assert np.isfinite(emulated).all()


def test_denominator_guard_keeps_sign():
    model = hazards()
    result = guard_denominator(model, "node_of_q", 1e-3)
    assert result.modified and len(result.details["guard_nodes"]) == 5
    q = outputs(result.model, FEEDS)["q"]
    np.testing.assert_allclose(q, [1000.0, 20000.0, 3000.0, 150.0, 100.0, 500.0], rtol=1e-5)
    emulated = outputs(emulate(result.model, FP16, saturate=False).model, FEEDS)["q"]
    assert np.isfinite(emulated).all()


def test_declared_bound_keeps_the_tensor_name():
    model = hazards()
    result = apply_clamp(model, "e", None, 100.0)
    assert result.modified and result.details["clamped_tensor"] == "e"
    out = outputs(result.model, FEEDS)
    assert out["e"].max() == 100.0
    assert any(n.output[0] == "e__unclamped" for n in result.model.graph.node)


@pytest.mark.parametrize("tensor, lo, hi, says", [
    ("s", 0.0, 1.0, "Sigmoid 'node_of_s' (range [0, 1]) already bounds 's'"),
    ("r", 0.0, None, "Relu 'node_of_r'"),
])
def test_already_bounded_declines(tensor, lo, hi, says):
    model = hazards()
    result = apply_clamp(model, tensor, lo, hi)
    assert not result.modified and result.model is model and says in result.reason


def test_relu6_and_sqrt_eps_decline():
    # x -> Clip(0, 6) -> c -> Exp ; v -> Add(eps) -> Sqrt -> Div(x, sd) -> q
    model = build(HEAD + """
    g (float[4] x, float[4] v) => (float[4] e, float[4] q) <float lo, float hi, float eps> {
      c = Clip(x, lo, hi)
      e = Exp(c)
      v2 = Mul(v, v)
      ve = Add(v2, eps)
      sd = Sqrt(ve)
      q = Div(x, sd)
    }""", lo=np.array(0, np.float32), hi=np.array(6, np.float32), eps=np.array(1e-4, np.float32))
    relu6 = clamp_exp_input(model, "node_of_e", exp_input_bound(FP16, 0.5))
    assert not relu6.modified and "Clip 'node_of_c' (range [0, 6])" in relu6.reason
    guard = guard_denominator(model, "node_of_q", 1e-3)
    assert not guard.modified and "already at least 0.01" in guard.reason
    assert guard_denominator(model, "node_of_q", 0.1).modified


def test_constant_denominator_declines():
    # x -> Div(x, 4) -> y
    model = build(HEAD + """
    g (float[4] x) => (float[4] y) <float c> { y = Div(x, c) }""", c=np.array(4, np.float32))
    result = guard_denominator(model, "node_of_y", 1e-3)
    assert not result.modified and "is a constant" in result.reason


def test_clamp_inside_if_body():
    # If(c) { then: Exp(x) } else { Neg(x) } -> y
    model = build(HEAD + """
    g (float[3] x, bool c) => (float[3] y) {
      y = If(c) <then_branch = t () => (float[3] o1) { o1 = Exp(x) },
                 else_branch = e () => (float[3] o2) { o2 = Neg(x) }>
    }""")
    result = clamp_exp_input(model, "node_of_o1", 10.0)
    assert result.modified
    out = outputs(result.model, {"x": np.array([1, 50, 2], np.float32), "c": np.array(True)})["y"]
    assert out.max() == pytest.approx(np.exp(np.float32(10.0)), rel=1e-6)


def test_user_mistakes_raise():
    model = hazards()
    with pytest.raises(NpuprepError, match="nope"):
        apply_clamp(model, "nope", 0.0, 1.0)
    with pytest.raises(NpuprepError, match="above"):
        apply_clamp(model, "e", 2.0, 1.0)
    with pytest.raises(NpuprepError, match="not a Div"):
        guard_denominator(model, "node_of_e", 1e-3)
    with pytest.raises(NpuprepError, match="does not read it"):
        apply_clamp(model, "x", 0.0, 1.0, consumers=["node_of_q", "node_of_zzz"])


def test_fp16_graph_gets_fp16_bounds():
    # x (fp16) -> Exp -> e ; Div(e, d) -> y
    model = build(HEAD + """
    g (float16[3] x, float16[3] d) => (float16[3] y) {
      e = Exp(x)
      y = Div(e, d)
    }""")
    clamped = clamp_exp_input(model, "node_of_e", 10.0)
    guarded = guard_denominator(clamped.model, "node_of_y", 1e-3)
    out = outputs(guarded.model, {"x": np.array([1, 20, 3], np.float16),
                                  "d": np.array([0, 1, 2], np.float16)})["y"]
    assert out.dtype == np.float16 and np.isfinite(out).all()
