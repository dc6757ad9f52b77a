"""Classification of observed vs FP32 reference values, on hand-made arrays."""

from __future__ import annotations

import numpy as np
import pytest

from npuprep.numerics import get_format
from npuprep.probe.classify import Verdict, classify, overall

FP16 = get_format("fp16")
E4M3 = get_format("fp8_e4m3")
REF = np.array([1e5, -2e5, 3.0, -4.0], np.float32)


@pytest.mark.parametrize(
    ("observed", "verdict"),
    [
        ([np.inf, -np.inf, 3.0, -4.0], Verdict.INF),
        ([np.nan, np.nan, 3.0, -4.0], Verdict.NAN),
        ([65504, -65504, 3.0, -4.0], Verdict.SATURATE),
        ([0.0, 0.0, 3.0, -4.0], Verdict.OTHER_FINITE),
        ([-30000, 60000, 3.0, -4.0], Verdict.OTHER_FINITE),
    ],
)
def test_each_class_from_values(observed, verdict):
    c = classify(REF, np.array(observed, np.float32), FP16)
    assert c.verdict is verdict
    assert c.over == 2
    assert c.in_range_wrong == 0
    assert c.pairs[0][0] == pytest.approx(1e5)


def test_other_finite_names_flush_and_wrap():
    flushed = classify(REF, np.array([0, 0, 3, -4], np.float32), FP16)
    assert (flushed.flushed, flushed.sign_flipped) == (2, 0)
    assert "flushed to 0" in flushed.reason
    wrapped = classify(REF, np.array([-30000, 60000, 3, -4], np.float32), FP16)
    assert (wrapped.flushed, wrapped.sign_flipped) == (0, 2)
    assert "wrapped" in wrapped.reason


def test_saturate_needs_the_right_sign():
    c = classify(REF, np.array([-65504, 65504, 3, -4], np.float32), FP16)
    assert c.verdict is Verdict.OTHER_FINITE


def test_exact_value_beyond_max_means_wider():
    c = classify(REF, REF.copy(), FP16)
    assert c.verdict is Verdict.NO_OVERFLOW
    assert c.wider and c.exact == 2
    assert "computed wider than fp16" in c.reason
    assert not c


def test_65505_to_65519_is_not_overflow():
    # 65510 rounds to 65504 in FP16 under round-to-nearest-even: no overflow to classify.
    c = classify(np.array([65510.0]), np.array([65504.0]), FP16)
    assert c.verdict is Verdict.NO_OVERFLOW and c.over == 0
    assert classify(np.array([65520.0]), np.array([np.inf]), FP16).verdict is Verdict.INF


def test_e4m3_threshold_is_464():
    assert classify(np.array([460.0]), np.array([448.0]), E4M3).verdict is Verdict.NO_OVERFLOW
    assert classify(np.array([464.0]), np.array([448.0]), E4M3).verdict is Verdict.SATURATE


def test_in_range_reference_with_wrong_output_is_internal_overflow():
    ref = np.array([1.0, 0.0, 0.5], np.float32)
    c = classify(ref, np.array([np.nan, np.nan, 0.5], np.float32), FP16)
    assert c.verdict is Verdict.NAN
    assert "internal overflow" in c.reason and c.in_range_wrong == 2
    ok = classify(ref, np.array([1.0, 0.0, 0.5002], np.float32), FP16)
    assert ok.verdict is Verdict.NO_OVERFLOW and "stays below 65520" in ok.reason


def test_majority_decides_a_mixed_tensor():
    ref = np.array([1e5, 1e5, 1e5], np.float32)
    c = classify(ref, np.array([np.inf, 65504, 65504], np.float32), FP16)
    assert c.verdict is Verdict.SATURATE and (c.inf, c.saturated) == (1, 2)


def test_overall_is_mixed_when_units_differ():
    o = overall([("conv", Verdict.SATURATE), ("exp", Verdict.INF), ("softmax", Verdict.NO_OVERFLOW)])
    assert o.verdict == "mixed"
    assert "saturate: conv" in o.reason and "inf: exp" in o.reason
    assert overall([("a", Verdict.INF), ("b", Verdict.NO_OVERFLOW)]).verdict == "inf"
    assert overall([("a", Verdict.NO_OVERFLOW)]).verdict == "no-overflow"


def test_to_dict_keeps_json_safe_pairs():
    d = classify(REF, np.array([np.inf, np.nan, 3, -4], np.float32), FP16).to_dict()
    values = {p["observed"] for p in d["pairs"]}
    assert values <= {"inf", "-inf", "nan"} and d["counts"]["over"] == 2


def test_underflow_of_a_tiny_tensor_is_not_an_overflow_behaviour():
    # A tensor whose whole range (abs-max 1.7e-7) lies below FP16's min normal: subnormal
    # rounding and a flush to 0 are underflow, not `other-finite`.
    ref = np.array([1.7e-7, -1.0e-7, 3.0e-8], np.float32)
    obs = np.array([1.79e-7, 0.0, 5.96e-8], np.float32)
    c = classify(ref, obs, FP16)
    assert c.verdict is Verdict.NO_OVERFLOW and "underflow" in c.reason and c.flushed == 1
    # A tiny reference that comes out large is still wrong.
    assert classify(ref, np.array([1.0, 0.0, 0.0], np.float32), FP16).verdict is Verdict.OTHER_FINITE
