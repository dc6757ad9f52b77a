"""Outlier channels balanced into the weights before INT8 (npuprep.verify.qdq_model.balance_outliers):
Conv inputs as well as MatMul inputs, kept only where it holds on samples it was not fitted to."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import eight_bit_format
from npuprep.runtime.session import make_session, run
from npuprep.scale_rules import DEFAULT_RULE
from npuprep.verify.qdq_model import balance_outliers, quantise
from npuprep.verify.qdq_trials import Variant, errors_alone

INT8 = eight_bit_format("int8")
RNG = np.random.default_rng(40)

# x (8 channels, one loud) -> Conv 1x1 -> y: no Conv/Relu producer, so equalisation cannot take it.
CONV = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[1, 8, 6, 6] x) => (float[1, 4, 6, 6] y) { [conv] y = Conv (x, W) }
"""
# x (32 channels) -> MatMul -> y
MATMUL = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[32, 32] x) => (float[32, 8] y) { [mm] y = MatMul (x, W) }
"""


def _model(text: str, w: np.ndarray) -> onnx.ModelProto:
    proto = parser.parse_model(text)
    proto.graph.initializer.append(numpy_helper.from_array(w.astype(np.float32), "W"))
    return proto


def _measure(proto: onnx.ModelProto):
    """The balancing's measure: each group of layers alone in INT8, on one session."""
    variant = Variant(INT8, (DEFAULT_RULE,), True)
    return lambda model, stats, groups, on: errors_alone(proto, model, groups, stats, variant, on)


def _rel_l2(ref: np.ndarray, got: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _errors(reference: onnx.ModelProto, candidate: onnx.ModelProto, feeds, out: str) -> float:
    ref, cand = make_session(reference), make_session(candidate)
    return max(_rel_l2(run(ref, f)[out], run(cand, f)[out]) for f in feeds)


def test_a_conv_input_whose_channels_spread_is_balanced_into_the_conv_weight():
    # A SiLU output's channels span 2.5 to 55 (ddddocr_det): one INT8 scale leaves the quiet
    # ones a few levels; dividing x per channel and multiplying W's input channels is exact.
    gains = np.array([25, 8, 1, 1, 1, 1, 1, 1], np.float32)[None, :, None, None]
    proto = _model(CONV, RNG.standard_normal((4, 8, 1, 1)))
    feeds = [{"x": (RNG.uniform(-1, 1, (1, 8, 6, 6)) * gains).astype(np.float32)} for _ in range(6)]
    unseen = [{"x": (RNG.uniform(-1, 1, (1, 8, 6, 6)) * gains).astype(np.float32)} for _ in range(3)]
    model = Model(proto=proto, path="m.onnx", digest=fingerprint(proto))
    stats = calibrate(model, feeds, detail="all")
    found = balance_outliers(proto, ["conv"], stats, feeds, measure=_measure(proto))
    assert set(found.tensors) == {"x"} and found.tensors["x"][1] > 4
    mul = next(n for n in found.model.graph.node if n.op_type == "Mul")
    assert mul.input[0] == "x"
    # The same function in FP32 ...
    assert _errors(proto, found.model, unseen, "y") < 1e-5
    # ... and in INT8 less than half the error of one scale for x, on samples it never saw.
    plain = quantise(proto, ["conv"], stats, INT8, saturate=True).model
    ours = quantise(found.model, ["conv"], found.stats, INT8, saturate=True).model
    assert _errors(proto, ours, unseen, "y") < 0.5 * _errors(proto, plain, unseen, "y")


def _loud_channel(i: int) -> dict[str, np.ndarray]:
    """A sample whose channel i is 40x the others (a different channel in each sample)."""
    x = RNG.uniform(-1, 1, (32, 32)).astype(np.float32)
    x[:, i] *= 40
    return {"x": x}


def test_outlier_channels_that_move_from_sample_to_sample_are_not_balanced():
    # unet_tiny's context: each sample raises other channels. Factors fitted to the channels
    # the calibration samples raised divide the next sample's loud channel by ~1 and its
    # scale clips it (held-out 0.46-0.56 against 0.06 unbalanced).
    proto = _model(MATMUL, RNG.standard_normal((32, 8)))
    feeds = [_loud_channel(i) for i in range(8)]
    unseen = [_loud_channel(i) for i in range(20, 24)]
    model = Model(proto=proto, path="m.onnx", digest=fingerprint(proto))
    stats = calibrate(model, feeds, detail="all")
    found = balance_outliers(proto, ["mm"], stats, feeds, measure=_measure(proto))
    assert found.tensors == {} and found.model is proto
    # Why: balanced with factors fitted on all eight, the unseen samples err far more.
    from npuprep.rewrite.smooth import smooth, smoothing_factors

    w = numpy_helper.to_array(proto.graph.initializer[0])
    top = np.stack([np.abs(f["x"]).max(axis=0) for f in feeds]).max(axis=0)
    fitted = smooth(proto, {"x": smoothing_factors(top, [np.abs(w).max(axis=1)])}, {"x": ["mm"]})
    refit = calibrate(Model(fitted.model, "b.onnx", "b"), feeds, detail="all")
    over = quantise(fitted.model, ["mm"], refit, INT8, saturate=True).model
    plain = quantise(proto, ["mm"], stats, INT8, saturate=True).model
    assert _errors(proto, over, unseen, "y") > 2 * _errors(proto, plain, unseen, "y")
