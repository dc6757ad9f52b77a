"""The 8-bit search's trial model in pieces: a trial starting at a cut (its earlier pieces'
values kept from the all-off run) gives what the whole model gives, bit for bit, and does not
run the pieces before its first switch."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from onnx import numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import eight_bit_format, get_format
from npuprep.runtime.session import make_session, run
from npuprep.scale_rules import ScaleRule
from npuprep.verify.qdq_model import on_target
from npuprep.verify.qdq_trials import TRIAL_SAMPLES, LocalRuns, Variant, switched_qdq
from npuprep.verify.trial_pieces import cut_into_pieces
from npuprep.verify.weight_switches import fold_weight_switches

# x -> Conv a -> Relu -> Conv b -> Relu -> Conv c -> Relu -> Conv d -> y
CHAIN = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[1, 8, 24, 24] x) => (float[1, 8, 24, 24] y) {
    [a] h1 = Conv <pads = [1, 1, 1, 1]> (x, Wa)
    r1 = Relu (h1)
    [b] h2 = Conv <pads = [1, 1, 1, 1]> (r1, Wb)
    r2 = Relu (h2)
    [c] h3 = Conv <pads = [1, 1, 1, 1]> (r2, Wc)
    r3 = Relu (h3)
    [d] y = Conv <pads = [1, 1, 1, 1]> (r3, Wd)
}
"""
LAYERS = ("a", "b", "c", "d")


def _switched(text: str, seed: int) -> tuple[list, Any]:
    """The model `text` (LAYERS' weights W<layer>, 8 x 8 x 3 x 3) with random weights, its
    samples (the kept ones and two past them) and its layers behind INT8 switches."""
    rng = np.random.default_rng(seed)
    proto = parser.parse_model(text)
    for name in LAYERS:
        w = rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 0.3
        proto.graph.initializer.append(numpy_helper.from_array(w, f"W{name}"))
    feeds = [{"x": rng.standard_normal((1, 8, 24, 24)).astype(np.float32)}
             for _ in range(TRIAL_SAMPLES + 2)]
    model = Model(proto=proto, path="m.onnx", digest=fingerprint(proto))
    stats = calibrate(model, feeds, detail="all")
    return feeds, switched_qdq(proto, list(LAYERS), stats,
                               [Variant(eight_bit_format("int8"), (ScaleRule.ABSMAX,), True)])


def _chain_trials(seed: int) -> tuple[list, Any, Any, LocalRuns]:
    """CHAIN's samples, its switched layers, the FP16-emulated trial model and its runs in
    pieces."""
    feeds, switched = _switched(CHAIN, seed)
    trial = on_target(switched.model, get_format("fp16"), set(), saturate=True)
    trial = fold_weight_switches(trial, switched.weight_switches.values())
    return feeds, switched, trial, LocalRuns(trial, feeds)


class _Counted:
    """A session whose runs are counted."""

    def __init__(self, session: object) -> None:
        self.session, self.runs = session, 0

    def run(self, *args: object) -> object:
        self.runs += 1
        return self.session.run(*args)  # type: ignore[attr-defined]

    def get_outputs(self) -> object:
        return self.session.get_outputs()  # type: ignore[attr-defined]


def test_a_trial_from_a_cut_gives_the_whole_model_s_outputs_and_skips_the_pieces_before_it():
    feeds, switched, trial, runs = _chain_trials(5)
    assert len(runs.pieces) > 1
    whole = make_session(trial, prepack=False, threads=1)
    # Every set of layers in INT8, on a kept sample and one past them.
    jobs = [(i, switched.feed(dict.fromkeys(on, "int8"), {}))
            for r in range(len(LAYERS) + 1) for on in itertools.combinations(LAYERS, r)
            for i in (0, TRIAL_SAMPLES + 1)]
    got = runs.run(jobs)
    for (i, switches), out in zip(jobs, got, strict=True):
        expected = run(whole, {**feeds[i], **switches})
        assert np.array_equal(out["y"], expected["y"])
    # The last layer alone on a kept sample starts past the first piece: it is not run.
    last = switched.feed({"d": "int8"}, {})
    assert runs._start(last) > 0
    first = runs.sessions[0] = _Counted(runs.sessions[0])
    alone = runs.run([(0, last)])[0]
    assert first.runs == 0
    assert np.array_equal(alone["y"], run(whole, {**feeds[0], **last})["y"])


