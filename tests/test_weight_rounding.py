"""8-bit weights rounded for the layer's output (SeqMSE scale search, GPTQ-style up/down
rounding): the layer's output error on unseen inputs is lower than round-to-nearest's, and
the written QDQ model computes exactly the dequantised weights onnxruntime is given."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper, parser

from npuprep.calibrate.layer_inputs import input_moments
from npuprep.numerics import eight_bit_format
from npuprep.rewrite.qdq import insert_qdq
from npuprep.rewrite.qdq_weights import WeightStore
from npuprep.rewrite.weight_rounding import levels, round_layers
from npuprep.runtime.session import make_session, run

# x [64, 32] -> MatMul "fc" (W [32, 24]) -> y
DENSE = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[64, 32] x) => (float[64, 24] y) {
    [fc] y = MatMul (x, W)
}
"""

# x [1, 8, 10, 9] -> Conv "conv" (W [8, 2, 3, 3], group 4, stride 2, pads 1 0 1 2, dilation 1 2) -> y
GROUPED = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[1, 8, 10, 9] x) => (float[1, 8, 5, 4] y) {
    [conv] y = Conv <group = 4, strides = [2, 2], pads = [1, 0, 1, 2], dilations = [1, 2]> (x, W)
}
"""


def _dense(seed: int = 0) -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """A dense layer whose inputs are correlated (a low-rank mix plus a little noise) and whose
    weights have a few large values per column: what nearest rounding serves worst."""
    rng = np.random.default_rng(seed)
    proto = parser.parse_model(DENSE)
    w = rng.standard_normal((32, 24)) * 0.2
    w[rng.integers(0, 32, 24), np.arange(24)] *= 6.0
    proto.graph.initializer.append(numpy_helper.from_array(w.astype(np.float32), "W"))
    mix = rng.standard_normal((6, 32))
    feeds = [{"x": (rng.standard_normal((64, 6)) @ mix + 0.05 * rng.standard_normal((64, 32)))
              .astype(np.float32)} for _ in range(12)]
    return proto, feeds


def _weight_only(proto: onnx.ModelProto, label: str, fmt_name: str,
                 store: WeightStore) -> onnx.ModelProto:
    """The QDQ model with only `label`'s weight in 8 bits (its input stays FP32)."""
    return insert_qdq(proto, {label: {}}, eight_bit_format(fmt_name), saturate=True,
                      weights=store).model


def _rel_error(model: onnx.ModelProto, proto: onnx.ModelProto,
               feeds: list[dict[str, np.ndarray]]) -> float:
    ref, got = make_session(proto), make_session(model)
    num = sum(float(np.sum((run(got, f)["y"] - run(ref, f)["y"]) ** 2)) for f in feeds)
    return float(np.sqrt(num / sum(float(np.sum(run(ref, f)["y"] ** 2)) for f in feeds)))


@pytest.mark.parametrize("fmt_name", ["int8", "fp8_e4m3"])
def test_rounded_layer_errs_less_than_nearest_on_unseen_inputs(fmt_name: str) -> None:
    proto, feeds = _dense()
    calib, unseen = feeds[:8], feeds[8:]
    nearest = _rel_error(_weight_only(proto, "fc", fmt_name, WeightStore()), proto, unseen)
    store = WeightStore()
    done = round_layers(proto, ["fc"], [(eight_bit_format(fmt_name), True)], calib, store)
    assert [(r.node, r.format) for r in done] == [("fc", fmt_name)]
    assert done[0].error < done[0].nearest  # on the calibration half it was not fitted on
    rounded = _rel_error(_weight_only(proto, "fc", fmt_name, store), proto, unseen)
    assert rounded < 0.9 * nearest, (rounded, nearest)


