"""An 8-bit conversion also runs its written model as onnxruntime does (its wider layers in
FP32: another draw of the rounding) and says where that draw fails what the verified FP16 run
passes, or errs twice as much (npuprep.verify.second_draw)."""

from __future__ import annotations

import numpy as np

from npuprep.calibrate import calibrate
from npuprep.pipeline import convert
from npuprep.profiles import load_profile
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.second_draw import DRAW_RATIO, SecondDraw, second_draw_notes
from tests.conftest import int8_mlp, pooled_rel_l2


def test_the_written_models_second_draw_is_onnxruntimes_run_of_the_file():
    # x -> MatMul(W) -> Relu -> MatMul(V) -> y
    model, feeds = int8_mlp(5, samples=12)
    calib, held = feeds[:8], feeds[8:]
    result = convert(model, load_profile("orin"), calib, holdout=held, precision="int8",
                     rtol=0.05, stats=calibrate(model, calib, detail="all"))
    assert result.eight_bit is not None and result.eight_bit.eight_bit_share == 1.0
    drawn = result.eight_bit.as_written
    assert drawn is not None and drawn.holdout is not None
    # The numbers are the file's own, as onnxruntime runs it (one output: pooled is its own).
    written = result.lowered.model
    assert np.isclose(drawn.calibration.outputs["y"]["rel_l2"],
                      pooled_rel_l2(written, model.proto, calib), rtol=1e-5)
    assert np.isclose(drawn.holdout.outputs["y"]["rel_l2"],
                      pooled_rel_l2(written, model.proto, held), rtol=1e-5)
    # ... another draw than the verified run, which rounds the MatMuls' outputs to FP16.
    assert drawn.calibration.outputs["y"]["rel_l2"] != result.output_check.outputs["y"]["rel_l2"]
    # Here the draws agree: no note, and the report carries both.
    assert not any("another draw" in n for n in result.notes)
    report = result.to_dict()
    assert report["eight_bit"]["as_written"]["calibration"]["outputs"]["y"]["rel_l2"] == \
        drawn.calibration.outputs["y"]["rel_l2"]
    assert report["eight_bit"]["as_written"]["passed"] is True


def test_a_check_hands_on_the_reference_outputs_it_ran_for_a_later_check():
    # x -> MatMul(W) -> Relu -> MatMul(V) -> y
    from npuprep.numerics import get_format
    from npuprep.runtime.session import make_session, run
    from npuprep.verify.output_check import check_output_sets

    model, feeds = int8_mlp(6, samples=6)
    ran: list[dict[str, np.ndarray]] = []
    first = check_output_sets(model.proto, model.proto, get_format("fp32"), [feeds[:4], feeds[4:]],
                              saturate=False, rtol=0.05, emulated=model.proto,
                              expected=[run(make_session(model.proto), feeds[0])],
                              reference_outputs=ran)
    assert len(first) == 2 and len(ran) == 6
    session = make_session(model.proto)
    for feed, outputs in zip(feeds, ran, strict=True):
        np.testing.assert_array_equal(outputs["y"], run(session, feed)["y"])


def _check(rel_l2: float, *, texts_changed: int = 0, texts: int = 8) -> OutputCheck:
    row = {"rel_l2": rel_l2, "nonfinite": 0, "max_abs_error": 0.5}
    if texts:
        row |= {"top_k": 0, "ctc_text": True, "top_k_positions": texts,
                "top_k_agreement": 1.0 - texts_changed / texts}
    return OutputCheck(rtol=0.05, samples=texts, outputs={"text": row})


def test_a_draw_that_changes_a_decided_text_the_verified_run_holds_is_said():
    verified = _check(0.049)
    drawn = SecondDraw(_check(0.095, texts_changed=1))
    assert not drawn
    [note] = second_draw_notes(verified, None, drawn)
    assert "errs 0.095 on the calibration samples" in note and "0.049" in note
    assert "'text' changes 1 of 8 decided texts" in note


def test_draws_that_agree_say_nothing_and_one_erring_twice_as_much_is_said():
    assert second_draw_notes(_check(0.03), _check(0.04), SecondDraw(_check(0.031),
                                                                    _check(0.05))) == []
    # Passing both times, but the second draw errs DRAW_RATIO x the first: said, no failure.
    [note] = second_draw_notes(_check(0.01, texts=0), None,
                               SecondDraw(_check(0.01 * DRAW_RATIO, texts=0)))
    assert "errs 0.02 on the calibration samples" in note and "fails" not in note
    # The held-out set is read on its own: a calibration set that agrees says nothing.
    [held] = second_draw_notes(_check(0.03), _check(0.02), SecondDraw(_check(0.03),
                                                                      _check(0.06)))
    assert "held-out samples" in held
