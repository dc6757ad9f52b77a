"""A CTC recogniser judged by its text (`--top-k OUTPUT:ctc`): a character's peak moving by
one step is the same text; a character changed is not (npuprep.verify.output_errors)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper, parser

from npuprep.cli.common import parse_top_k
from npuprep.errors import NpuprepError
from npuprep.model_io import Model
from npuprep.numerics import get_format
from npuprep.pipeline.stages import checked_top_k
from npuprep.runtime.session import make_session, run
from npuprep.verify.decision_margin import margin_eaten
from npuprep.verify.output_check import check_outputs
from npuprep.verify.output_errors import (
    CTC_TEXT,
    OutputErrors,
    ctc_sequences,
    ctc_text,
    output_passes,
)

STEPS, CLASSES = 6, 5
# Each step's class (0 = blank): the text "1 3 3" (the two 3s apart by a blank).
PATH = [1, 0, 3, 0, 3, 0]

# logits x (1 x steps x classes) -> Add(D) -> Softmax over the classes -> y
CTC_HEAD = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 6, 5] x) => (float[1, 6, 5] y) {
    z = Add (x, D)
    y = Softmax <axis = -1> (z)
}
"""


def _head(moved: dict[tuple[int, int], float]) -> onnx.ModelProto:
    """The head with logit (step, class) raised by `moved[(step, class)]` (a candidate's error)."""
    d = np.zeros((1, STEPS, CLASSES), np.float32)
    for (t, c), v in moved.items():
        d[0, t, c] = v
    proto = parser.parse_model(CTC_HEAD)
    proto.graph.initializer.append(numpy_helper.from_array(d, "D"))
    return proto


def _samples() -> list[dict[str, np.ndarray]]:
    x = np.zeros((1, STEPS, CLASSES), np.float32)
    x[0, np.arange(STEPS), PATH] = 6.0  # every step decided: 0.94 against 0.015
    return [{"x": x}]


def _check(candidate: onnx.ModelProto, k: int):
    # The candidate as it is (emulated=): its error is the one it was built with.
    return check_outputs(_head({}), candidate, get_format("fp16"), _samples(), saturate=True,
                         rtol=5e-2, top_k={"y": k}, emulated=candidate)


def test_a_peak_moved_by_one_step_keeps_the_text_and_a_changed_character_does_not():
    # The first character moves from step 0 to step 1 (its blank to step 0): two decided steps
    # flip, the text is the same.
    moved = _head({(0, 1): -12.0, (0, 0): 12.0, (1, 1): 12.0, (1, 0): -12.0})
    per_step, as_text = _check(moved, 1), _check(moved, CTC_TEXT)
    assert not per_step and per_step.outputs["y"]["top_k_agreement"] == pytest.approx(4 / 6)
    assert as_text and as_text.outputs["y"]["top_k_agreement"] == 1.0
    assert as_text.outputs["y"]["rel_l2"] > 0.5  # what rel L2 would call a failure
    # The step-wise judge says the texts held, for the FAILED line's hint.
    assert per_step.outputs["y"]["ctc_text_agreement"] == 1.0
    # The blank between the two 3s taken by a 3: "1 3" is another text.
    merged = _check(_head({(3, 3): 12.0}), CTC_TEXT)
    assert not merged and merged.outputs["y"]["top_k_agreement"] == 0.0
    assert _check(_head({(3, 3): 12.0}), 1).outputs["y"]["ctc_text_agreement"] == 0.0


def test_a_text_held_only_at_the_margin_does_not_pass_the_search():
    # The first character half moved: its step is blank at 1x and the next not yet its class
    # (0.51 blank / 0.42): the text lost it; at twice the error the move is whole, the same text.
    half = _head({(0, 1): -4.0, (0, 0): 4.0, (1, 1): 2.9, (1, 0): -2.9})
    errors = OutputErrors(top_k={"y": CTC_TEXT}, tie_rtol=5e-2, margin=2.0)
    ref, cand = (run(make_session(m), _samples()[0])["y"] for m in (_head({}), half))
    errors.add("y", ref, cand)
    row = errors.result()["y"]
    alone = OutputErrors(top_k={"y": CTC_TEXT}, tie_rtol=5e-2)
    alone.add("y", ref, ref + 2.0 * (cand - ref))
    assert row["top_k_agreement"] == 0.0 and alone.result()["y"]["top_k_agreement"] == 1.0
    assert row["top_k_agreement_at_margin"] == 0.0
    assert not output_passes(row, 5e-2, at_margin=True)