@pytest.mark.parametrize("fmt_name", ["int8", "fp8_e4m3"])
def test_written_model_computes_the_rounded_weights(fmt_name: str) -> None:
    """The QDQ model's output is x @ (stored x scale): the values the store was given, on the
    format's grid, within one step of the FP32 weight's neighbours."""
    proto, feeds = _dense(1)
    fmt = eight_bit_format(fmt_name)
    store = WeightStore()
    round_layers(proto, ["fc"], [(fmt, True)], feeds[:8], store)
    w = numpy_helper.to_array(proto.graph.initializer[0])
    stored, scale = store.values(proto.graph.initializer[0], 1, fmt, saturate=True)
    steps = stored.astype(np.float64)
    assert np.all(np.isin(steps, levels(fmt)))
    dequantised = stored.astype(np.float32) * scale[None, :]
    assert np.abs(dequantised - w).max() <= 2 * float(scale.max()) * (1 if fmt_name == "int8" else 32)
    built = _weight_only(proto, "fc", fmt_name, store)
    session = make_session(built)
    for f in feeds[8:]:
        expected = f["x"] @ dequantised
        np.testing.assert_allclose(run(session, f)["y"], expected, rtol=1e-5, atol=1e-5)


def test_conv_moments_give_the_conv_output_error() -> None:
    """sum over channels of d H d^T (H from the Conv's input patches) is the squared output
    of the same Conv with weight D: the patches follow the group, stride, pads, dilation."""
    rng = np.random.default_rng(2)
    proto = parser.parse_model(GROUPED)
    proto.graph.initializer.append(
        numpy_helper.from_array(rng.standard_normal((8, 2, 3, 3)).astype(np.float32), "W"))
    feeds = [{"x": rng.standard_normal((1, 8, 10, 9)).astype(np.float32)} for _ in range(2)]
    (moments,) = input_moments(proto, ["conv"], [feeds])
    gram = moments["conv"].gram
    assert gram.shape == (4, 18, 18) and moments["conv"].rows == 2 * 5 * 4
    d = rng.standard_normal((8, 2, 3, 3)).astype(np.float32)
    rows = d.reshape(4, 2, 18).astype(np.float64)
    predicted = float(np.einsum("gok,gkl,gol->", rows, gram, rows))
    proto.graph.initializer[0].CopyFrom(numpy_helper.from_array(d, "W"))
    session = make_session(proto)
    actual = sum(float(np.sum(run(session, f)["y"].astype(np.float64) ** 2)) for f in feeds)
    assert predicted == pytest.approx(actual, rel=1e-4)


def test_conv_moments_less_an_offset_per_channel_give_the_error_on_the_rest() -> None:
    """With `offsets` (a centred input's mean, which its bias corrects for), sum d H d^T is
    the squared output of the Conv with weight D on x less that mean per channel: each
    group's taps take their channel's value (the layout of the patches)."""
    # x -> grouped, strided, dilated Conv without padding [conv] -> y
    unpadded = GROUPED.replace("pads = [1, 0, 1, 2], ", "").replace("5, 4]", "4, 3]")
    rng = np.random.default_rng(3)
    proto = parser.parse_model(unpadded)
    proto.graph.initializer.append(
        numpy_helper.from_array(rng.standard_normal((8, 2, 3, 3)).astype(np.float32), "W"))
    mean = rng.normal(2.0, 1.0, 8).astype(np.float32)
    feeds = [{"x": (rng.standard_normal((1, 8, 10, 9)) + 3.0).astype(np.float32)}
             for _ in range(2)]
    (moments,) = input_moments(proto, ["conv"], [feeds], offsets={"conv": mean})
    d = rng.standard_normal((8, 2, 3, 3)).astype(np.float32)
    rows = d.reshape(4, 2, 18).astype(np.float64)
    predicted = float(np.einsum("gok,gkl,gol->", rows, moments["conv"].gram, rows))
    proto.graph.initializer[0].CopyFrom(numpy_helper.from_array(d, "W"))
    session = make_session(proto)
    shifted = [{"x": f["x"] - mean.reshape(1, 8, 1, 1)} for f in feeds]
    actual = sum(float(np.sum(run(session, f)["y"].astype(np.float64) ** 2)) for f in shifted)
    assert predicted == pytest.approx(actual, rel=1e-4)
    plain = input_moments(proto, ["conv"], [feeds])[0]["conv"].gram
    assert not np.allclose(plain, moments["conv"].gram)


