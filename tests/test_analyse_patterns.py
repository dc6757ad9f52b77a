"""Pattern rules: decomposed LayerNorm, softmax without max subtraction, guidance with |w| >= 2."""

import numpy as np
import pytest
from analyse_util import build, findings, fp16_outputs, rules

from npuprep.numerics import get_format

HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'


def layernorm(eps: str = "0.00001", square: str = "Pow (d, two)") -> str:
    # x -> ReduceMean -> Sub -> Pow -> ReduceMean -> Add(eps) -> Sqrt -> Div -> y
    return HEAD + f"""g (float[2, 16] x) => (float[2, 16] y) {{
        two = Constant <value = float {{2.0}}> ()
        eps = Constant <value = float {{{eps}}}> ()
        m = ReduceMean <axes = [1]> (x)
        d = Sub (x, m)
        sq = {square}
        v = ReduceMean <axes = [1]> (sq)
        ve = Add (v, eps)
        s = Sqrt (ve)
        y = Div (d, s)
    }}"""


def test_decomposed_layernorm_is_one_finding_that_covers_its_members():
    found = findings(layernorm())
    [ln] = [f for f in found if f.rule == "pattern.layernorm"]
    assert ln.node == "node_of_sq" and ln.op_type == "Pow" and ln.tensor == "y"
    assert ln.evidence["members"] == ["node_of_m", "node_of_d", "node_of_sq", "node_of_v",
                                      "node_of_ve", "node_of_s", "node_of_y"]
    assert ln.evidence["covers"] == {"node_of_sq": ["hazard.square"], "node_of_s": ["hazard.sqrt"]}
    assert ln.evidence["input_limit"] == get_format("fp16").square_limit
    assert ln.evidence["eps_survives"] and ln.remedy == "pin_fp32"
    # The members' own hazards and autocast notes are folded in, not repeated.
    assert [f.rule for f in found if not f.rule.startswith("init.")] == ["pattern.layernorm"]


def test_layernorm_overflow_is_real_and_a_flushed_eps_is_reported():
    x = np.zeros((2, 16), np.float32)
    x[0, ::2], x[0, 1::2] = 300, -300  # |x - mean| = 300 > 255.9
    x[1, ::2], x[1, 1::2] = 200, -200
    y = fp16_outputs(build(layernorm()), {"x": x})["y"]
    # FP32 gives +-1 on both rows; in FP16 the variance of row 0 is Inf and x / Inf flattens it to 0.
    assert np.allclose(np.abs(y[1]), 1, rtol=1e-3)
    assert np.abs(y[0]).max() == 0
    [ln] = [f for f in findings(layernorm(eps="1e-12", square="Mul (d, d)")) if f.rule == "pattern.layernorm"]
    assert ln.op_type == "Mul" and not ln.evidence["eps_survives"]
    assert "flushes to zero" in ln.message


def test_fused_layernorm_is_not_a_decomposed_pattern():
    # x -> LayerNormalization -> y
    model = build(HEAD + """g (float[2, 16] x) => (float[2, 16] y) {
        y = LayerNormalization <axis = -1> (x, gamma, beta) }""",
        gamma=np.ones(16, np.float32), beta=np.zeros(16, np.float32))
    assert "pattern.layernorm" not in rules(model)


SOFTMAX = HEAD + """g (float[2, 8] x) => (float[2, 8] y) {
    e = Exp (x)
    s = ReduceSum <keepdims = 1> (e, ax)
    y = Div (e, s)
}"""
STABLE = HEAD + """g (float[2, 8] x) => (float[2, 8] y) {
    m = ReduceMax <axes = [1]> (x)
    c = Sub (x, m)
    e = Exp (c)
    s = ReduceSum <keepdims = 1> (e, ax)
    y = Div (e, s)
}"""


