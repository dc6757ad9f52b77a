"""The pre-plan pass list: what each pass did, in order, and what it declined; checked with onnxruntime."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import parser

from npuprep.model_io import Model, fingerprint
from npuprep.profiles import ControlFlow, load_profile
from npuprep.rewrite.passes import PRE_PLAN_PASSES, prepare_for_target, run_passes
from npuprep.runtime.session import make_session, run

# x[1,4] -> Mul(x, x) -> sq -> ReduceSum -> s -> Mul(1/4) -> m -> Sqrt -> y
MEAN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 4] x) => (float[1, 1] y) <int64[1] ax = {1}, float quarter = {0.25}> {
    [square] sq = Mul (x, x)
    [total] s = ReduceSum <keepdims = 1> (sq, ax)
    [mean] m = Mul (s, quarter)
    [root] y = Sqrt (m)
}
"""

# x[1,4] -> Relu -> y: nothing for any pass to do
PLAIN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 4] x) => (float[1, 4] y) {
    [relu] y = Relu (x)
}
"""

# c (a graph input) -> If(then: y = x + 1, else: y = x - 1) -> y
BRANCHY = """
<ir_version: 8, opset_import: ["" : 17]>
g (bool c, float[1, 4] x) => (float[1, 4] y) <float one = {1.0}> {
    [choose] y = If (c) <then_branch = t () => (float[1, 4] a) { [plus] a = Add (x, one) },
                         else_branch = e () => (float[1, 4] b) { [minus] b = Sub (x, one) }>
}
"""


def _model(text: str) -> Model:
    proto = parser.parse_model(text)
    onnx.checker.check_model(proto, full_check=True)
    return Model(proto=proto, path="m.onnx", digest=fingerprint(proto))


def test_the_passes_are_declared_once_in_order():
    assert [p.name for p in PRE_PLAN_PASSES] == ["sum_to_mean", "fold_affine", "hardswish", "control_flow"]


def test_a_written_out_mean_is_folded_and_said_and_the_function_kept():
    model = _model(MEAN)
    generic = load_profile("generic").resolve()
    proto, done, notes = run_passes(model.proto, generic)
    assert [d.name for d in done] == ["sum_to_mean", "fold_affine", "hardswish"]
    assert set(done[0].replaced) == {"mean"} and not done[1].replaced and not done[2].replaced
    assert any(n.startswith("'mean' folded before planning") for n in notes), notes
    assert {n.op_type for n in proto.graph.node} == {"Mul", "ReduceMean", "Sqrt"}
    feed = {"x": np.array([[1, -2, 3, 4]], np.float32)}
    np.testing.assert_allclose(run(make_session(proto), feed)["y"],
                               run(make_session(model.proto), feed)["y"], rtol=1e-6)
    prepared = prepare_for_target(model, generic)
    assert prepared.model.fingerprint == model.fingerprint and prepared.model.path == "m.onnx"


def test_nothing_to_do_leaves_the_model_itself_and_says_nothing():
    model = _model(PLAIN)
    prepared = prepare_for_target(model, load_profile("generic").resolve())
    assert prepared.model is model and prepared.notes == ()
    assert all(not d.replaced for d in prepared.passes)


def test_control_flow_is_removed_only_for_a_target_that_takes_none():
    model = _model(BRANCHY)
    generic = load_profile("generic")
    kept = prepare_for_target(model, generic.resolve())
    assert "control_flow" not in [d.name for d in kept.passes]
    assert [n.op_type for n in kept.model.proto.graph.node] == ["If"]
    none = dataclasses.replace(generic, name="no-if", control_flow=ControlFlow.NONE)
    gone = prepare_for_target(model, none.resolve())
    assert [d.name for d in gone.passes][-1] == "control_flow"
    assert "If" not in {n.op_type for n in gone.model.proto.graph.node}
    assert any("If node 'choose' replaced before planning, no-if takes no control flow" in n
               for n in gone.notes), gone.notes
    for c in (True, False):
        feed = {"c": np.array(c), "x": np.array([[1, 2, 3, 4]], np.float32)}
        np.testing.assert_allclose(run(make_session(gone.model.proto), feed)["y"],
                                   run(make_session(model.proto), feed)["y"])