def test_shared_weight_is_rounded_for_both_readers() -> None:
    """A weight two 8-bit layers read (a guidance's two branches) gets one rounding, fitted
    to both layers' inputs: their summed output error is lower than nearest's; a third
    reader outside the 8-bit layers leaves it at nearest."""
    model = parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 19]>
    g (float[64, 32] x, float[64, 32] z) => (float[64, 24] y, float[64, 24] v) {
        [a] y = MatMul (x, W)
        [b] v = MatMul (z, W)
    }
    """)
    proto, feeds = _dense()
    model.graph.initializer.extend(proto.graph.initializer)
    both = [{"x": f["x"], "z": f["x"][:, ::-1].copy()} for f in feeds]
    fmt = eight_bit_format("int8")
    store = WeightStore()
    (done,) = round_layers(model, ["a", "b"], [(fmt, True)], both, store)
    assert done.node == "a, b" and done.error < done.nearest
    assert round_layers(model, ["a"], [(fmt, True)], both, WeightStore()) == []


def test_rounding_kept_where_the_model_outputs_gain_and_forgotten_back_to_nearest() -> None:
    from npuprep.calibrate import calibrate
    from npuprep.model_io import Model, fingerprint
    from npuprep.pipeline.trial_sessions import round_weights
    from npuprep.rewrite.qdq_weights import quantise_weight
    from npuprep.scale_rules import ScaleRule
    from npuprep.verify.qdq_model import quantise
    from npuprep.verify.qdq_trials import Variant

    proto, feeds = _dense(3)
    stats = calibrate(Model(proto, "m.onnx", fingerprint(proto)), feeds, detail="all")
    int8 = eight_bit_format("int8")
    variant = Variant(int8, (ScaleRule.ABSMAX,), True)
    store = WeightStore()
    notes = round_weights(proto, proto, {"fc": "int8"}, [variant], feeds, store, stats, {})
    assert len(notes) == 1 and "rounded for their outputs" in notes[0]

    def built(weights: WeightStore) -> onnx.ModelProto:
        return quantise(proto, ["fc"], stats, int8, saturate=True, rule=ScaleRule.ABSMAX,
                        weights=weights).model

    # The note's numbers are the two QDQ models' on the odd (unfitted) samples.
    odd = feeds[1::2][:4]
    nearest, rounded = _rel_error(built(WeightStore()), proto, odd), _rel_error(built(store), proto, odd)
    assert rounded < nearest and f"{nearest:.3g} -> {rounded:.3g}" in notes[0]
    # A rounding the outputs refuse is forgotten: the store gives nearest again.
    store.forget(int8)
    w = numpy_helper.to_array(proto.graph.initializer[0])
    for got, want in zip(store.values(w, 1, int8, saturate=True),
                         quantise_weight(w, 1, int8, saturate=True), strict=True):
        assert np.array_equal(got, want)


def test_the_triangular_inverse_by_halves_is_the_inverse_and_rounds_alike() -> None:
    # H's factor inverted by halves (two groups, K past two halvings and odd) against numpy's
    # general inverse: the same matrix to rounding, and the same rounded weights from it.
    from npuprep.rewrite.weight_rounding import TRIANGULAR_LEAF, _sequential, upper_inverse

    rng = np.random.default_rng(4)
    k = 4 * TRIANGULAR_LEAF + 3
    x = rng.standard_normal((3 * k, k)) * rng.random(k)
    gram = np.stack([x.T @ x, 2 * x.T @ x + np.eye(k)])
    v = np.linalg.cholesky(gram[:, ::-1, ::-1])[:, ::-1, ::-1]
    by_halves, whole = upper_inverse(v), np.linalg.inv(v)
    assert np.array_equal(np.tril(by_halves, -1), np.zeros_like(by_halves))
    assert np.abs(by_halves - whole).max() <= 1e-12 * np.abs(whole).max()
    assert np.allclose(np.matmul(v, by_halves), np.eye(k), atol=1e-9)
    rows = rng.standard_normal((2, 16, k)) * 0.05
    for fmt in (eight_bit_format("int8"), eight_bit_format("fp8_e4m3")):
        scale = np.abs(rows).max(axis=2) / fmt.qmax
        assert np.array_equal(_sequential(rows, scale, fmt, by_halves),
                              _sequential(rows, scale, fmt, whole))


def _rounded_in_order(rows: np.ndarray, scale: np.ndarray, fmt: object, u: np.ndarray) -> np.ndarray:
    """GPTQ's loop as written in the paper's layout ([G, O, K], a column at a time)."""
    from npuprep.rewrite.weight_rounding import _nearest, _neighbours

    v = rows / scale[..., None]
    lo, hi = _neighbours(v, fmt)  # type: ignore[arg-type]
    work, q = v.copy(), np.empty_like(v)
    for i in range(v.shape[2]):
        q[..., i] = np.clip(_nearest(work[..., i], fmt), lo[..., i], hi[..., i])  # type: ignore[arg-type]
        work[..., i + 1:] -= ((work[..., i] - q[..., i]) / u[:, i, i][:, None])[..., None] \
            * u[:, None, i, i + 1:]
    return q


def test_rounding_column_by_column_in_blocks_rounds_as_the_plain_loop() -> None:
    # Blocks of BLOCK columns (their errors carried on by one product) in [G, K, O]: the same
    # up/down choices as the plain loop over [G, O, K] (K past one block, two groups), and
    # many of them not round-to-nearest.
    from npuprep.rewrite.weight_rounding import BLOCK, _nearest, _sequential, inverse_factor

    rng = np.random.default_rng(6)
    k = BLOCK + 37
    x = rng.standard_normal((4 * k, k)) * rng.random(k)
    u = inverse_factor(np.stack([x.T @ x, x.T @ x * 3]))
    rows = rng.standard_normal((2, 24, k)) * 0.05
    for fmt in (eight_bit_format("int8"), eight_bit_format("fp8_e4m3")):
        scale = np.abs(rows).max(axis=2) / fmt.qmax
        got, plain = _sequential(rows, scale, fmt, u), _rounded_in_order(rows, scale, fmt, u)
        assert np.array_equal(got, plain)
        assert np.count_nonzero(got != _nearest(rows / scale[..., None], fmt)) > got.size // 20


# x [16, 12] -> MatMul q (Wq), MatMul k (Wk), Gemm v (Wv, transB); q -> MatMul o (Wo) -> y
SHARED_INPUT = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[16, 12] x) => (float[16, 12] q, float[16, 12] k, float[16, 12] v, float[16, 12] y) {
    [q] q = MatMul (x, Wq)
    [k] k = MatMul (x, Wk)
    [v] v = Gemm <transB = 1> (x, Wv)
    [o] y = MatMul (q, Wo)
}
"""


