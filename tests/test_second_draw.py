"""An 8-bit conversion also runs its written model as onnxruntime does (its wider layers in
FP32: another draw of the rounding) and says where that draw fails what the verified FP16 run
passes, or errs twice as much (npuprep.verify.second_draw)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.model_io import Model, fingerprint
from npuprep.pipeline import convert
from npuprep.profiles import load_profile
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.second_draw import DRAW_RATIO, SecondDraw, second_draw_notes

# x -> MatMul(W) -> Relu -> MatMul(V) -> y
MLP = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4, 16] x) => (float[4, 8] y) {
    [mm1] h = MatMul (x, W)
    a = Relu (h)
    [mm2] y = MatMul (a, V)
}
"""


def _model() -> tuple[Model, list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(5)
    proto = parser.parse_model(MLP)
    proto.graph.initializer.extend([
        numpy_helper.from_array((rng.standard_normal((16, 32)) * 0.4).astype(np.float32), "W"),
        numpy_helper.from_array((rng.standard_normal((32, 8)) * 0.4).astype(np.float32), "V")])
    feeds = [{"x": rng.standard_normal((4, 16)).astype(np.float32)} for _ in range(12)]
    return Model(proto=proto, path="m.onnx", digest=fingerprint(proto)), feeds[:8], feeds[8:]


def _pooled_rel_l2(model: bytes, reference: bytes, feeds: list[dict[str, np.ndarray]]) -> float:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    got = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    want = ort.InferenceSession(reference, options, providers=["CPUExecutionProvider"])
    num = den = 0.0
    for feed in feeds:
        c = np.asarray(got.run(None, feed)[0], np.float64)
        r = np.asarray(want.run(None, feed)[0], np.float64)
        num, den = num + float(np.sum((c - r) ** 2)), den + float(np.sum(r ** 2))
    return float(np.sqrt(num / den))


def test_the_written_models_second_draw_is_onnxruntimes_run_of_the_file():
    model, calib, held = _model()
    result = convert(model, load_profile("orin"), calib, holdout=held, precision="int8",
                     rtol=0.05, stats=calibrate(model, calib, detail="all"))
    assert result.eight_bit is not None and result.eight_bit.eight_bit_share == 1.0
    drawn = result.eight_bit.as_written
    assert drawn is not None and drawn.holdout is not None
    written = result.lowered.model.SerializeToString()
    reference = model.proto.SerializeToString()
    # The numbers are the file's own, run here as a user would run it.
    assert np.isclose(drawn.calibration.outputs["y"]["rel_l2"],
                      _pooled_rel_l2(written, reference, calib), rtol=1e-6)
    assert np.isclose(drawn.holdout.outputs["y"]["rel_l2"],
                      _pooled_rel_l2(written, reference, held), rtol=1e-6)
    # ... another draw than the verified run, which rounds the MatMuls' outputs to FP16.
    assert drawn.calibration.outputs["y"]["rel_l2"] != result.output_check.outputs["y"]["rel_l2"]
    # Here the draws agree: no note, and the report carries both.
    assert not any("another draw" in n for n in result.notes)
    report = result.to_dict()
    assert report["eight_bit"]["as_written"]["calibration"]["outputs"]["y"]["rel_l2"] == \
        drawn.calibration.outputs["y"]["rel_l2"]
    assert report["eight_bit"]["as_written"]["passed"] is True


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
