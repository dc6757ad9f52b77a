"""A few tensors' statistics binned in numpy from fetched values equal the in-graph ones."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest

import npuprep.calibrate.fetched as fetched
import npuprep.calibrate.run as calibrate_run
from npuprep.calibrate import calibrate
from npuprep.calibrate.fetched import fetchable, row_of
from npuprep.calibrate.layout import HEADER, HIST_BINS, HIST_OFFSET, OVER_FORMATS
from npuprep.data import SampleSet, load_samples
from npuprep.model_io import Model
from npuprep.numerics import get_format

# x -> Conv(w) -> y -> Relu -> r -> Mul(r, 1e-40) -> tiny (subnormals) ; r -> Mul(r, 300) -> big
CONVS = """
<ir_version: 8, opset_import: ["" : 18]>
convs (float[1,3,8,8] x) => (float[1,4,8,8] tiny, float[1,4,8,8] big) {
    y = Conv<pads = [1, 1, 1, 1]>(x, w)
    r = Relu(y)
    c_tiny = Constant<value = float {1e-40}>()
    tiny = Mul(r, c_tiny)
    c_big = Constant<value = float {300.0}>()
    big = Mul(r, c_big)
}
"""

# x -> If(flag: then Mul(x, 2) -> inner, else Neg(x) -> other) -> out
BRANCHED = """
<ir_version: 8, opset_import: ["" : 18]>
branched (float[4] x, bool flag) => (float[4] out) {
    out = If(flag) <
        then_branch = g1 () => (float[4] inner) { c = Constant<value = float {2.0}>() inner = Mul(x, c) },
        else_branch = g2 () => (float[4] other) { other = Neg(x) }
    >
}
"""


def _expected_row(values: np.ndarray) -> np.ndarray:
    """The row, value by value: bin floor(log2|x|) + 150 (zeros 0, Inf/NaN the top bin)."""
    row = np.zeros(len(HEADER) + HIST_BINS, np.int64)
    row[0] = row[1] = values.size
    for v in values.astype(np.float64):
        if math.isnan(v):
            row[HEADER.index("nan")] += 1
        b = 0 if v == 0 else HIST_BINS - 1 if not math.isfinite(v) else math.frexp(abs(v))[1] - 1 + HIST_OFFSET
        row[len(HEADER) + b] += 1
        for fmt in OVER_FORMATS:
            row[HEADER.index(f"over_{fmt}")] += int(not math.isnan(v) and abs(v) > get_format(fmt).max)
    return row


def test_a_row_bins_every_kind_of_value_as_the_graph_does():
    tiny = float(np.finfo(np.float32).smallest_subnormal)
    values = np.array([0.0, -0.0, tiny, -3 * tiny, 2.0**-127, 2.0**-126, 1.5, -448.5, 65520.0,
                       3e38, np.inf, -np.inf, np.nan, 1e-3], np.float32)
    top, bottom, row = row_of(values)
    assert (top, bottom) == (np.inf, -np.inf)
    assert row.tolist() == _expected_row(values).tolist()
    # Zeros alone are counted without the subnormals' path; with one subnormal, both.
    for few in ([0.0, -0.0, 2.0], [0.0, -0.0, 7 * tiny, 2.0]):
        assert row_of(np.array(few, np.float32))[2].tolist() == _expected_row(
            np.array(few, np.float32)).tolist()
    # NaN ignored by max and min; only NaN: -Inf and Inf, as the graph's NaN-aware reductions.
    assert row_of(np.array([np.nan, 2.0, -1.0], np.float32))[:2] == (2.0, -1.0)
    assert row_of(np.array([np.nan], np.float32))[:2] == (-np.inf, np.inf)


def _convs() -> tuple[Model, list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(0)
    proto = onnx.parser.parse_model(CONVS)
    proto.graph.initializer.append(onnx.numpy_helper.from_array(
        rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"))
    feeds = [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32) * s} for s in (1, 5, 30)]
    return Model(proto, "", "convs"), feeds


def test_fetched_tensors_measure_as_the_whole_in_graph_calibration(monkeypatch):
    model, feeds = _convs()
    every = calibrate(model, feeds, detail="all")

    def no_graph(*args: object, **kwargs: object) -> None:
        raise AssertionError("instrumented a fetchable pass")

    monkeypatch.setattr(calibrate_run, "instrument", no_graph)
    few = calibrate(model, feeds, detail="all", tensors=["x", "y", "tiny", "big"])
    assert set(few.tensors) == {"x", "y", "tiny", "big"}
    for name, got in few.tensors.items():
        assert got.to_dict() == every.tensors[name].to_dict(), name
    # The subnormals and the values past FP8's max were there to be binned.
    assert few.tensors["tiny"].under["fp32"] > 0 and few.tensors["big"].over["fp8_e4m3"] > 0


def test_a_body_tensor_or_another_detail_is_measured_in_the_graph():
    proto = onnx.parser.parse_model(BRANCHED)
    assert fetchable(proto, ["out", "x"]) is not None
    assert fetchable(proto, ["inner"]) is None and fetchable(proto, ["flag"]) is None
    feeds = [{"x": np.array([1, -2, 3, 0], np.float32), "flag": np.array(True)}]
    stats = calibrate(Model(proto, "", "branched"), feeds, detail="all", tensors=["inner"])
    assert stats.tensors["inner"].absmax == 6.0 and stats.tensors["inner"].zero_count == 1
    model, convs = _convs()
    auto = calibrate(model, convs, detail="auto", tensors=["y"])
    assert auto.detail == "auto" and auto.tensors["y"].count == 3 * 4 * 64


@pytest.mark.parametrize("streams", [1, 2])
def test_samples_in_streams_fold_in_sample_order(streams):
    model, feeds = _convs()
    got = calibrate(model, feeds, detail="all", tensors=["y"], streams=streams).tensors["y"]
    alone = [calibrate(model, [f], detail="all", tensors=["y"]).tensors["y"].absmax for f in feeds]
    assert got.per_sample_absmax == tuple(alone) and len(set(alone)) == len(feeds)


def _files(tmp_path: Path, feeds: list[dict[str, np.ndarray]], proto: onnx.ModelProto) -> SampleSet:
    for i, feed in enumerate(feeds):
        np.savez(tmp_path / f"s{i}.npz", **feed)
    return load_samples(tmp_path, proto)


def _fetched_as_in_the_graph(model: Model, samples, monkeypatch):
    """A whole calibration with every rule's detail, fetched (no instrumented graph built),
    checked equal to the in-graph one (FETCH_BYTES 0); the fetched statistics."""
    monkeypatch.setattr(fetched, "FETCH_BYTES", 0)
    graph = calibrate(model, samples, detail="all")
    monkeypatch.undo()
    instrumented = []
    monkeypatch.setattr(calibrate_run, "instrument", lambda *a, **k: instrumented.append(1))
    got = calibrate(model, samples, detail="all")
    assert not instrumented and got.to_dict() == graph.to_dict()
    return got


def test_a_whole_calibration_from_files_is_fetched_where_it_fits(tmp_path, monkeypatch):
    model, feeds = _convs()
    samples = _files(tmp_path, feeds, model.proto)
    got = _fetched_as_in_the_graph(model, samples, monkeypatch)
    assert set(got.tensors) == {"x", "y", "r", "tiny", "big"}


def test_a_whole_calibration_past_its_memory_or_with_a_body_runs_in_the_graph(tmp_path, monkeypatch):
    model, feeds = _convs()
    size = 4 * 8 * 8 * (3 + 4 + 4)  # x, y and r of one sample (tiny and big are outputs)
    assert fetched.fits(model.proto, ["x", "y", "r", "tiny", "big"], feeds[0], 2)
    monkeypatch.setattr(fetched, "FETCH_BYTES", 2 * size - 1)
    assert not fetched.fits(model.proto, ["x", "y", "r", "tiny", "big"], feeds[0], 2)
    assert fetched.fits(model.proto, ["x", "y", "r", "tiny", "big"], feeds[0], 1)
    assert fetchable(onnx.parser.parse_model(BRANCHED), None) is None
    assert fetchable(model.proto, None) == {"x": "", "y": "node_of_y", "r": "node_of_r",
                                            "tiny": "node_of_tiny", "big": "node_of_big"}


def test_a_bin_past_two_to_the_24_counts_exactly_at_an_old_opset():
    # x -> Relu -> y at opset 13, where the in-graph bins are counted by TfIdfVectorizer in
    # float32 (exact up to 2^24 a bin): fetched, 2^24 + 1000 zeros count as they are.
    proto = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 13]>
        g (float[N] x) => (float[N] y) { y = Relu(x) }""")
    x = np.zeros(2**24 + 1500, np.float32)
    x[:500] = 1.0
    got = calibrate(Model(proto, "", "relu"), [{"x": x}], detail="all", tensors=["y"]).tensors["y"]
    assert (got.zero_count, got.exp_hist, got.count) == (2**24 + 1000, {0: 500}, x.size)