def test_readers_of_one_input_share_its_moments_bit_for_bit() -> None:
    rng = np.random.default_rng(3)
    proto = parser.parse_model(SHARED_INPUT)
    proto.graph.initializer.extend(
        numpy_helper.from_array(rng.standard_normal((12, 12)).astype(np.float32), name)
        for name in ("Wq", "Wk", "Wv", "Wo"))
    feeds = [{"x": rng.standard_normal((16, 12)).astype(np.float32)} for _ in range(3)]
    (found,) = input_moments(proto, ["q", "k", "v", "o"], [feeds])
    session = make_session(proto)

    def gram(xs: list[np.ndarray]) -> np.ndarray:
        total = None
        for x in xs:
            one = np.matmul(x[None].transpose(0, 2, 1), x[None]).astype(np.float64)
            total = one if total is None else total + one
        return total

    xs = [f["x"] for f in feeds]
    for label in ("q", "k", "v"):
        assert found[label].rows == 48
        np.testing.assert_array_equal(found[label].gram, gram(xs))
    # o reads another tensor: its own moments.
    qs = [np.asarray(run(session, f)["q"], np.float32) for f in feeds]
    np.testing.assert_array_equal(found["o"].gram, gram(qs))
    assert not np.array_equal(found["o"].gram, found["q"].gram)


