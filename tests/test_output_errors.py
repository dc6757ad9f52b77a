"""The one pooled rel L2 that ranks candidates (8-bit layers, FP16 attribution): squared errors
summed over the samples before the ratio, the worst float output, Inf/NaN the largest error."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import parser

from npuprep.runtime.session import make_session, run
from npuprep.verify.output_errors import OutputErrors, output_passes, worst_pooled_rel_l2

# x -> y = Mul(x, k), n = Cast<int64>(x), r = Sqrt(x): a float output, an integer one, and
# one that is NaN where x < 0
GRAPH = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[4] x) => (float[4] y, int64[4] n, float[4] r) {
    k = Constant <value = float {{K}}> ()
    y = Mul (x, k)
    n = Cast <to = 7> (x)
    r = Sqrt (x)
}
"""


def _outputs(k: float, samples: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    session = make_session(parser.parse_model(GRAPH.replace("{{K}}", "{" + repr(k) + "}")))
    return [run(session, {"x": x}) for x in samples]


def test_pooled_over_samples_worst_output_and_integer_outputs_skipped():
    # A small sample and a large one, y off by 1% on both and by 51.5% on the small one:
    # pooling weighs the large sample's squares, a mean of per-sample ratios would not.
    small, large = np.array([1, 2, 3, 4], np.float32), np.array([100, 200, 300, 400], np.float32)
    ref, got = _outputs(1.0, [small, large]), _outputs(1.01, [small, large])
    got[0]["y"] = got[0]["y"] * 1.5  # the small sample's error grows to 51.5%
    got[0]["n"] = got[0]["n"] + 1000  # an integer output is not judged by rel L2
    pairs = list(zip(got, ref, strict=True))
    y_err2 = sum(float(np.sum((g["y"].astype(np.float64) - r["y"]) ** 2)) for g, r in pairs)
    y_ref2 = sum(float(np.sum(r["y"].astype(np.float64) ** 2)) for r in ref)
    pooled = math.sqrt(y_err2 / y_ref2)
    assert worst_pooled_rel_l2(got, ref) == pytest.approx(pooled, rel=1e-12)
    mean_of_ratios = np.mean([np.linalg.norm(g["y"] - r["y"]) / np.linalg.norm(r["y"])
                              for g, r in pairs])
    assert pooled < 0.02 < mean_of_ratios


def test_a_nan_output_is_the_largest_error_and_identical_outputs_are_zero():
    x = np.array([1, 4, 9, 16], np.float32)
    ref = _outputs(1.0, [x])
    assert worst_pooled_rel_l2(ref, ref) == 0.0
    nan = _outputs(1.0, [np.array([1, 4, -9, 16], np.float32)])
    nan[0]["y"] = ref[0]["y"]
    assert math.isnan(nan[0]["r"][2]) and worst_pooled_rel_l2(nan, ref) == math.inf


# x -> logits = MatMul(x, W): three classes per row, the candidate's W off by dW
LOGITS = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[N, 2] x, float[2, 3] w) => (float[N, 3] logits) {
    logits = MatMul (x, w)
}
"""


def test_a_decision_held_by_a_hair_fails_the_search_margin_and_a_clear_one_passes():
    session = make_session(parser.parse_model(LOGITS))
    x = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    w = np.array([[1.0, 0.8, 0.0], [0.0, 0.2, 1.0]], np.float32)  # row 0: 1.0 vs 0.8
    ref = run(session, {"x": x, "w": w})["logits"]
    # The candidate closes 60% of row 0's 0.2 lead: its top-1 holds, twice its error flips it.
    near = run(session, {"x": x, "w": w + np.array([[-0.06, 0.06, 0], [0, 0, 0]], np.float32)})
    errors = OutputErrors(top_k={"logits": 1}, tie_rtol=0.05, margin=2.0)
    errors.add("logits", ref, near["logits"])
    row = errors.result()["logits"]
    assert row["top_k_agreement"] == 1.0 and row["top_k_agreement_at_margin"] == 0.5
    assert row["rel_l2"] > 0.04  # not within the rel L2 aim: the decisions decide
    assert output_passes(row, 0.04) and not output_passes(row, 0.04, at_margin=True)
    # A third of that error (20% of the lead) holds at twice the error too.
    clear = run(session, {"x": x, "w": w + np.array([[-0.02, 0.02, 0], [0, 0, 0]], np.float32)})
    errors = OutputErrors(top_k={"logits": 1}, tie_rtol=0.05, margin=2.0)
    errors.add("logits", ref, clear["logits"])
    assert output_passes(errors.result()["logits"], 1e-3, at_margin=True)
    # Without a margin no key is added: every other check's rows stay as they were.
    plain = OutputErrors(top_k={"logits": 1}, tie_rtol=0.05)
    plain.add("logits", ref, near["logits"])
    assert "top_k_agreement_at_margin" not in plain.result()["logits"]


def test_the_pooled_rel_l2_is_output_errors_own_bit_for_bit():
    # Its sums alone (no decisions read), so every ranking and rule trial measures what a check
    # of the same outputs reports: the same number to the last bit, Inf/NaN in either side.
    rng = np.random.default_rng(11)
    ref = [{"a": rng.standard_normal((3, 40)).astype(np.float32),
            "b": rng.random((2, 5, 7)).astype(np.float32)} for _ in range(3)]
    got = [{k: v + rng.standard_normal(v.shape).astype(np.float32) * 0.03 for k, v in r.items()}
           for r in ref]
    ref[1]["a"][0, 3] = np.inf  # no error defined where FP32 itself is Inf
    for inf_in_b in (False, True):
        if inf_in_b:
            got[2]["b"][1, 2, 3] = np.nan
        errors = OutputErrors()
        for g, r in zip(got, ref, strict=True):
            for name in r:
                errors.add(name, r[name], g[name])
        each = errors.result()
        assert worst_pooled_rel_l2(got, ref) == max(
            math.inf if o["nonfinite"] else o["rel_l2"] for o in each.values())
        assert math.isinf(worst_pooled_rel_l2(got, ref)) == inf_in_b
