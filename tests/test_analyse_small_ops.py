"""Small-op hazards fire on the bare op, stay quiet on the guarded variant, and their limits are real."""

import numpy as np
import pytest
from analyse_util import build, findings, fp16_outputs, rules

from npuprep.analyse import STATIC_RULES
from npuprep.numerics import get_format

HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'
F16 = get_format("fp16")

# (rule, hazardous graph, safe variant); each graph is x -> ... -> y.
CASES = [
    ("hazard.square",  # Pow(x, 2) vs Pow(Clip(x, -100, 100), 2)
     "g (float[4] x) => (float[4] y) { two = Constant <value = float {2.0}> () y = Pow (x, two) }",
     """g (float[4] x) => (float[4] y) { lo = Constant <value = float {-100.0}> ()
        hi = Constant <value = float {100.0}> () two = Constant <value = float {2.0}> ()
        c = Clip (x, lo, hi) y = Pow (c, two) }"""),
    ("hazard.square",  # Mul(x, x) vs Mul(x, z)
     "g (float[4] x) => (float[4] y) { y = Mul (x, x) }",
     "g (float[4] x, float[4] z) => (float[4] y) { y = Mul (x, z) }"),
    ("hazard.reduce_square",  # ReduceSumSquare over 64 vs ReduceMax
     """g (float[2, 64] x) => (float[2, 1] y) { ax = Constant <value = int64[1] {1}> ()
        y = ReduceSumSquare <axes = [1]> (x) }""",
     """g (float[2, 64] x) => (float[2, 1] y) { ax = Constant <value = int64[1] {1}> ()
        y = ReduceMax <axes = [1]> (x) }"""),
    ("hazard.reduce_square",  # ReduceL2 vs ReduceL2 of inputs clipped to +-16
     """g (float[2, 64] x) => (float[2, 1] y) { ax = Constant <value = int64[1] {1}> ()
        y = ReduceL2 <axes = [1]> (x) }""",
     """g (float[2, 64] x) => (float[2, 1] y) { ax = Constant <value = int64[1] {1}> ()
        lo = Constant <value = float {-16.0}> () hi = Constant <value = float {16.0}> ()
        c = Clip (x, lo, hi) y = ReduceL2 <axes = [1]> (c) }"""),
    ("hazard.reduce_sum",  # ReduceSum over 1024 vs over 16
     """g (float[1024] x) => (float[1] y) { ax = Constant <value = int64[1] {0}> ()
        y = ReduceSum (x, ax) }""",
     """g (float[16] x) => (float[1] y) { ax = Constant <value = int64[1] {0}> ()
        y = ReduceSum (x, ax) }"""),
    ("hazard.exp",  # Exp(x) vs Exp(Clip(x, max=10))
     "g (float[4] x) => (float[4] y) { y = Exp (x) }",
     """g (float[4] x) => (float[4] y) { lo = Constant <value = float {-100.0}> ()
        hi = Constant <value = float {10.0}> () c = Clip (x, lo, hi) y = Exp (c) }"""),
    ("hazard.exp",  # Exp(x) vs Exp(x - ReduceMax(x))
     "g (float[2, 8] x) => (float[2, 8] y) { y = Exp (x) }",
     """g (float[2, 8] x) => (float[2, 8] y) { m = ReduceMax <axes = [1]> (x)
        s = Sub (x, m) y = Exp (s) }"""),
    ("hazard.div",  # Div(a, b) vs Div(a, Add(b, 1e-3))
     "g (float[4] a, float[4] b) => (float[4] y) { y = Div (a, b) }",
     """g (float[4] a, float[4] b) => (float[4] y) { e = Constant <value = float {0.001}> ()
        d = Add (b, e) y = Div (a, d) }"""),
    ("hazard.div",  # Div(a, b) vs Div(a, Max(b, 1e-3))
     "g (float[4] a, float[4] b) => (float[4] y) { y = Div (a, b) }",
     """g (float[4] a, float[4] b) => (float[4] y) { e = Constant <value = float {0.001}> ()
        d = Max (b, e) y = Div (a, d) }"""),
    ("hazard.reciprocal",  # Reciprocal(x) vs Reciprocal(Abs(x) + 1e-3)
     "g (float[4] x) => (float[4] y) { y = Reciprocal (x) }",
     """g (float[4] x) => (float[4] y) { e = Constant <value = float {0.001}> ()
        a = Abs (x) d = Add (a, e) y = Reciprocal (d) }"""),
    ("hazard.log",  # Log(x) vs Log(Clip(x, min=1e-3))
     "g (float[4] x) => (float[4] y) { y = Log (x) }",
     """g (float[4] x) => (float[4] y) { lo = Constant <value = float {0.001}> ()
        c = Clip (x, lo) y = Log (c) }"""),
    ("hazard.sqrt",  # Sqrt(ReduceSumSquare(x) + eps) vs Sqrt(Relu(x))
     """g (float[2, 8] x) => (float[2, 1] y) { ax = Constant <value = int64[1] {1}> ()
        e = Constant <value = float {0.001}> () s = ReduceSumSquare <axes = [1]> (x)
        d = Add (s, e) y = Sqrt (d) }""",
     "g (float[2, 1] x) => (float[2, 1] y) { r = Relu (x) y = Sqrt (r) }"),
]


@pytest.mark.parametrize(("rule", "hazard", "safe"), CASES, ids=[c[0] + f"-{i}" for i, c in enumerate(CASES)])
def test_rule_fires_on_the_hazard_and_not_on_the_safe_variant(rule, hazard, safe):
    assert rule in STATIC_RULES
    assert rule in rules(HEAD + hazard)
    assert rule not in rules(HEAD + safe)