def test_ctc_decoding_and_the_flag():
    assert ctc_text(np.array(PATH)) == [1, 3, 3]
    assert ctc_text(np.array([2, 2, 0, 0, 2, 4, 4])) == [2, 2, 4]
    assert parse_top_k(["softmax_11.tmp_0:ctc", "a:b:3"]) == {"softmax_11.tmp_0": CTC_TEXT,
                                                               "a:b": 3}
    with pytest.raises(NpuprepError, match="OUTPUT:ctc"):
        parse_top_k(["y:0"])


def test_ctc_on_an_output_without_steps_is_refused_in_one_line():
    # x (5) -> Softmax -> y: one axis of classes, no steps to decode
    proto = parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[5] x) => (float[5] y) { y = Softmax <axis = -1> (x) }
    """)
    model = Model(proto, "flat.onnx", "flat")
    with pytest.raises(NpuprepError, match=r"^--top-k y:ctc: output 'y' has 1 axis\(es\); a CTC"):
        checked_top_k(model, {"y": CTC_TEXT})
    assert checked_top_k(Model(parser.parse_model(CTC_HEAD), "ctc.onnx", "ctc"),
                         {"y": CTC_TEXT}) == {"y": CTC_TEXT}


def test_compare_says_a_ctc_output_is_judged_by_its_text(tmp_path):
    # The reference head, and a candidate whose '1' peak also takes the blank step after it:
    # each step's top-1 agrees at 5 of 6 steps, the text "1 3 3" is the same.
    from conftest import run_cli

    onnx.save(_head({}), tmp_path / "ref.onnx")
    onnx.save(_head({(1, 1): 8.0}), tmp_path / "cand.onnx")
    np.savez(tmp_path / "x.npz", **_samples()[0])
    done = run_cli("compare", tmp_path / "ref.onnx", tmp_path / "cand.onnx",
                   "--data", tmp_path / "x.npz", "--top-k", "y:ctc")
    assert done.returncode == 0, done.stderr
    assert "CTC text agreement 100%" in done.stdout and "top-0" not in done.stdout


# logits x (steps x 1 x classes: torch's CTC layout, steps first) -> Add(D) -> Softmax -> y
STEPS_FIRST = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[6, 1, 5] x) => (float[6, 1, 5] y) {
    z = Add (x, D)
    y = Softmax <axis = -1> (z)
}
"""


def test_steps_first_is_read_as_one_sequence_its_text_judged():
    def head(moved: dict[tuple[int, int], float]) -> onnx.ModelProto:
        d = np.zeros((STEPS, 1, CLASSES), np.float32)
        for (t, c), v in moved.items():
            d[t, 0, c] = v
        proto = parser.parse_model(STEPS_FIRST)
        proto.graph.initializer.append(numpy_helper.from_array(d, "D"))
        return proto

    x = np.zeros((STEPS, 1, CLASSES), np.float32)
    x[np.arange(STEPS), 0, PATH] = 6.0

    def check(candidate: onnx.ModelProto, k: int):
        return check_outputs(head({}), candidate, get_format("fp16"), [{"x": x}], saturate=True,
                             rtol=5e-2, top_k={"y": k}, emulated=candidate)

    # The first character moved by one step: read as 6 sequences of one step each, two texts
    # would change; read steps first, the one text holds.
    moved = head({(0, 1): -12.0, (0, 0): 12.0, (1, 1): 12.0, (1, 0): -12.0})
    as_text = check(moved, CTC_TEXT)
    assert as_text and as_text.outputs["y"]["top_k_agreement"] == 1.0
    assert check(moved, 1).outputs["y"]["ctc_text_agreement"] == 1.0
    # The blank between the two 3s taken: another text, in this layout too.
    merged = check(head({(3, 3): 12.0}), CTC_TEXT)
    assert not merged and merged.outputs["y"]["top_k_agreement"] == 0.0
    # The search's margin reads the same sequence as the batch-first layout does.
    ref = run(make_session(head({})), {"x": x})["y"]
    for candidate in (moved, head({(3, 3): 12.0}), head({(2, 0): 3.0})):
        got = run(make_session(candidate), {"x": x})["y"]
        assert margin_eaten(ref, got, CTC_TEXT, 5e-2) == margin_eaten(
            ref.transpose(1, 0, 2), got.transpose(1, 0, 2), CTC_TEXT, 5e-2)
    assert ctc_sequences(ref).shape == (1, STEPS, CLASSES)
    assert ctc_sequences(np.zeros((1, STEPS, CLASSES))).shape == (1, STEPS, CLASSES)