def test_a_trial_differing_from_an_earlier_one_late_starts_at_its_difference_bit_for_bit():
    feeds, switched, trial, runs = _chain_trials(7)
    whole = make_session(trial, prepack=False, threads=1)
    past = TRIAL_SAMPLES + 1  # a sample whose all-off values are not kept
    # a, b, c in INT8, then a, b, c, d: the second differs in d alone (a late piece).
    head = switched.feed(dict.fromkeys("abc", "int8"), {})
    more = switched.feed(dict.fromkeys("abcd", "int8"), {})
    d_from = runs._start(switched.feed({"d": "int8"}, {}))
    assert d_from > 1 and runs.prefixes.keys(head)[d_from] == runs.prefixes.keys(more)[d_from]
    runs.run([(past, head)])
    first = runs.sessions[0] = _Counted(runs.sessions[0])
    got = runs.run([(past, more), (past, head)])
    assert first.runs == 0  # both started past the first piece, the second at the outputs
    for switches, out in zip((more, head), got, strict=True):
        assert np.array_equal(out["y"], run(whole, {**feeds[past], **switches})["y"])
    # Every set of layers, each after every other, on a kept sample and one past them: the
    # same outputs as the whole model, whichever earlier trial each started from.
    jobs = [(i, switched.feed(dict.fromkeys(on, "int8"), {}))
            for r in range(len(LAYERS) + 1) for on in itertools.combinations(LAYERS, r)
            for i in (0, past)]
    for (i, switches), out in zip(jobs, runs.run(jobs), strict=True):
        assert np.array_equal(out["y"], run(whole, {**feeds[i], **switches})["y"])


# x -> Cast -> Cast -> a; W -> Clip -> Cast (constants only, 64x more elements than x);
# a -> MatMul(W rounded) -> Cast -> Cast -> y
CONSTANT_MIDDLE = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[1, 64] x) => (float[1, 64] y) {
    h = Cast <to = 10> (x)
    a = Cast <to = 1> (h)
    lo = Constant <value = float {-2.0}> ()
    hi = Constant <value = float {2.0}> ()
    wc = Clip (W, lo, hi)
    wh = Cast <to = 10> (wc)
    wr = Cast <to = 1> (wh)
    [m] p = MatMul (a, wr)
    q = Cast <to = 10> (p)
    y = Cast <to = 1> (q)
}
"""


def test_no_piece_is_constant_arithmetic_alone():
    rng = np.random.default_rng(2)
    proto = parser.parse_model(CONSTANT_MIDDLE)
    proto.graph.initializer.append(
        numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "W"))
    pieces = cut_into_pieces(proto, {"x": (1, 64)})
    assert len(pieces) > 1
    feed = {"x": rng.standard_normal((1, 64)).astype(np.float32)}
    values = dict(feed)
    for piece in pieces:
        assert piece.inputs and piece.outputs
        values.update(run(make_session(piece.model), {t: values[t] for t in piece.inputs}))
    np.testing.assert_array_equal(values["y"], run(make_session(proto), feed)["y"])


# x -> Cast -> Cast -> a (an output too: an LSTM's last state) -> MatMul(W) -> Cast -> Cast -> p;
# y = Where(switch, p + 1, p)
EARLY_OUTPUT = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[1, 64] x, bool s) => (float[1, 64] y, float[1, 64] a) {
    h = Cast <to = 10> (x)
    a = Cast <to = 1> (h)
    m = MatMul (a, W)
    q = Cast <to = 10> (m)
    p = Cast <to = 1> (q)
    one = Constant <value = float {1.0}> ()
    up = Add (p, one)
    y = Where (s, up, p)
}
"""


def test_a_trial_from_a_cut_gives_the_graph_outputs_earlier_pieces_write():
    rng = np.random.default_rng(3)
    proto = parser.parse_model(EARLY_OUTPUT)
    proto.graph.initializer.append(
        numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "W"))
    feeds = [{"x": rng.standard_normal((1, 64)).astype(np.float32)} for _ in range(2)]
    runs = LocalRuns(proto, feeds)
    on = {"s": np.array(True)}
    assert len(runs.pieces) > 1 and runs._start(on) > 0
    [got] = runs.run([(0, on)])
    expected = run(make_session(proto), {**feeds[0], **on})
    assert got.keys() == expected.keys() == {"y", "a"}
    assert all(np.array_equal(got[k], expected[k]) for k in expected)


# x [1, 1, 8, 8] -> Shape -> s (int64, read last); x -> Cast -> Cast -> MatMul m1 -> Cast -> Cast
# -> MatMul m2 -> Cast -> Cast -> MatMul m3 -> Cast -> Cast -> + Resize(P, sizes = s) -> y
# (P: a constant grid resized to the input's size, as a ViT's position embeddings)
SHAPE_READ_LAST = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[1, 1, 8, 8] x) => (float[1, 1, 8, 8] y) {
    s = Shape (x)
    h = Cast <to = 10> (x)
    a = Cast <to = 1> (h)
    [m1] p1 = MatMul (a, W1)
    q1 = Cast <to = 10> (p1)
    r1 = Cast <to = 1> (q1)
    [m2] p2 = MatMul (r1, W2)
    q2 = Cast <to = 10> (p2)
    r2 = Cast <to = 1> (q2)
    [m3] p3 = MatMul (r2, W3)
    q3 = Cast <to = 10> (p3)
    r3 = Cast <to = 1> (q3)
    grid = Resize <mode = "linear"> (P, , , s)
    y = Add (r3, grid)
}
"""


def test_a_size_read_at_the_end_crosses_the_cuts_bit_for_bit():
    """An input's shape, read by the last node (vit_s_focus's image size at its decoder's
    Resize), no longer keeps the model in one piece: it crosses every cut as an integer
    input, and the pieces give the whole model's outputs bit for bit."""
    rng = np.random.default_rng(4)
    proto = parser.parse_model(SHAPE_READ_LAST)
    proto.graph.initializer.extend(
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32) * 0.2, f"W{k}")
        for k in (1, 2, 3))
    proto.graph.initializer.append(
        numpy_helper.from_array(rng.standard_normal((1, 1, 4, 4)).astype(np.float32), "P"))
    pieces = cut_into_pieces(proto, {"x": (1, 1, 8, 8)})
    # Made in the first piece, read in the last (a Resize's sizes: declared with its rank).
    assert len(pieces) > 2 and "s" in pieces[-1].inputs
    _assert_pieces_give_the_whole(proto, pieces, rng, (1, 1, 8, 8))