def test_a_bin_past_two_to_the_24_counts_exactly_in_the_graph_too(monkeypatch):
    # x -> Relu -> y at opset 13 in the graph (nothing fetched): TfIdfVectorizer counts rows of
    # at most 2^23 indices apart, so 2^24 + 1301 zeros count as they are (odd: float32 cannot
    # hold it); an empty sample counts nothing.
    monkeypatch.setattr(fetched, "FETCH_BYTES", 0)
    proto = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 13]>
        g (float[N] x) => (float[N] y) { y = Relu(x) }""")
    x = np.zeros(2**24 + 1501, np.float32)
    x[:500] = -3.0
    x[500:700] = 2.0**-140
    samples = [{"x": x}, {"x": np.zeros(0, np.float32)}]
    got = calibrate(Model(proto, "", "relu"), samples, detail="all").tensors
    assert (got["y"].zero_count, got["y"].count) == (2**24 + 1301, x.size)
    assert sum(got["y"].exp_hist.values()) == 200
    assert (got["x"].zero_count, sum(got["x"].exp_hist.values())) == (2**24 + 801, 700)
    # Values under the ordinary range get the lean detail, one count in every sample: a bin
    # it stopped at 2^24 flags the sample, and the full detail counts it.
    tiny = [{"x": np.full(2**24 + 1301, 1e-5, np.float32)}]
    for detail in ("auto", "fp16"):
        got = calibrate(Model(proto, "", "relu"), tiny, detail=detail).tensors["y"]
        assert sum(got.exp_hist.values()) == got.count == 2**24 + 1301


# x -> Conv(w) -> y -> Relu -> r -> Reshape(r, s) -> out, s a graph input: shape inference
# cannot size `out` (as ppocr_rec's softmax output); with `mid` = Reshape(r, s) read by a Neg,
# an unsized tensor that is not an output.
RESHAPED = """
<ir_version: 8, opset_import: ["" : 18]>
flat (float[1,3,8,8] x, int64[2] s) => (float[a,b] out) {
    y = Conv<pads = [1, 1, 1, 1]>(x, w)
    r = Relu(y)
    out = Reshape(r, s)
}
"""


def _reshaped(body: str) -> tuple[Model, list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(1)
    proto = onnx.parser.parse_model(body)
    proto.graph.initializer.append(onnx.numpy_helper.from_array(
        rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"))
    feeds = [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32) * k,
              "s": np.array([4, 64], np.int64)} for k in (1, 7)]
    return Model(proto, "", "reshaped"), feeds


def test_an_unsized_graph_output_is_fetched_and_not_counted(tmp_path, monkeypatch):
    model, feeds = _reshaped(RESHAPED)
    samples = _files(tmp_path, feeds, model.proto)
    every = ["out", "r", "x", "y"]
    assert fetched.fits(model.proto, every, feeds[0], 1)
    # x, y and r of one sample are the bytes held: `out` is returned by plain inference too.
    size = 4 * 8 * 8 * (3 + 4 + 4)
    monkeypatch.setattr(fetched, "FETCH_BYTES", size)
    assert fetched.fits(model.proto, every, feeds[0], 1)
    monkeypatch.setattr(fetched, "FETCH_BYTES", size - 1)
    assert not fetched.fits(model.proto, every, feeds[0], 1)
    assert set(_fetched_as_in_the_graph(model, samples, monkeypatch).tensors) == set(every)


def test_an_unsized_tensor_inside_the_graph_keeps_the_calibration_in_the_graph():
    inner = RESHAPED.replace("(float[a,b] out)", "(float[a,b] neg)").replace(
        "out = Reshape(r, s)", "out = Reshape(r, s)\n    neg = Neg(out)")
    model, feeds = _reshaped(inner)
    assert not fetched.fits(model.proto, ["neg", "out", "r", "x", "y"], feeds[0], 1)
