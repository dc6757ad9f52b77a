"""An FP8 conversion whose all-FP8 start meets the aim skips the INT8 rule choice where the
INT8 start errs far more: the choice could not make that start the one kept."""

from __future__ import annotations

from test_eight_bit_mixed import TWO, _errors, _setup

from npuprep.calibrate import calibrate
from npuprep.pipeline import convert
from npuprep.pipeline.quantise_and_verify import JUDGE_MARGIN
from npuprep.profiles import load_profile

RULE_CHOICE = "choosing each INT8 activation's scale rule by its measured error"


def _fp8(sigma: float, rtol: float) -> tuple[object, list[str], tuple[float, float]]:
    """TWO (x spanning e^(+-sigma)) converted to FP8: the result, its stages, and the wide
    layer's error alone at INT8's best rule and in FP8."""
    proto, model, feeds = _setup(sigma, TWO)
    stats = calibrate(model, feeds, detail="all")
    stages: list[str] = []
    result = convert(model, load_profile("a2000"), feeds, precision="fp8_e4m3", stats=stats,
                     rtol=rtol, progress=stages.append)
    return result, stages, _errors(proto, stats, feeds)


def test_an_int8_start_erring_past_twice_the_passing_fp8_start_gets_no_rule_choice():
    # x spans e^(+-1.3): every layer in FP8 passes (0.033 under 0.048); the INT8 start at its
    # default rule errs 0.092. Even at INT8's best rule the wide layer alone misses the aim,
    # so the choice could not have made the INT8 start pass: the FP8 start is kept as before.
    result, stages, (int8_best, _) = _fp8(1.3, 0.06)
    assert int8_best > JUDGE_MARGIN * 0.06
    assert RULE_CHOICE not in stages
    fp8_start, int8_start = result.eight_bit.curve
    assert fp8_start.passed and fp8_start.to == "fp8_e4m3" and not int8_start.passed
    assert int8_start.rel_l2 > 2 * fp8_start.rel_l2
    assert result and {x.node: x.precision for x in result.plan.eight_bit} == {
        "wide": "fp8_e4m3", "plain": "fp8_e4m3"}


def test_an_int8_start_near_the_fp8_start_still_gets_its_rule_choice():
    # e^(+-1.6): the INT8 conversion's start runs `wide` in FP8 (INT8 flushes it), `plain` in
    # INT8, and errs as little as all FP8: its rules are chosen and it is kept.
    result, stages, _ = _fp8(1.6, 0.06)
    assert RULE_CHOICE in stages
    assert result and {x.node: x.precision for x in result.plan.eight_bit} == {
        "wide": "fp8_e4m3", "plain": "int8"}