# x -> Less(x, 0) -> Where(., -1e4, 0) -> mask (float, read last); x -> Cast -> Cast -> MatMul m1
# -> Cast -> Cast -> MatMul m2 -> Cast -> Cast -> MatMul m3 -> Cast -> Cast -> Add(., mask) -> y
MASK_READ_LAST = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[1, 64] x) => (float[1, 64] y) {
    zero = Constant <value = float {0.0}> ()
    low = Constant <value = float {-10000.0}> ()
    c = Less (x, zero)
    mask = Where (c, low, zero)
    h = Cast <to = 10> (x)
    a = Cast <to = 1> (h)
    [m1] p1 = MatMul (a, W1)
    q1 = Cast <to = 10> (p1)
    r1 = Cast <to = 1> (q1)
    [m2] p2 = MatMul (r1, W2)
    q2 = Cast <to = 10> (p2)
    r2 = Cast <to = 1> (q2)
    [m3] p3 = MatMul (r2, W3)
    q3 = Cast <to = 10> (p3)
    r3 = Cast <to = 1> (q3)
    y = Add (r3, mask)
}
"""


def test_a_mask_read_at_the_end_crosses_the_cuts_bit_for_bit():
    """A Where's mask, read by the last node (MiniLM's attention mask, read by every layer),
    no longer keeps the model in one piece, and the pieces give the whole model's outputs."""
    rng = np.random.default_rng(8)
    proto = parser.parse_model(MASK_READ_LAST)
    proto.graph.initializer.extend(
        numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32) * 0.2, f"W{k}")
        for k in (1, 2, 3))
    pieces = cut_into_pieces(proto, {"x": (1, 64)})
    assert len(pieces) > 2 and "mask" in pieces[-1].inputs
    _assert_pieces_give_the_whole(proto, pieces, rng, (1, 64))


def _assert_pieces_give_the_whole(proto, pieces, rng, shape) -> None:
    """Run in pieces (each reading the values the earlier ones wrote), the model's output 'y'
    is the whole model's, bit for bit, on three random inputs 'x' of `shape`."""
    whole = make_session(proto, prepack=False, threads=1)
    sessions = [make_session(p.model, prepack=False, threads=1) for p in pieces]
    for _ in range(3):
        feed = {"x": rng.standard_normal(shape).astype(np.float32)}
        values = dict(feed)
        for piece, session in zip(pieces, sessions, strict=True):
            values.update(run(session, {t: values[t] for t in piece.inputs}, list(piece.outputs)))
        assert np.array_equal(values["y"], run(whole, feed)["y"])


# x -> Conv a -> Relu -> s (read by Conv b and the last Add) -> Conv b -> Relu -> Conv c -> Relu
# -> Conv d -> Add(., s) -> y: in FP32, only the switched inputs' Ifs and the skip s cross a cut
SKIP = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[1, 8, 24, 24] x) => (float[1, 8, 24, 24] y) {
    [a] h1 = Conv <pads = [1, 1, 1, 1]> (x, Wa)
    s = Relu (h1)
    [b] h2 = Conv <pads = [1, 1, 1, 1]> (s, Wb)
    r2 = Relu (h2)
    [c] h3 = Conv <pads = [1, 1, 1, 1]> (r2, Wc)
    r3 = Relu (h3)
    [d] h4 = Conv <pads = [1, 1, 1, 1]> (r3, Wd)
    y = Add (h4, s)
}
"""


def test_a_skip_connection_in_fp32_crosses_the_cuts_and_a_trial_gives_the_whole_bit_for_bit():
    # SKIP's layers switchable to INT8 alone, every other node FP32 (a balancing's trials)
    feeds, switched = _switched(SKIP, 11)
    runs = LocalRuns(switched.model, feeds)
    # s is read until the end: without it crossing, no cut fits after layer a.
    assert len(runs.pieces) > 2 and any("s" in p.inputs for p in runs.pieces[2:])
    assert runs._start(switched.feed({"d": "int8"}, {})) > 1
    whole = make_session(switched.model, prepack=False, threads=1)
    jobs = [(i, switched.feed(dict.fromkeys(on, "int8"), {}))
            for r in range(len(LAYERS) + 1) for on in itertools.combinations(LAYERS, r)
            for i in (0, TRIAL_SAMPLES + 1)]
    for (i, switches), out in zip(jobs, runs.run(jobs), strict=True):
        assert np.array_equal(out["y"], run(whole, {**feeds[i], **switches})["y"])
