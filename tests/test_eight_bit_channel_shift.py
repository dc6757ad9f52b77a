"""Layer inputs whose channels sit off zero, centred for symmetric INT8: the exact rewrite
(npuprep.rewrite.shift), the 8-bit bias that follows the 8-bit weight, and the measured
choice (npuprep.verify.channel_shift)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from conftest import pooled_rel_l2
from onnx import numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.calibrate.channels import channel_means
from npuprep.model_io import Model
from npuprep.numerics import Int8Activations, eight_bit_format
from npuprep.rewrite.qdq_weights import WeightStore
from npuprep.rewrite.shift import shift, shiftable
from npuprep.runtime.session import make_session, run
from npuprep.scale_rules import ScaleRule
from npuprep.verify.channel_shift import centre_skewed_inputs
from npuprep.verify.qdq_model import quantise
from npuprep.verify.qdq_trials import Variant, errors_alone

SYMMETRIC = eight_bit_format("int8", Int8Activations.SYMMETRIC)
RNG = np.random.default_rng(7)

# x -> Conv c1 (1x1, biased far above zero) -> c -> PRelu -> h -> Conv r (3x3, no padding) -> y
SKEWED = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 4, 10, 10] x) => (float[1, 6, 8, 8] y) {
    c = Conv <kernel_shape = [1, 1]> (x, W1, B1)
    h = PRelu (c, slope)
    [r] y = Conv <kernel_shape = [3, 3]> (h, W2, B2)
}
"""
# x (8 channels) -> MatMul m (no bias) -> y ; x -> MatMul n -> Add(bias) -> z
MATMULS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 5, 8] x) => (float[2, 5, 3] y, float[2, 5, 3] z) {
    [m] y = MatMul (x, Wm)
    [n] t = MatMul (x, Wn)
    z = Add (t, bn)
}
"""
# x -> grouped Conv g (4 -> 4 channels, 2 groups, no padding) -> y ; padded Conv p -> w
GROUPED = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 4, 6, 6] x) => (float[1, 4, 4, 4] y, float[1, 2, 6, 6] w) {
    [g] y = Conv <kernel_shape = [3, 3], group = 2> (x, Wg)
    [p] w = Conv <kernel_shape = [3, 3], pads = [1, 1, 1, 1]> (x, Wp)
}
"""


