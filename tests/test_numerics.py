"""Format limits come from finfo and rounding matches the target's overflow behaviour."""

import numpy as np
import pytest

from npuprep.errors import NpuprepError
from npuprep.numerics import formats, get_format


def test_limits_match_design_table():
    f16 = get_format("fp16")
    assert f16.max == 65504 and f16.overflow_threshold == 65520
    assert f16.min_normal == pytest.approx(6.1035e-5, rel=1e-4)
    assert get_format("fp8_e4m3").max == 448
    assert get_format("fp8_e5m2").max == 57344
    assert get_format("bf16").max == pytest.approx(3.39e38, rel=1e-2)
    assert f16.exp_limit == pytest.approx(11.09, abs=1e-2)
    assert f16.square_limit == pytest.approx(255.9, abs=0.1)
    assert get_format("fp8_e4m3").square_limit == pytest.approx(21.2, abs=0.05)


def test_fp16_rounding_boundary_and_saturation():
    f16 = get_format("fp16")
    x = np.array([65505, 65519, 65520, -1e6], np.float32)
    assert f16.round(x, saturate=False).tolist() == [65504, 65504, np.inf, -np.inf]
    assert f16.round(x, saturate=True).tolist() == [65504, 65504, 65504, -65504]


def test_e4m3_overflow_is_nan_or_448():
    e4 = get_format("fp8_e4m3")
    x = np.array([448, 464, 465, 1000], np.float32)
    out = e4.round(x, saturate=False)
    # 464 is the tie between 448 and 480 and rounds to the even mantissa, 448.
    assert out[:2].tolist() == [448, 448] and np.isnan(out[2:]).all()
    assert e4.round(x, saturate=True).tolist() == [448, 448, 448, 448]


def test_unknown_format_is_user_error():
    with pytest.raises(NpuprepError, match="unknown number format 'fp12'"):
        get_format("fp12")
    assert set(formats()) == {"fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"}
