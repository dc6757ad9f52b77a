"""8-bit widening that holds on unseen samples: clips extrapolate the per-sample spread, the
ranking sees errors that cancel, and verification rounds the wider layers to FP16."""

from __future__ import annotations

import json

import numpy as np
import onnx
from conftest import run_cli
from onnx import numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.calibrate.scales import clip_for, sample_headroom
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import eight_bit_format, get_format
from npuprep.runtime.session import make_session, run
from npuprep.verify.eight_bit import on_target, quantise, rank_layers

RNG = np.random.default_rng(11)
INT8 = eight_bit_format("int8")


def _model(text: str, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    proto = parser.parse_model(text)
    for name, value in weights.items():
        proto.graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), name))
    return proto


def _rel_l2(ref: np.ndarray, got: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


# x -> MatMul(W) -> y, calibrated on samples whose abs-max spreads from 1 to 2
ONE = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[16, 8] x) => (float[16, 4] y) { [mm] y = MatMul (x, W) }
"""


def test_a_clip_set_on_spread_samples_extrapolates_and_an_unseen_larger_sample_stays_within():
    proto = _model(ONE, {"W": RNG.standard_normal((8, 4))})
    model = Model(proto=proto, path="m.onnx", digest=fingerprint(proto))
    feeds = [{"x": (a * RNG.uniform(-1, 1, (16, 8))).astype(np.float32)} for a in (1.0, 1.3, 1.6, 2.0)]
    stats = calibrate(model, feeds, detail="all")
    r = stats.tensors["x"]
    assert sample_headroom(r) > 1.2
    assert clip_for(r, INT8, "absmax", extrapolate=True).value > 1.2 * r.absmax
    # A new sample reaching 2.5: the calibration's abs-max (2.0) would clip its top values.
    unseen = {"x": (2.5 * RNG.uniform(-1, 1, (16, 8))).astype(np.float32)}
    ref = run(make_session(proto), unseen)["y"]
    got = run(make_session(quantise(proto, ["mm"], stats, INT8, saturate=True, rule="absmax").model),
              unseen)["y"]
    assert _rel_l2(ref, got) < 2e-2


# h1 = x.W, h2 = x.W (the same weights), v = x.V;  y = 8 h1 - 7 h2 + v: the branches' 8-bit
# errors cancel when both are quantised
GUIDED = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[16, 8] x) => (float[16, 4] y) {
    [cond] h1 = MatMul (x, W)
    [uncond] h2 = MatMul (x, W2)
    [side] v = MatMul (x, V)
    a = Mul (h1, eight)
    b = Mul (h2, seven)
    d = Sub (a, b)
    y = Add (d, v)
}
"""


def test_the_ranking_keeps_wider_what_gains_and_not_one_of_two_cancelling_branches():
    w = RNG.standard_normal((8, 4))
    proto = _model(GUIDED, {"W": w, "W2": w, "V": 0.3 * RNG.standard_normal((8, 4)),
                            "eight": np.array(8.0), "seven": np.array(7.0)})
    model = Model(proto=proto, path="m.onnx", digest=fingerprint(proto))
    feeds = [{"x": RNG.standard_normal((16, 8)).astype(np.float32)} for _ in range(4)]
    stats = calibrate(model, feeds, detail="all")
    ranking = rank_layers(proto, proto, ["cond", "uncond", "side"], stats, INT8, feeds,
                          saturate=True)
    gains = {s.node: s.gain for s in ranking}
    # Alone, either branch errs 8x; kept wider alone, it undoes the cancellation.
    assert ranking[0].node == "side" and gains["side"] > 0
    assert gains["cond"] < 0 and gains["uncond"] < 0


# x -> MatMul(W) -> h;  y = (h + 4096) - 4096: FP16 keeps 4096 + h to steps of 4
OFFSET = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[16, 8] x) => (float[16, 4] y) {
    [mm] h = MatMul (x, W)
    [lift] t = Add (h, big)
    [drop] y = Sub (t, big)
}
"""


def test_verification_rounds_the_layers_kept_wider_to_fp16_and_leaves_the_pins_fp32():
    proto = _model(OFFSET, {"W": RNG.standard_normal((8, 4)), "big": np.array(4096.0)})
    model = Model(proto=proto, path="m.onnx", digest=fingerprint(proto))
    feeds = [{"x": RNG.standard_normal((16, 8)).astype(np.float32)} for _ in range(4)]
    stats = calibrate(model, feeds, detail="all")
    qdq = quantise(proto, ["mm"], stats, INT8, saturate=True).model
    fp16 = get_format("fp16")
    ref = run(make_session(proto), feeds[0])["y"]
    as_written = run(make_session(qdq), feeds[0])["y"]
    board = run(make_session(on_target(qdq, fp16, (), saturate=True)), feeds[0])["y"]
    pinned = run(make_session(on_target(qdq, fp16, ("lift", "drop"), saturate=True)), feeds[0])["y"]
    assert _rel_l2(ref, as_written) < 2e-2 and _rel_l2(ref, pinned) < 2e-2
    assert _rel_l2(ref, board) > 0.1


def test_the_bundled_example_passes_held_out_in_int8_and_an_fp8_failure_names_the_layers(tmp_path):
    int8 = run_cli("convert", "--target", "a2000", "--precision", "int8", "-o", tmp_path / "i.onnx",
                   "--json", "--export", "none")
    report = json.loads(int8.stdout)
    assert int8.returncode == 0 and report["passed"] and report["holdout"]["passed"]
    assert report["eight_bit"]["mac_share"]["int8"] >= 0.8
    fp8 = run_cli("convert", "--target", "a2000", "--precision", "fp8_e4m3", "-o", tmp_path / "f.onnx",
                  "--json", "--export", "none")
    report = json.loads(fp8.stdout)
    assert fp8.returncode == 1 and not report["holdout"]["passed"]
    needs = [n for n in report["notes"] if "need more than fp8_e4m3" in n]
    assert needs and "hid_mm" in needs[0] and "of the multiply-adds" in needs[0]


# x -> MatMul(W: 64 x 128, FP8 past the inline size) -> y
WIDE = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[4, 64] x) => (float[4, 128] y) { [mm] y = MatMul (x, W) }
"""


def test_an_fp8_model_whose_weights_reach_onnxruntime_as_arrays_runs():
    proto = _model(WIDE, {"W": RNG.standard_normal((64, 128))})
    model = Model(proto=proto, path="m.onnx", digest=fingerprint(proto))
    feeds = [{"x": RNG.standard_normal((4, 64)).astype(np.float32)} for _ in range(2)]
    fp8 = eight_bit_format("fp8_e4m3")
    qdq = quantise(proto, ["mm"], calibrate(model, feeds, detail="all"), fp8, saturate=True).model
    ref, got = (run(make_session(m), feeds[0])["y"] for m in (proto, qdq))
    assert _rel_l2(ref, got) < 5e-2