def _model(text: str, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    m = parser.parse_model(text)
    m.graph.initializer.extend(numpy_helper.from_array(v.astype(np.float32), k)
                               for k, v in weights.items())
    onnx.checker.check_model(m)
    return m


def _skewed(centred_channels: bool = False, rng: np.random.Generator = RNG) -> onnx.ModelProto:
    # Channel k of c is N(B1[k], ~1): far above zero, each about its own centre.
    bias = np.zeros(8) if centred_channels else np.linspace(3.0, 10.0, 8)
    return _model(SKEWED, {"W1": rng.normal(0, 0.5, (8, 4, 1, 1)), "B1": bias,
                           "slope": np.full((8, 1, 1), 0.25),
                           "W2": rng.normal(0, 0.3, (6, 8, 3, 3)), "B2": rng.normal(0, 1, 6)})


def _feeds(shape: tuple[int, ...], n: int,
           rng: np.random.Generator = RNG) -> list[dict[str, Any]]:
    return [{"x": rng.normal(0, 1, shape).astype(np.float32)} for _ in range(n)]


def test_the_shift_is_exact_for_unpadded_convs_grouped_convs_and_matmuls():
    mm = _model(MATMULS, {"Wm": RNG.normal(0, 1, (8, 3)), "Wn": RNG.normal(0, 1, (8, 3)),
                          "bn": RNG.normal(0, 1, 3)})
    done = shift(mm, {"x": RNG.normal(2, 1, 8)}, {"x": ["m", "n"]})
    assert done and set(done.details["centres"]) == {"m", "n"}
    # The unbiased MatMul got an Add to take W.c back; the biased one's Add took it.
    assert sum(n.op_type == "Add" for n in done.model.graph.node) == 3
    assert pooled_rel_l2(done.model, mm, _feeds((2, 5, 8), 3)) < 1e-6
    grouped = _model(GROUPED, {"Wg": RNG.normal(0, 1, (4, 2, 3, 3)),
                               "Wp": RNG.normal(0, 1, (2, 4, 3, 3))})
    by_label = {n.name: n for n in grouped.graph.node}
    assert shiftable(grouped.graph, by_label["g"]) and not shiftable(grouped.graph, by_label["p"])
    done = shift(grouped, {"x": np.array([1.0, -2.0, 3.0, 0.5])}, {"x": ["g"]})
    assert done and pooled_rel_l2(done.model, grouped, _feeds((1, 4, 6, 6), 3)) < 1e-6


def test_the_shift_declines_without_a_reader_or_an_offset():
    model = _skewed()
    nothing = shift(model, {"h": np.zeros(8)}, {"h": ["r"]})
    assert not nothing and "no layer input" in nothing.reason
    assert not shift(model, {"h": np.ones(8)}, {"h": []})


def test_an_8bit_layer_reading_a_centred_input_has_its_bias_corrected_by_its_mean():
    # c is each channel's midpoint; the values crowd near its bottom (a PReLU's negative side
    # squeezed), so E[x - c] is far from zero and the 8-bit weight's error (W8 - W).(x - c)
    # moves every output unless the bias takes (W8 - W).E[x - c] (quantise's centred_means).
    model, samples = _skewed(), _feeds((1, 4, 10, 10), 6)
    c = np.full(8, 12.0, np.float32)
    done = shift(model, {"h": c}, {"h": ["r"]})
    stats = calibrate(Model(done.model, "", "centred"), samples, detail="all")
    xc = done.details["centred"]["h"]
    mean = channel_means(done.model, {xc: 1}, samples)[xc]
    store = WeightStore()
    followed = quantise(done.model, ["r"], stats, SYMMETRIC, saturate=True, weights=store,
                        centred_means={"r": mean}).model
    left = quantise(done.model, ["r"], stats, SYMMETRIC, saturate=True, weights=store).model
    assert pooled_rel_l2(followed, model, samples) < 0.8 * pooled_rel_l2(left, model, samples)

    def drift(qdq: onnx.ModelProto) -> float:
        # The outputs' error averaged per output channel: what the bias decides.
        got, want = make_session(qdq), make_session(model)
        return float(np.abs(np.mean([run(got, f)["y"] - run(want, f)["y"] for f in samples],
                                    axis=(0, 1, 3, 4))).max())

    assert drift(followed) < 0.2 * drift(left), (drift(followed), drift(left))


def _measures(reference: onnx.ModelProto, nodes: list[str]) -> dict[str, Any]:
    variant = Variant(SYMMETRIC, (ScaleRule("absmax"),), True)

    def measure(model, stats, groups, on, bounds, centred_means=None):
        return errors_alone(reference, model, groups, stats, variant, on, bounds=bounds,
                            centred_means=centred_means)

    def whole(model, stats, on, centred_means):
        return measure(model, stats, [nodes], on, None, centred_means)[0]

    return {"measure": measure, "whole": whole}


def test_a_skewed_input_is_centred_where_its_reader_errs_less_in_int8():
    model, samples = _skewed(), _feeds((1, 4, 10, 10), 8)
    stats = calibrate(Model(model, "", "m"), samples, detail="all")
    done = centre_skewed_inputs(model, ["c1", "r"], stats, samples, SYMMETRIC,
                                left_alone=(), **_measures(model, ["c1", "r"]))
    assert set(done.tensors) == {"h"} and set(done.means) == {"r"}
    before, after = done.errors["h"]
    assert after < 0.7 * before, done.errors
    assert done.tensors["h"][1] > 1.25
    # The model kept is the source's in FP32, and its INT8 reader errs less than uncentred.
    held = _feeds((1, 4, 10, 10), 4)
    assert pooled_rel_l2(done.model, model, held) < 1e-6
    centred = quantise(done.model, ["r"], done.stats, SYMMETRIC, saturate=True,
                       rule=ScaleRule("absmax"), centred_means=done.means).model
    plain = quantise(model, ["r"], stats, SYMMETRIC, saturate=True,
                     rule=ScaleRule("absmax")).model
    assert pooled_rel_l2(centred, model, held) < 0.7 * pooled_rel_l2(plain, model, held)


def test_an_input_about_zero_is_not_centred_and_says_why():
    model, samples = _skewed(centred_channels=True), _feeds((1, 4, 10, 10), 8)
    # Its channels reach about as far below zero as above: PRelu's slope only, no offset.
    model.graph.initializer[2].CopyFrom(numpy_helper.from_array(
        np.ones((8, 1, 1), np.float32), "slope"))
    stats = calibrate(Model(model, "", "m"), samples, detail="all")
    done = centre_skewed_inputs(model, ["r"], stats, samples, SYMMETRIC, left_alone=(),
                                **_measures(model, ["r"]))
    assert not done.tensors and done.model is model and "span gain" in done.reason


def test_an_input_often_at_zero_is_not_centred():
    # A ReLU's output (PRelu's slope 0) biased above zero: off centre, but a quarter of its
    # values sit at zero, which INT8 holds exactly and x - c would not.
    model, samples = _skewed(), _feeds((1, 4, 10, 10), 8)
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(
        np.full(8, 0.5, np.float32), "B1"))
    model.graph.initializer[2].CopyFrom(numpy_helper.from_array(
        np.zeros((8, 1, 1), np.float32), "slope"))
    stats = calibrate(Model(model, "", "m"), samples, detail="all")
    assert stats.tensors["h"].zero_count > 0.1 * stats.tensors["h"].detailed_count
    done = centre_skewed_inputs(model, ["r"], stats, samples, SYMMETRIC, left_alone=(),
                                **_measures(model, ["r"]))
    assert not done.tensors and "of its values at zero" in done.reason


