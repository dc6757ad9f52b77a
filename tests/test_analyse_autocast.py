"""Autocast notes: ops a GPU keeps in FP32 that the target does not promise to keep there."""

import numpy as np
from analyse_util import build, findings

from npuprep.profiles import Severity, load_profile, parse_profile

HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'
# x -> LayerNormalization -> Softmax -> Relu -> y
MODEL = HEAD + """g (float[2, 16] x) => (float[2, 16] y) {
    n = LayerNormalization <axis = -1> (x, gamma, beta)
    s = Softmax <axis = -1> (n)
    y = Relu (s)
}"""


def _notes(model, target):
    return {f.op_type: f for f in findings(model, target) if f.rule == "autocast.fp32_op"}


def _model():
    return build(MODEL, gamma=np.ones(16, np.float32), beta=np.zeros(16, np.float32))


def test_autocast_fp32_ops_are_noted_and_plain_ops_are_not():
    notes = _notes(_model(), "orin")
    assert set(notes) == {"LayerNormalization", "Softmax"}
    assert notes["LayerNormalization"].evidence["torch_op"] == "layer_norm"
    assert notes["Softmax"].node == "node_of_s" and notes["Softmax"].severity is Severity.INFO


def test_a_compiler_that_decides_alone_makes_it_a_warning():
    notes = _notes(_model(), "a2000")
    assert {f.severity for f in notes.values()} == {Severity.WARNING}


def test_ops_the_profile_keeps_in_fp32_are_not_noted():
    data = load_profile("orin").to_dict()
    data["keeps_fp32_ops"] = ["Softmax", "LayerNormalization"]
    assert _notes(_model(), parse_profile(data, "keeps.yaml")) == {}


def test_an_op_with_a_hazard_finding_gets_no_second_note():
    # x -> Exp -> y: hazard.exp already names it
    found = findings(HEAD + "g (float[4] x) => (float[4] y) { y = Exp (x) }", "orin")
    assert [f.rule for f in found] == ["hazard.exp"]
