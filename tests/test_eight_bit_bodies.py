"""8-bit layers inside Loop bodies: decided from the body's calibrated ranges, quantised with
their Q/DQ in the body (weights read from the main graph), counted once per iteration, and
checked like the main graph's layers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from conftest import model_with_weights
from onnx import numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.calibrate.layer_macs import layer_macs
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import eight_bit_format, get_format
from npuprep.pipeline import convert
from npuprep.plan.layer_precision import decide
from npuprep.profiles import load_profile
from npuprep.runtime.session import make_session, run
from npuprep.scale_rules import ScaleRule
from npuprep.verify.qdq_model import quantise
from npuprep.verify.qdq_trials import Trials, Variant, switched_qdq
from npuprep.verify.ranking import rank_layers

RNG = np.random.default_rng(11)

# x -> MatMul(V) [proj] -> Loop(3 iterations) { h -> MatMul(W) [cell] -> Relu -> h } -> y
LOOPED = """
<ir_version: 8, opset_import: ["" : 17]>
looped (float[4, 16] x) => (float[4, 16] y) {
    [proj] p = MatMul(x, V)
    n = Constant<value = int64 {3}>()
    go = Constant<value = bool {1}>()
    y = Loop(n, go, p) <
        body = step (int64 i, bool cin, float[4, 16] h) => (bool cout, float[4, 16] h2) {
            cout = Identity(cin)
            [cell] m = MatMul(h, W)
            h2 = Relu(m)
        }
    >
}
"""

# x -> Loop(3 iterations) { MatMul(h, W) [cell] -> scan output m; h carried unchanged } -> ms
SPREAD = """
<ir_version: 8, opset_import: ["" : 17]>
spread (float[4, 16] x) => (float[4, 16] last, float[3, 4, 16] ms) {
    n = Constant<value = int64 {3}>()
    go = Constant<value = bool {1}>()
    last, ms = Loop(n, go, x) <
        body = step (int64 i, bool cin, float[4, 16] h) => (bool cout, float[4, 16] h2, float[4, 16] m) {
            cout = Identity(cin)
            h2 = Identity(h)
            [cell] m = MatMul(h, W)
        }
    >
}
"""


def _rel_l2(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def test_a_loop_bodys_matmul_converts_to_int8_behind_qdq_in_the_body_and_holds(tmp_path):
    weights = {"V": RNG.standard_normal((16, 16)) * 0.3, "W": RNG.standard_normal((16, 16)) * 0.4}
    model = model_with_weights(tmp_path, LOOPED, weights)
    feeds = [{"x": RNG.standard_normal((4, 16)).astype(np.float32)} for _ in range(6)]
    stats = calibrate(model, feeds, detail="all")
    # The body's layer runs 3 times per sample: three times the main graph's same-sized layer.
    macs = layer_macs(model.proto, stats, {"x": (4, 16)})
    assert macs == {"proj": 4 * 16 * 16, "cell": 3 * 4 * 16 * 16}
    result = convert(model, load_profile("a2000"), feeds, precision="int8", stats=stats,
                     rtol=5e-2)
    assert {x.node: x.precision for x in result.plan.eight_bit} == {"proj": "int8", "cell": "int8"}
    assert result.eight_bit.mac_share["int8"] == 1.0
    assert any(n.startswith("1 layer(s) inside If/Loop/Scan bodies (75.0% of") for n in result.notes)
    qdq = result.lowered.model
    onnx.checker.check_model(qdq, full_check=True)
    body = next(a.g for n in qdq.graph.node if n.op_type == "Loop" for a in n.attribute)
    made_by = {o: n.op_type for n in body.node for o in n.output}
    cell = next(n for n in body.node if n.name == "cell")
    # Both the carried activation and the weight reach the body's MatMul through a DQ there;
    # the 8-bit weight itself is the main graph's (every body may read it).
    assert made_by[cell.input[0]] == made_by[cell.input[1]] == "DequantizeLinear"
    dq = next(n for n in body.node if n.output[0] == cell.input[1])
    assert dq.input[0] in {i.name for i in qdq.graph.initializer}
    assert "W" not in {i.name for i in qdq.graph.initializer}
    for feed in feeds[:3]:
        ours, ref = run(make_session(qdq), feed)["y"], run(make_session(model.proto), feed)["y"]
        # Quantised (not the FP32 graph again), and within the tolerance asked.
        assert 0 < _rel_l2(ours, ref) < 5e-2
    assert result.output_check


def test_the_search_switches_a_body_layer_to_exactly_its_qdq_model(tmp_path):
    weights = {"V": RNG.standard_normal((16, 16)) * 0.3, "W": RNG.standard_normal((16, 16)) * 0.4}
    model = model_with_weights(tmp_path, LOOPED, weights)
    feed = {"x": RNG.standard_normal((4, 16)).astype(np.float32)}
    stats = calibrate(model, [feed], detail="all")
    int8 = eight_bit_format("int8")
    switched = switched_qdq(model.proto, ["proj", "cell"], stats,
                            [Variant(int8, (ScaleRule.ABSMAX,), True)])
    session = make_session(switched.model)
    built = quantise(model.proto, ["cell"], stats, int8, saturate=True, rule=ScaleRule.ABSMAX).model
    on = run(session, {**feed, **switched.feed({"cell": "int8"}, {})})["y"]
    off = run(session, {**feed, **switched.feed({}, {})})["y"]
    assert np.array_equal(on, run(make_session(built), feed)["y"])
    assert np.array_equal(off, run(make_session(model.proto), feed)["y"])
    assert not np.array_equal(on, off)
    # The ranking measures the body's layer like the main graph's (on FP16 around the pairs).
    trials = Trials(model.proto, switched, get_format("fp16"), (), [feed], saturate=True)
    ranked = {s.node: s for s in rank_layers(trials, ["proj", "cell"],
                                             {"proj": "int8", "cell": "int8"}, {})}
    assert ranked["cell"].alone > 0 and ranked["proj"].alone > 0


def test_a_body_layer_whose_input_spans_decades_stays_wider_in_int8_and_says_which(tmp_path):
    model = model_with_weights(tmp_path, SPREAD, {"W": RNG.standard_normal((16, 16))})
    # Magnitudes from 1e-6 to 1e2: INT8's one scale flushes most of them to zero.
    spread = [(10.0 ** RNG.uniform(-6, 2, (4, 16)) * RNG.choice([-1, 1], (4, 16))).astype(np.float32)
              for _ in range(4)]
    stats = calibrate(model, [{"x": x} for x in spread], detail="all")
    layers = {x.node: x for x in decide(model.proto, stats, eight_bit_format("int8"))}
    assert layers["cell"].precision == "fp16"
    assert "flushes" in layers["cell"].why and "input 'h'" in layers["cell"].why
    # The same body with ordinary inputs is INT8: the decline is the range's, not the body's.
    plain = calibrate(model, [{"x": RNG.standard_normal((4, 16)).astype(np.float32)}
                              for _ in range(4)], detail="all")
    assert {x.node: x.precision for x in decide(model.proto, plain, eight_bit_format("int8"))} \
        == {"cell": "int8"}


# If(c){ then: MatMul(x, W) | else: Relu(x) -> MatMul(W2) } -> r;
# Scan over xs { MatMul(s, U) -> y; a + y -> a }, U the body's own weight -> acc, ys
BRANCHED = """
<ir_version: 8, opset_import: ["" : 17]>
branched (float[4, 16] x, bool c, float[5, 4, 16] xs) => (float[4, 16] r, float[4, 16] acc, float[5, 4, 16] ys) {
    r = If(c) <
        then_branch = thenb () => (float[4, 16] t) { [then_mm] t = MatMul(x, W) },
        else_branch = elseb () => (float[4, 16] e) { xr = Relu(x)  [else_mm] e = MatMul(xr, W2) }
    >
    acc, ys = Scan(x, xs) <
        num_scan_inputs = 1,
        body = sb (float[4, 16] a, float[4, 16] s) => (float[4, 16] a2, float[4, 16] y) {
            [scan_mm] y = MatMul(s, U)
            a2 = Add(a, y)
        }
    >
}
"""


def _branched(tmp_path: Path) -> Model:
    proto = parser.parse_model(BRANCHED)
    for name in ("W", "W2"):
        proto.graph.initializer.append(
            numpy_helper.from_array(RNG.standard_normal((16, 16)).astype(np.float32), name))
    scan = next(n for n in proto.graph.node if n.op_type == "Scan")
    next(a for a in scan.attribute if a.name == "body").g.initializer.append(
        numpy_helper.from_array(RNG.standard_normal((16, 16)).astype(np.float32), "U"))
    onnx.save(proto, tmp_path / "model.onnx")
    return Model(proto=proto, path=str(tmp_path / "model.onnx"), digest=fingerprint(proto))


def _branch_feeds(taken: list[bool]) -> list[dict[str, np.ndarray]]:
    return [{"x": RNG.standard_normal((4, 16)).astype(np.float32), "c": np.array(c),
             "xs": RNG.standard_normal((5, 4, 16)).astype(np.float32)} for c in taken]


def test_a_branch_the_samples_never_take_stays_wider_and_says_so(tmp_path):
    model = _branched(tmp_path)
    stats = calibrate(model, _branch_feeds([True, True]), detail="all")
    layers = {x.node: x for x in decide(model.proto, stats, eight_bit_format("int8"))}
    assert layers["then_mm"].precision == layers["scan_mm"].precision == "int8"
    assert layers["else_mm"].precision == "fp16" and "never computed" in layers["else_mm"].why
    assert layer_macs(model.proto, stats, {})["else_mm"] == 0


def test_if_branches_and_a_scan_body_with_its_own_weight_convert_to_fp8_and_hold(tmp_path):
    model = _branched(tmp_path)
    feeds = _branch_feeds([True, False, True, False])
    stats = calibrate(model, feeds, detail="all")
    # Each branch ran on half the samples; the Scan body 5 times per sample.
    assert layer_macs(model.proto, stats, {}) == {"then_mm": 512, "else_mm": 512,
                                                  "scan_mm": 5 * 1024}
    result = convert(model, load_profile("a2000"), feeds, precision="fp8_e4m3", stats=stats,
                     rtol=5e-2)
    assert set(result.eight_bit.kept_wider) == set() and result.output_check
    qdq = result.lowered.model
    onnx.checker.check_model(qdq, full_check=True)
    body = next(a.g for n in qdq.graph.node if n.op_type == "Scan" for a in n.attribute
                if a.name == "body")
    # The body's own FP32 weight left it: its 8-bit copy is the main graph's.
    assert [i.name for i in body.initializer] == []
    ours, ref = make_session(qdq), make_session(model.proto)
    for feed in feeds[:2]:
        got, want = run(ours, feed), run(ref, feed)
        assert all(0 < _rel_l2(got[k], want[k]) < 5e-2 for k in want)


def test_a_layer_shape_inference_cannot_size_counts_its_measured_multiply_adds(tmp_path):
    # x[32] -> Reshape(s, a graph input: [4, 8]) -> MatMul(W 8x16) -> y[4, 16]: no static size
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[32] x, int64[2] s) => (float[4, 16] y) {
        r = Reshape(x, s)
        y = MatMul(r, W)
    }
    """
    model = model_with_weights(tmp_path, text, {"W": RNG.standard_normal((8, 16))})
    feeds = [{"x": RNG.standard_normal(32).astype(np.float32), "s": np.array([4, 8], np.int64)}
             for _ in range(3)]
    shapes = {k: v.shape for k, v in feeds[0].items()}
    [label] = layer_macs(model.proto, None, shapes)
    assert layer_macs(model.proto, None, shapes)[label] < 4 * 16 * 8  # sizes unknown
    assert layer_macs(model.proto, calibrate(model, feeds), shapes) == {label: 4 * 16 * 8}
