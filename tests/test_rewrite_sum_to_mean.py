"""`Mul(ReduceSum(x), 1/N)` -> `ReduceMean(x)`: both outcomes, checked with onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import parser

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.model_io import Model, fingerprint
from npuprep.profiles import load_profile
from npuprep.rewrite.sum_to_mean import sums_to_means
from npuprep.runtime.session import make_session, run


def _model(text: str) -> onnx.ModelProto:
    proto = parser.parse_model(text)
    onnx.checker.check_model(proto, full_check=True)
    return proto


# x[4,512] -> Mul(x, x) -> sq -> ReduceSum(axis 1) -> s (~2e5 for |x| ~ 20) -> Mul(1/512) -> ms -> Sqrt -> y
SUM_OF_SQUARES = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4, 512] x) => (float[4, 1] y) <int64[1] ax = {1}, float inv = {0.001953125}> {
    [square] sq = Mul (x, x)
    [total] s = ReduceSum <keepdims = 1> (sq, ax)
    [mean] ms = Mul (s, inv)
    [root] y = Sqrt (ms)
}
"""

# x[2,3,8] -> ReduceSum(axes 1,2, opset 18) -> s -> Div(24) -> m ; s is not read elsewhere
DIV18 = """
<ir_version: 9, opset_import: ["" : 18]>
g (float[2, 3, 8] x) => (float[2] m) <int64[2] ax = {1, 2}, float n = {24.0}> {
    [total] s = ReduceSum <keepdims = 0> (x, ax)
    [mean] m = Div (s, n)
}
"""


def _same(a: onnx.ModelProto, b: onnx.ModelProto, feed: dict[str, np.ndarray]) -> None:
    ra, rb = run(make_session(a), feed), run(make_session(b), feed)
    for name, value in ra.items():
        np.testing.assert_allclose(rb[name], value, rtol=1e-6)


def test_a_sum_times_one_over_its_count_becomes_a_mean():
    proto = _model(SUM_OF_SQUARES)
    result = sums_to_means(proto)
    assert result
    ops = {n.name: n.op_type for n in result.model.graph.node}
    assert ops == {"square": "Mul", "mean": "ReduceMean", "root": "Sqrt"}
    assert "512 elements" in result.details["replaced"]["mean"]
    onnx.checker.check_model(result.model, full_check=True)
    _same(proto, result.model, {"x": np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32) * 300})


def test_a_sum_divided_by_its_count_at_opset_18_keeps_its_axes_input():
    proto = _model(DIV18)
    result = sums_to_means(proto)
    assert result
    mean = next(n for n in result.model.graph.node if n.name == "mean")
    assert mean.op_type == "ReduceMean" and list(mean.input) == ["x", "ax"]
    _same(proto, result.model, {"x": np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)})


def test_declines_a_scale_that_is_not_the_count_or_a_sum_read_twice():
    other = _model(SUM_OF_SQUARES.replace("0.001953125", "0.5"))
    result = sums_to_means(other)
    assert not result and result.model is other
    assert "is not 1/512" in result.details["declined"]["mean"]
    shared = _model(DIV18.replace("=> (float[2] m)", "=> (float[2] m, float[2] s)"))
    result = sums_to_means(shared)
    assert not result and "is read elsewhere too" in result.reason
    assert not sums_to_means(_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 3] x) => (float[2, 3] y) { [double] y = Add (x, x) }
    """))


def test_convert_folds_the_mean_so_an_overflowing_sum_needs_no_pin_on_a_target_that_cannot_pin():
    proto = _model(SUM_OF_SQUARES)
    model = Model(proto, "rms.onnx", fingerprint(proto))
    rng = np.random.default_rng(2)
    samples = [{"x": (rng.standard_normal((4, 512)) * 20).astype(np.float32)} for _ in range(3)]
    stats = calibrate(model, samples)
    assert stats.tensors["s"].absmax > 65504  # the written-out sum leaves FP16
    result = convert(model, load_profile("rk3588"), samples, stats=stats)
    assert result.passed, result.notes
    assert not result.pinned_nodes and not result.plan.actions
    assert any("'mean' folded before planning" in n for n in result.plan.notes)
    worst = max(o["rel_l2"] for o in result.output_check.outputs.values())
    assert worst <= 1e-2
    assert {n.op_type for n in result.lowered.model.graph.node} >= {"ReduceMean"}