def test_layers_sharing_an_input_round_as_each_layer_alone_bit_for_bit() -> None:
    """round_layers works out a shared input's H (float32 copies, the inverse factor) once
    for q, k and v and each weight's signal once for both formats: every weight's values,
    scales and errors equal round_weight's, which works each out for itself."""
    from npuprep.rewrite.qdq import weight_axis
    from npuprep.rewrite.weight_rounding import round_weight

    rng = np.random.default_rng(5)
    proto = parser.parse_model(SHARED_INPUT)
    proto.graph.initializer.extend(
        numpy_helper.from_array((rng.standard_normal((12, 12)) * rng.uniform(0.1, 3.0, 12))
                                .astype(np.float32), name) for name in ("Wq", "Wk", "Wv", "Wo"))
    mix = rng.standard_normal((4, 12))
    feeds = [{"x": (rng.standard_normal((16, 4)) @ mix + 0.05 * rng.standard_normal((16, 12)))
              .astype(np.float32)} for _ in range(6)]
    formats = [(eight_bit_format("int8"), True), (eight_bit_format("fp8_e4m3"), False)]
    store = WeightStore()
    done = round_layers(proto, ["q", "k", "v", "o"], formats, feeds, store)
    assert {d.node for d in done} >= {"q", "k", "v"}
    fit, check = input_moments(proto, ["q", "k", "v", "o"], [feeds[0::2], feeds[1::2]])
    nodes = {n.name: n for n in proto.graph.node}
    weights = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    for d in done:
        node, (fmt, saturate) = nodes[d.node], next(f for f in formats if f[0].name == d.format)
        w = weights[node.input[1]]
        alone = round_weight(node, w, fmt, fit[d.node], check[d.node], saturate=saturate)
        assert alone is not None
        assert (alone.nearest, alone.error, alone.changed) == (d.nearest, d.error, d.changed)
        stored, scale = store.values(w, weight_axis(node, w.ndim), fmt, saturate=saturate)
        np.testing.assert_array_equal(stored.view(np.uint8), alone.stored.view(np.uint8))
        np.testing.assert_array_equal(scale, alone.scale)