def test_every_finding_carries_evidence_and_a_remedy():
    for rule, hazard, _ in CASES:
        found = [f for f in findings(HEAD + hazard) if f.rule == rule]
        assert found
        for f in found:
            assert f.node and f.op_type and f.evidence["format"] == "fp16", f
            assert f.remedy in ("clamp", "pin_fp32", "rescale") and f.remedy_text, f


def _at(text, rule):
    return next(f for f in findings(HEAD + text) if f.rule == rule)


def test_exp_limit_is_where_emulated_fp16_overflows():
    # x -> Exp -> y
    f = _at(CASES[5][1], "hazard.exp")
    limit = f.evidence["input_limit"]
    assert limit == F16.exp_limit
    model = build(HEAD + CASES[5][1])
    # x itself is rounded to FP16 first: step far enough to cross the limit after rounding.
    y = fp16_outputs(model, {"x": np.array([limit - 0.02, limit + 0.02, 0, 1], np.float32)})["y"]
    assert np.isfinite(y[0]) and np.isinf(y[1])
    assert f.evidence["clamp_at"] == pytest.approx(np.log(0.5 * F16.max))


def test_square_limit_is_where_emulated_fp16_overflows():
    # x -> Pow(x, 2) -> y
    f = _at(CASES[0][1], "hazard.square")
    limit = f.evidence["input_limit"]
    assert limit == F16.square_limit
    y = fp16_outputs(build(HEAD + CASES[0][1]),
                     {"x": np.array([limit - 0.2, limit + 0.2, -limit - 0.2, 1], np.float32)})["y"]
    assert np.isfinite(y[0]) and np.isinf(y[1]) and np.isinf(y[2])


def test_sum_of_squares_limit_uses_the_reduction_size_from_shapes():
    # x[2, 64] -> ReduceSumSquare(axis 1) -> y
    f = _at(CASES[2][1], "hazard.reduce_square")
    assert f.evidence["reduction_size"] == 64
    limit = f.evidence["element_limit"]
    assert limit == pytest.approx(np.sqrt(F16.max / 64))
    x = np.stack([np.full(64, limit * 0.98), np.full(64, limit * 1.02)]).astype(np.float32)
    y = fp16_outputs(build(HEAD + CASES[2][1]), {"x": x})["y"]
    assert np.isfinite(y[0, 0]) and np.isinf(y[1, 0])


def test_large_sum_limit_and_unknown_size():
    f = _at(CASES[4][1], "hazard.reduce_sum")
    assert f.evidence["reduction_size"] == 1024
    assert f.evidence["element_limit"] == pytest.approx(F16.max / 1024)
    # x[N] (symbolic) -> ReduceSum -> y: size unknown, reported as info
    unknown = _at("""g (float[N] x) => (float[1] y) { ax = Constant <value = int64[1] {0}> ()
        y = ReduceSum (x, ax) }""", "hazard.reduce_sum")
    assert unknown.evidence["reduction_size"] is None and str(unknown.severity) == "info"


def test_unguarded_division_overflows_and_a_flushed_eps_is_no_guard():
    # a, b -> Div(a, b) -> y: 1 / 1e-5 overflows FP16 (1e-5 < 1/max)
    f = _at(CASES[7][1], "hazard.div")
    assert f.evidence["overflow_below"] == pytest.approx(1 / F16.max)
    y = fp16_outputs(build(HEAD + CASES[7][1]),
                     {"a": np.ones(4, np.float32), "b": np.array([1e-5, 1, 2, 4], np.float32)})["y"]
    assert np.isinf(y[0])
    # a, b -> Div(a, Add(b, 1e-12)) -> y: eps 1e-12 becomes 0 in FP16
    flushed = _at("""g (float[4] a, float[4] b) => (float[4] y) {
        e = Constant <value = float {1e-12}> () d = Add (b, e) y = Div (a, d) }""", "hazard.div")
    assert flushed.evidence["guard_floor"] == pytest.approx(1e-12)
    assert "flushes to zero" in flushed.message
    # a -> Div(a, const 4) -> y: a constant non-zero denominator needs no guard
    assert "hazard.div" not in rules(HEAD + """g (float[4] a) => (float[4] y) {
        d = Constant <value = float {4.0}> () y = Div (a, d) }""")


def test_square_after_a_weighted_layer_suggests_rescaling():
    # x -> MatMul(x, W) -> Pow(., 2) -> y
    model = build(HEAD + """g (float[1, 4] x) => (float[1, 4] y) {
        h = MatMul (x, W) two = Constant <value = float {2.0}> () y = Pow (h, two) }""",
        W=np.eye(4, dtype=np.float32) * 300)
    [f] = [f for f in findings(model) if f.rule == "hazard.square"]
    assert f.remedy == "rescale"


def test_integer_shape_arithmetic_is_no_hazard():
    # x -> Shape -> Div(shape, shape) -> Reshape target: int64 maths, not a float hazard
    text = HEAD + """g (float[2, 8] x) => (float[2, 8] y) {
        s = Shape (x) d = Div (s, s) m = Mul (s, d) y = Reshape (x, m) }"""
    assert not [f for f in findings(text) if f.rule.startswith("hazard.")]


def test_a_body_reads_constants_of_the_enclosing_graph():
    # Loop body: v -> Pow(v, two) with `two` an initialiser of the main graph
    model = build(HEAD + """g (int64 trips, float[4] x) => (float[4] lv) {
        lv = Loop (trips, , x) <body = b (int64 i, bool cond, float[4] v) => (bool cond_out, float[4] v_out) {
            cond_out = Identity (cond)
            v_out = Pow (v, two)
        }>
    }""", two=np.array(2.0, np.float32))
    [f] = [f for f in findings(model) if f.rule == "hazard.square"]
    assert f.scope == "main/node_of_lv.body" and f.evidence["exponent"] == 2
