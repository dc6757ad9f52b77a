"""A detector's decided scores that held set against the error near its threshold: the flips a
redraw of the samples should expect (npuprep.verify.detection_odds), reported as luck where a
redraw would more likely than not flip one."""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
from onnx import parser

from npuprep.detections import parse_detect
from npuprep.report.output_verdicts import agreement_said
from npuprep.verify.detection_odds import NearThreshold
from npuprep.verify.output_errors import OutputErrors

# s -> Identity -> score (logits, judged at 0);  s, e -> Add -> score (the candidate: s + e)
REFERENCE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 64, 1] s, float[1, 64, 1] e) => (float[1, 64, 1] score) {
    score = Identity (s)
}
"""
CANDIDATE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 64, 1] s, float[1, 64, 1] e) => (float[1, 64, 1] score) {
    score = Add (s, e)
}
"""
RTOL = 5e-2  # the tie band at a threshold of 0: 0.05


def _run(text: str, feeds: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    session = ort.InferenceSession(parser.parse_model(text).SerializeToString())
    return [session.run(["score"], f)[0] for f in feeds]


def _feeds(error: float) -> list[dict[str, np.ndarray]]:
    """Four samples: 60 background scores at -4 and four near the threshold (-0.15, -0.08, 0.1,
    0.03: a tie), each met by an error of +-`error` that never carries a decided one across
    (the near ones are met towards their own side)."""
    feeds = []
    for i in range(4):
        s = np.full((1, 64, 1), -4.0, np.float32)
        s[0, :4, 0] = [-0.15, -0.08, 0.1, 0.03]
        e = np.where(np.arange(64) % 2 == i % 2, error, -error).astype(np.float32).reshape(s.shape)
        e[0, :4, 0] = [-error, -error, error, error]
        feeds.append({"s": s, "e": e})
    return feeds


def _row(error: float) -> dict:
    feeds = _feeds(error)
    errors = OutputErrors(top_k=parse_detect(["score:0"]), tie_rtol=RTOL)
    for ref, cand in zip(_run(REFERENCE, feeds), _run(CANDIDATE, feeds), strict=True):
        errors.add("score", ref, cand)
    return errors.result()["score"]


def test_scores_held_by_a_lucky_error_are_said_to_be_held_by_chance():
    row = _row(0.1)
    assert row["detect_agreement"] == 1.0  # every decided score kept its side ...
    # ... but the error near the threshold (the four scores within 0.2: all +-0.1) would carry
    # the 0.08 and 0.1 ones across about as often as not on a redraw.
    assert row["detect_near_rms"] == pytest.approx(0.1, rel=1e-6)
    # Each decided one at its bin's nearer edge (bins a quarter band, 0.0125, wide): 0.15,
    # 0.075 and 0.1, on each of the four samples.
    want = 4 * sum(0.5 * math.erfc(edge / (0.1 * math.sqrt(2))) for edge in (0.15, 0.075, 0.1))
    assert row["detect_expected_flips"] == pytest.approx(want, rel=1e-6)
    assert row["detect_expected_flips"] > math.log(2) and row["detect_held_by_chance"]
    assert "detections held" in agreement_said(row) and "by chance: " in agreement_said(row)


def test_scores_held_with_a_small_error_near_the_threshold_are_not_luck():
    row = _row(0.01)
    assert row["detect_agreement"] == 1.0
    assert row["detect_near_rms"] == pytest.approx(0.01, rel=1e-5)
    assert row["detect_expected_flips"] < 1e-6 and not row["detect_held_by_chance"]
    assert "by chance" not in agreement_said(row)
    # A flipped score is a failure, not luck: 0.03 -> -0.02 is a tie, 0.1 -> -0.1 is not.
    feeds = _feeds(0.01)
    for f in feeds:
        f["e"][0, 2, 0] = -0.2
    errors = OutputErrors(top_k=parse_detect(["score:0"]), tie_rtol=RTOL)
    for ref, cand in zip(_run(REFERENCE, feeds), _run(CANDIDATE, feeds), strict=True):
        errors.add("score", ref, cand)
    row = errors.result()["score"]
    assert row["detect_agreement"] < 1.0 and not row["detect_held_by_chance"]


def test_no_score_near_the_threshold_expects_no_flip():
    near = NearThreshold(band=0.05)
    ref = np.array([-4.0, 3.0, 5.0])
    near.add(ref, ref + 0.5, 0.0)
    assert near.rms() == 0.0 and near.expected_flips() == 0.0
