"""A held-out check passed by decisions alone says how large a share of changed samples its
few samples leave open (npuprep.verify.held_out_bound)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import parser

from npuprep.convert import convert
from npuprep.crosscheck.checklist import build_checklist, scan_workspace
from npuprep.data import load_samples
from npuprep.held_out_bound import (
    held_out_bound_note,
    samples_to_rule_out,
    unseen_share,
)
from npuprep.model_io import Model, fingerprint
from npuprep.pipeline.stages import CALIBRATE, SPLIT
from npuprep.profiles import load_profile

# x -> MatMul(W) -> logits (one clear winner per row) -> Softmax -> p
CLASSIFIER = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[32, 16] x) => (float[32, 10] p) {
    [mm] logits = MatMul (x, W)
    [softmax] p = Softmax <axis = -1> (logits)
}
"""


def test_the_share_left_open_by_n_samples_none_changed():
    # 1 - 0.05^(1/n): 4 samples leave 53% open; the rule of three (3 / n) for large n.
    assert abs(unseen_share(4) - 0.5271) < 1e-4
    assert abs(unseen_share(300) - 3 / 300) < 2e-4
    assert unseen_share(0) == 1.0
    # 59 samples, none changed, rule out 5%; 58 do not.
    assert samples_to_rule_out(0.05) == 59
    assert unseen_share(59) <= 0.05 < unseen_share(58)


def _note(samples: int, rel_l2: float, agreement: float, rtol: float = 0.05) -> str | None:
    row = {"nonfinite": 0, "max_abs_error": 0.3, "rel_l2": rel_l2, "top_k": 1,
           "top_k_agreement": agreement, "top_k_positions": samples}
    return held_out_bound_note(samples, rtol, {"p": row, "v": {
        "nonfinite": 0, "max_abs_error": 1e-3, "rel_l2": 1e-3}})


def test_said_only_where_the_decisions_alone_pass_on_too_few_samples():
    said = _note(4, rel_l2=0.063, agreement=1.0)
    assert said is not None and "'p' (rel L2 0.063)" in said and "'v'" not in said
    assert "on all 4 held-out samples" in said and "above 52.7%" in said and "59 held-out" in said
    # Within the tolerance by rel L2: the verdict does not rest on the decisions.
    assert _note(4, rel_l2=0.04, agreement=1.0) is None
    # A decision changed: the check fails, and says so itself.
    assert _note(4, rel_l2=0.063, agreement=0.75) is None
    # Enough samples to rule out 5%.
    assert _note(59, rel_l2=0.063, agreement=1.0) is None
    assert _note(0, rel_l2=0.063, agreement=1.0) is None
    # A detector: its score output rests on its detections, its box output on its rel L2 at them.
    scores = {"nonfinite": 0, "max_abs_error": 2.0, "rel_l2": 0.3, "detect": {},
              "detect_agreement": 1.0}
    boxes = {"nonfinite": 0, "max_abs_error": 9.0, "rel_l2": 0.2, "detect": {},
             "rel_l2_at_detections": 0.01}
    said = held_out_bound_note(4, 0.05, {"scores": scores, "boxes": boxes})
    assert said is not None and "'scores'" in said and "'boxes'" not in said


def test_convert_says_it_of_a_classifier_passed_by_its_decisions(tmp_path):
    rng = np.random.default_rng(3)
    proto = parser.parse_model(CLASSIFIER)
    proto.graph.initializer.append(onnx.numpy_helper.from_array(
        rng.standard_normal((16, 10)).astype(np.float32) * 1.5, "W"))
    model = Model(proto, "cls.onnx", fingerprint(proto))
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        np.savez(data / f"{i:03d}.npz", x=rng.standard_normal((32, 16)).astype(np.float32))
    samples = load_samples(data, proto)
    # rtol 1e-6: FP16's rounding of the probabilities is over it, every winner holds.
    result = convert(model, load_profile("generic"), samples, holdout=SPLIT, stats=CALIBRATE,
                     rtol=1e-6, top_k={"p": 1})
    assert result.passed and result.holdout is not None and result.holdout.samples == 2
    assert result.holdout.outputs["p"]["rel_l2"] > 1e-6
    said = [n for n in result.notes if n.startswith("held-out decisions")]
    assert len(said) == 1 and "on all 2 held-out samples" in said[0] and "above 77.6%" in said[0]
    # Judged by rel L2 at the default tolerance, nothing rests on the decisions.
    plain = convert(model, load_profile("generic"), samples, holdout=SPLIT, stats=CALIBRATE)
    assert plain.passed and not [n for n in plain.notes if n.startswith("held-out decisions")]