def test_a_centring_the_gate_does_not_feel_is_not_kept():
    # r alone errs less centred, but the outputs as the gate judges them (here a decided
    # output whose margins centring does not move: the same error either way) gain nothing.
    model, samples = _skewed(), _feeds((1, 4, 10, 10), 8)
    stats = calibrate(Model(model, "", "m"), samples, detail="all")
    seen: list[dict[str, np.ndarray]] = []

    def unmoved(model, stats, on, centred_means):
        seen.append(dict(centred_means))
        return 0.02

    done = centre_skewed_inputs(model, ["r"], stats, samples, SYMMETRIC, left_alone=(),
                                measure=_measures(model, ["r"])["measure"], whole=unmoved)
    assert not done.tensors and done.model is model
    assert "less than 5% off" in done.reason, done.reason
    # Judged once as it was and once centred, with r's centred input's mean.
    assert seen[0] == {} and set(seen[1]) == {"r"}


def _converted(tmp_path: Any, rtol: float) -> tuple[onnx.ModelProto, Any, np.random.Generator]:
    """The skewed net (its own draw) converted to INT8 for orin (symmetric INT8) at `rtol`."""
    from npuprep.model_io import fingerprint
    from npuprep.pipeline import convert
    from npuprep.profiles import load_profile

    rng = np.random.default_rng(5)
    proto, feeds = _skewed(rng=rng), _feeds((1, 4, 10, 10), 8, rng)
    model = Model(proto=proto, path=str(tmp_path / "m.onnx"), digest=fingerprint(proto))
    stats = calibrate(model, feeds, detail="all")
    return proto, convert(model, load_profile("orin"), feeds, precision="int8", stats=stats,
                          rtol=rtol), rng


def test_convert_searches_again_centred_where_the_first_search_fails(tmp_path):
    # For a symmetric target (orin) at a gate of 2.5e-3: every layer in INT8 errs 3.2e-3 as
    # balanced, and r cannot go FP16 (c1 alone is under half the multiply-adds); centred,
    # 1.75e-3 at 100% INT8.
    proto, result, rng = _converted(tmp_path, 2.5e-3)
    said = next(n for n in result.notes if n.startswith("searched again"))
    assert "kept over the search without" in said and "failing)" in said, said
    assert any("centred per channel" in n for n in result.notes)
    assert result.output_check and result.eight_bit.mac_share["int8"] == 1.0
    written = result.lowered.model
    shifts = [n for n in written.graph.node if n.op_type == "Add" and n.name.endswith("_Centre")]
    # h itself, or h divided per channel where the Conv balancing took it first.
    assert len(shifts) == 1 and shifts[0].input[0].startswith("h"), shifts
    r = next(n for n in written.graph.node if n.name == "r")
    assert r.input[0].startswith(shifts[0].output[0])  # through its Q/DQ pair
    assert pooled_rel_l2(written, proto, _feeds((1, 4, 10, 10), 4, rng)) < 2.5e-3


def test_a_conversion_that_passes_as_balanced_is_not_searched_centred(tmp_path):
    result = _converted(tmp_path, 0.01)[1]
    assert result.output_check and result.eight_bit.mac_share["int8"] == 1.0
    assert not any("centred" in n for n in result.notes)
    assert not any(n.name.endswith("_Centre") for n in result.lowered.model.graph.node)


def test_the_headroom_a_left_out_sample_shows_past_a_centred_clip():
    from npuprep.verify.channel_shift import centred_raise

    # One channel, three samples reaching 1, 1 and 2 from 0: without the third, the centre
    # is 0.5 and the clip 0.5, and the third reaches 1.5 from that centre: 3x.
    low, high = np.zeros((3, 1)), np.array([[1.0], [1.0], [2.0]])
    assert centred_raise(low, high) == 3.0
    # Samples that agree need none; fewer than three give no spread to go by.
    assert centred_raise(np.zeros((4, 2)), np.ones((4, 2))) == 1.0
    assert centred_raise(low[:2], high[:2]) == 1.0