def test_softmax_without_max_subtraction_fires_and_overflows_in_fp16():
    # x -> Exp -> ReduceSum -> Div(e, s) -> y
    model = build(SOFTMAX, ax=np.array([1], np.int64))
    found = findings(model)
    [sm] = [f for f in found if f.rule == "pattern.softmax"]
    assert sm.evidence["members"] == ["node_of_e", "node_of_s", "node_of_y"]
    assert sm.evidence["covers"] == {"node_of_e": ["hazard.exp"], "node_of_y": ["hazard.div"]}
    assert sm.evidence["reduction_size"] == 8
    assert [f.rule for f in found] == ["pattern.softmax"]
    x = np.array([[12.0] * 8, [8.0] * 8], np.float32)
    y = fp16_outputs(model, {"x": x})["y"]
    assert np.isnan(y[0]).all() and np.allclose(y[1], 1 / 8, rtol=1e-3)


def test_softmax_with_max_subtraction_is_safe():
    # x -> Sub(x, ReduceMax(x)) -> Exp -> ReduceSum -> Div -> y
    model = build(STABLE, ax=np.array([1], np.int64))
    assert [f.rule for f in findings(model) if not f.rule.startswith("autocast.")] == []
    y = fp16_outputs(model, {"x": np.full((2, 8), 40.0, np.float32)})["y"]
    assert np.allclose(y, 1 / 8, rtol=1e-3)


@pytest.mark.parametrize("body", [
    "d = Sub (a, b)  t = Mul (w, d)  y = Add (a, t)",
    "d = Sub (a, b)  t = Mul (d, w)  y = Add (t, a)",
])
def test_guidance_with_a_large_weight_fires_in_either_operand_order(body):
    # a, b -> Sub -> Mul(w = 7.5) -> Add(a, .) -> y
    text = HEAD + f"g (float[4] a, float[4] b) => (float[4] y) {{ {body} }}"
    [g] = [f for f in findings(build(text, w=np.array(7.5, np.float32))) if f.rule == "pattern.guidance"]
    assert g.evidence["w"] == 7.5 and g.evidence["error_gain"] == 16
    assert g.evidence["diff_limit"] == pytest.approx(get_format("fp16").max / 7.5)
    assert g.node == "node_of_t" and g.remedy == "pin_fp32"


def test_guidance_error_gain_is_what_fp16_shows():
    # a + 7.5 (a - b) with a, b close: the FP16 error grows with the weight
    text = HEAD + "g (float[64] a, float[64] b) => (float[64] y) { d = Sub (a, b)  t = Mul (w, d)  y = Add (a, t) }"
    model = build(text, w=np.array(7.5, np.float32))
    rng = np.random.default_rng(0)
    a = rng.uniform(1, 2, 64).astype(np.float32)
    b = (a + rng.normal(0, 1e-3, 64)).astype(np.float32)
    exact = a.astype(np.float64) + 7.5 * (a.astype(np.float64) - b)
    error = np.abs(fp16_outputs(model, {"a": a, "b": b})["y"] - exact).max()
    plain = np.abs(get_format("fp16").round(exact.astype(np.float32), saturate=False) - exact).max()
    assert error > 4 * plain  # far beyond the rounding of the result itself


def test_guidance_with_a_small_weight_is_quiet():
    text = HEAD + "g (float[4] a, float[4] b) => (float[4] y) { d = Sub (a, b)  t = Mul (w, d)  y = Add (a, t) }"
    assert "pattern.guidance" not in rules(build(text, w=np.array(1.5, np.float32)))
    assert "pattern.guidance" in rules(build(text, w=np.array(-3.0, np.float32)))


def test_the_bundled_example_only_emits_documented_rules():
    from npuprep.analyse import STATIC_RULES, static_findings
    from npuprep.examples import example_model_path
    from npuprep.model_io import load_model
    from npuprep.profiles import load_profile

    model = load_model(example_model_path())
    for target in ("generic", "orin", "a2000"):
        assert {f.rule for f in static_findings(model, load_profile(target).resolve())} <= set(STATIC_RULES)