def test_fp8_neighbours_from_one_search_are_the_two_searches() -> None:
    """Each value's FP8 levels at or below and at or above it from one search of the grid,
    as from a search from each side: on the levels, between them, past both ends, -0.0."""
    from npuprep.rewrite.weight_rounding import _neighbours

    fmt = eight_bit_format("fp8_e4m3")
    grid = levels(fmt)
    rng = np.random.default_rng(0)
    v = np.concatenate([[-0.0, 0.0, -1e9, 1e9], grid, (grid[1:] + grid[:-1]) / 2,
                        rng.uniform(-500, 500, 4000), rng.standard_normal(4000) * 1e-3])
    v = v[:len(v) // 6 * 6]  # [2, -1, 3]: a weight's rows as _sequential reads them
    lower, upper = _neighbours(v.reshape(2, -1, 3), fmt)
    last = len(grid) - 1
    want_upper = grid[np.clip(np.searchsorted(grid, v, side="left"), 0, last)]
    want_lower = grid[np.clip(np.searchsorted(grid, v, side="right") - 1, 0, last)]
    np.testing.assert_array_equal(upper.reshape(-1), want_upper)
    np.testing.assert_array_equal(lower.reshape(-1), want_lower)


def test_layers_rounded_side_by_side_round_as_one_after_another() -> None:
    """Two threads rounding the layers give the roundings, notes and order of one."""
    from npuprep.rewrite.qdq import weight_axis

    rng = np.random.default_rng(6)
    proto = parser.parse_model(SHARED_INPUT)
    proto.graph.initializer.extend(
        numpy_helper.from_array(rng.standard_normal((12, 12)).astype(np.float32), name)
        for name in ("Wq", "Wk", "Wv", "Wo"))
    feeds = [{"x": rng.standard_normal((16, 12)).astype(np.float32)} for _ in range(6)]
    formats = [(eight_bit_format("int8"), True), (eight_bit_format("fp8_e4m3"), False)]
    stores = [WeightStore(), WeightStore()]
    done = [round_layers(proto, ["q", "k", "v", "o"], formats, feeds, store, workers=n)
            for store, n in zip(stores, (1, 2), strict=True)]
    assert done[0] == done[1] and len(done[0]) > 4
    nodes = {n.name: n for n in proto.graph.node}
    for t in proto.graph.initializer:
        w, node = numpy_helper.to_array(t), nodes[{"Wq": "q", "Wk": "k", "Wv": "v", "Wo": "o"}[t.name]]
        for fmt, saturate in formats:
            a, b = (s.values(w, weight_axis(node, w.ndim), fmt, saturate=saturate) for s in stores)
            assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()


def test_rows_fewer_than_k_are_kept_and_give_the_gram_s_errors() -> None:
    """A layer read on fewer rows than K keeps them (InputMoments.kept): ||X d^T||^2 from
    them equals d H d^T from the gram, and the rounding is the one the gram alone gives; with
    as many rows as K or more, only the gram is kept."""
    import dataclasses

    from npuprep.rewrite.weight_rounding import _output_errors, round_weight

    proto, feeds = _dense(4)
    # x [N, 32] -> MatMul "fc" -> y: the same layer, any number of rows
    dynamic = parser.parse_model(DENSE.replace("[64,", "[N,"))
    dynamic.graph.initializer.extend(proto.graph.initializer)
    proto = dynamic
    few = [{"x": f["x"][:5]} for f in feeds[:4]]  # 20 rows of K = 32
    (moments,) = input_moments(proto, ["fc"], [few])
    kept = moments["fc"].kept
    assert kept is not None and kept.shape == (1, 20, 32)
    (many,) = input_moments(proto, ["fc"], [feeds[:1]])  # 64 rows
    assert many["fc"].kept is None
    d = np.random.default_rng(6).standard_normal((1, 24, 32))
    from_gram = _output_errors(dataclasses.replace(moments["fc"], kept=None))(d)
    np.testing.assert_allclose(_output_errors(moments["fc"])(d), from_gram, rtol=1e-5)
    np.testing.assert_allclose(from_gram, np.einsum("gok,gkl,gol->go", d, moments["fc"].gram, d),
                               rtol=1e-5)
    w = numpy_helper.to_array(proto.graph.initializer[0])
    (check,) = input_moments(proto, ["fc"], [[{"x": f["x"][:5]} for f in feeds[4:8]]])
    node = proto.graph.node[0]
    fmt = eight_bit_format("int8")
    with_rows = round_weight(node, w, fmt, moments["fc"], check["fc"])
    gram_only = round_weight(node, w, fmt, dataclasses.replace(moments["fc"], kept=None),
                             dataclasses.replace(check["fc"], kept=None))
    assert with_rows is not None and gram_only is not None
    np.testing.assert_array_equal(with_rows.stored, gram_only.stored)
    assert with_rows.error == pytest.approx(gram_only.error, rel=1e-5)