def _workspace(tmp_path, model: Model, held_out: int) -> Path:
    """A workspace holding one convert report whose held-out check passed 'p' by its decisions
    alone (rel L2 0.063 over rtol 0.05, every top-1 held) on `held_out` samples."""
    ws = tmp_path / f"ws{held_out}"
    ws.mkdir()
    row = {"nonfinite": 0, "max_abs_error": 0.3, "rel_l2": 0.063, "top_k": 1,
           "top_k_agreement": 1.0, "top_k_positions": held_out}
    (ws / "convert.json").write_text(json.dumps({
        "schema_version": 1, "kind": "convert", "fingerprint": model.fingerprint,
        "output_fingerprint": "", "holdout": {"passed": True, "rtol": 0.05, "samples": held_out,
                                              "outputs": {"p": row}}}))
    return ws


def test_the_checklist_asks_the_board_for_the_samples_the_held_out_check_lacked(tmp_path):
    proto = parser.parse_model(CLASSIFIER)
    proto.graph.initializer.append(onnx.numpy_helper.from_array(
        np.ones((16, 10), np.float32), "W"))
    model = Model(proto, "cls.onnx", fingerprint(proto))

    def compare_steps(held_out: int) -> list[str]:
        checklist = build_checklist(model, load_profile("a2000"), model_arg="cls.onnx",
                                    target_arg="a2000",
                                    workspace=scan_workspace(_workspace(tmp_path, model, held_out)))
        return [s for i in checklist.items if i.key == "compare" for s in i.steps]

    asked = [s for s in compare_steps(4) if "fresh samples on the board" in s]
    assert len(asked) == 1 and "`p`" in asked[0] and "above 52.7% only" in asked[0]
    assert "run 59 fresh samples" in asked[0]
    assert not [s for s in compare_steps(59) if "fresh samples on the board" in s]
    # A hand-edited report (a row without its rel L2, a text rtol) asks nothing and raises nothing.
    (tmp_path / "edited").mkdir()
    ws = _workspace(tmp_path / "edited", model, 4)
    doc = json.loads((ws / "convert.json").read_text())
    del doc["holdout"]["outputs"]["p"]["rel_l2"]
    for edited in (doc, {**doc, "holdout": {**doc["holdout"], "rtol": "0.05"}}):
        (ws / "convert.json").write_text(json.dumps(edited))
        checklist = build_checklist(model, load_profile("a2000"), model_arg="cls.onnx",
                                    target_arg="a2000", workspace=scan_workspace(ws))
        assert not [s for i in checklist.items for s in i.steps if "fresh samples" in s]


def test_the_checklist_says_where_the_written_models_second_draw_changed_decisions(tmp_path):
    proto = parser.parse_model(CLASSIFIER)
    proto.graph.initializer.append(onnx.numpy_helper.from_array(
        np.ones((16, 10), np.float32), "W"))
    model = Model(proto, "cls.onnx", fingerprint(proto))

    def steps(drawn_agreement: float | None) -> list[str]:
        (tmp_path / str(drawn_agreement)).mkdir()
        ws = _workspace(tmp_path / str(drawn_agreement), model, 59)
        doc = json.loads((ws / "convert.json").read_text())
        row = {"nonfinite": 0, "max_abs_error": 0.3, "rel_l2": 0.05, "top_k": 0, "ctc_text": True,
               "top_k_agreement": 1.0, "top_k_positions": 8}
        doc["verification"] = {"passed": True, "rtol": 0.05, "samples": 8, "outputs": {"p": row}}
        if drawn_agreement is not None:
            doc["eight_bit"] = {"as_written": {"passed": drawn_agreement == 1.0, "holdout": None,
                                               "calibration": {"rtol": 0.05, "samples": 8,
                                                               "outputs": {"p": {
                                                                   **row, "rel_l2": 0.095,
                                                                   "top_k_agreement":
                                                                       drawn_agreement}}}}}
        (ws / "convert.json").write_text(json.dumps(doc))
        checklist = build_checklist(model, load_profile("a2000"), model_arg="cls.onnx",
                                    target_arg="a2000", workspace=scan_workspace(ws))
        return [s for i in checklist.items if i.key == "compare" for s in i.steps
                if "another draw" in s]

    [asked] = steps(0.875)
    assert "`p` 1 of 8 on the calibration samples" in asked and "none of 59" in asked
    # The draws agree, or the report predates the second draw: nothing asked.
    assert steps(1.0) == [] and steps(None) == []
