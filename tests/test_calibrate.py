"""Calibration statistics are exact: every field against numpy on the same samples."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest

import npuprep.runtime.session as runtime_session
from npuprep.calibrate import calibrate, load_stats, save_stats
from npuprep.calibrate.instrument import instrument
from npuprep.calibrate.layout import HI, LO
from npuprep.data import load_samples, synthetic_samples
from npuprep.errors import NpuprepError
from npuprep.graph import float_tensor_names
from npuprep.model_io import load_model
from npuprep.runtime.session import make_session, run
from tests.conftest import save_matmul_eye

# x -> Mul(x, 4096) -> big;  x -> Mul(x, 1e-39) -> tiny (subnormal);  x -> Sqrt -> root (NaN
# for x < 0) -> Mul(root, 4096) -> bigroot (NaN and values above fp8's max);  x -> Reciprocal
# -> inv (Inf at 0);  x -> Mul(x, 0.01) -> small;  x -> Reshape -> flat
SPECIAL = """
<ir_version: 8, opset_import: ["" : 18]>
special (float[4,16] x) => (float[4,16] big, float[4,16] tiny, float[4,16] root, float[4,16] inv, float[4,16] small, float[64] flat, float[4,16] bigroot) {
    c_big = Constant<value = float {4096.0}>()
    big = Mul(x, c_big)
    c_tiny = Constant<value = float {1e-39}>()
    tiny = Mul(x, c_tiny)
    root = Sqrt(x)
    bigroot = Mul(root, c_big)
    inv = Reciprocal(x)
    c_small = Constant<value = float {0.01}>()
    small = Mul(x, c_small)
    shape = Constant<value = int64[1] {64}>()
    flat = Reshape(x, shape)
}
"""


def special_inputs(seed: int) -> np.ndarray:
    """Values on and next to bin edges and format limits, zeros, negatives, and noise."""
    rng = np.random.default_rng(seed)
    edges = [0.0, -0.0, 1.0, -1.0, 2.0, 0.5, 16.0, 15.995, 15.999999, 16.000002, 0.109375, 0.125,
             np.nextafter(np.float32(0.125), np.float32(0)), 100.0, -3.0, 1e-3, 7.0e-5, 2.0**-14]
    x = rng.standard_normal(64).astype(np.float32) * 4
    x[: len(edges)] = np.array(edges, np.float32) * (1 if seed % 2 == 0 else -1)
    return x.reshape(4, 16)


def write_samples(tmp_path, arrays: list[np.ndarray]) -> str:
    folder = tmp_path / "data"
    folder.mkdir()
    for i, a in enumerate(arrays):
        np.savez(folder / f"s{i:03d}.npz", x=a)
    return str(folder)


def reference(proto: onnx.ModelProto, samples) -> dict[str, np.ndarray]:
    """Every float tensor of every sample, marked as outputs and run in onnxruntime with every
    optimisation, as calibration runs it (a Conv in NCHWc rounds differently from one in NCHW)."""
    marked = onnx.ModelProto()
    marked.CopyFrom(proto)
    names = float_tensor_names(proto)
    del marked.graph.output[:]
    marked.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    session = make_session(marked, optimize="all")
    values: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for feed in samples:
        out = run(session, feed, names)
        for n in names:
            values[n].append(out[n].astype(np.float32).ravel())
    return {n: np.concatenate(v) for n, v in values.items()}


def numpy_hist(x: np.ndarray) -> dict[int, int]:
    a = np.abs(x[np.isfinite(x) & (x != 0)]).astype(np.float64)
    exps, counts = np.unique(np.frexp(a)[1] - 1, return_counts=True)
    return {int(e): int(c) for e, c in zip(exps, counts, strict=True)}


@pytest.fixture
def special(tmp_path, save):
    path = save(SPECIAL)
    model = load_model(path)
    samples = load_samples(write_samples(tmp_path, [special_inputs(s) for s in range(3)]), model.proto)
    return model, samples


def test_every_statistic_matches_numpy_with_full_detail(special):
    model, samples = special
    stats = calibrate(model, samples, detail="all")
    ref = reference(model.proto, samples)
    assert set(ref) <= set(stats.tensors)
    for name, x in ref.items():
        s = stats.tensors[name]
        a = np.abs(x)
        finite = x[~np.isnan(x)]
        assert s.count == x.size and s.detailed_count == x.size, name
        assert s.min == float(finite.min()) and s.max == float(finite.max()), name
        assert s.absmax == float(np.abs(finite).max()), name
        assert s.nan_count == int(np.isnan(x).sum()), name
        assert s.inf_count == int(np.isinf(x).sum()), name
        assert s.zero_count == int((x == 0).sum()), name
        assert s.exp_hist == numpy_hist(x), name
        for fmt, limit in (("fp16", 65504.0), ("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)):
            assert s.over[fmt] == int((a > limit).sum()), (name, fmt)
        nonzero = a[(a > 0) & np.isfinite(a)]
        assert s.under["fp16"] == int((nonzero < 2.0**-14).sum()), name
        assert s.under["fp32"] == int((nonzero < np.finfo(np.float32).tiny).sum()), name
        per_sample = [float(np.nanmax(np.abs(c))) for c in np.split(x, 3)]
        assert s.per_sample_absmax == tuple(per_sample), name
    # The graph really produced every special case the test is about.
    assert stats.tensors["root"].nan_count > 0
    assert stats.tensors["inv"].inf_count > 0
    assert stats.tensors["tiny"].under["fp32"] > 0
    assert stats.tensors["big"].over["fp16"] > 0 and stats.tensors["big"].over["fp16"] < stats.tensors["big"].count
    assert stats.tensors["bigroot"].nan_count > 0 and stats.tensors["bigroot"].over["fp8_e4m3"] > 0


def test_auto_detail_is_exact_where_it_runs_and_counts_stay_exact(special):
    model, samples = special
    full = calibrate(model, samples, detail="all")
    auto = calibrate(model, samples, detail="auto")
    for name, f in full.tensors.items():
        a = auto.tensors[name]
        for key in ("min", "max", "absmax", "count", "nan_count", "inf_count", "over", "per_sample_absmax"):
            assert getattr(a, key) == getattr(f, key), (name, key)
        if a.complete:
            assert (a.zero_count, a.exp_hist, a.under) == (f.zero_count, f.exp_hist, f.under), name
        else:
            # Skipped only where every sample was ordinary: finite, LO <= abs-max <= HI.
            assert all(LO <= v <= HI for v in f.per_sample_absmax), name
    # x itself (abs-max 100 > HI) is detailed; small (abs-max 1 on some samples) need not be.
    assert auto.tensors["x"].complete and auto.tensors["root"].complete


@pytest.mark.parametrize("detail", ["all", "auto"])
def test_a_few_tensors_measure_as_they_do_among_all(special, detail):
    # flat repeats x and bigroot's input root may be NaN: observed without x and root, each
    # gets its own reductions, and every field is what the whole calibration gives it.
    model, samples = special
    every = calibrate(model, samples, detail=detail)
    few = calibrate(model, samples, detail=detail, tensors=["flat", "bigroot", "small"])
    assert set(few.tensors) == {"flat", "bigroot", "small"}
    for name, got in few.tensors.items():
        assert got.to_dict() == every.tensors[name].to_dict(), name


def test_aliases_share_their_sources_statistics(special):
    model, samples = special
    stats = calibrate(model, samples, detail="all")
    inst = instrument(model.proto)
    assert inst.alias_of == {"flat": "x"}
    flat, x = stats.tensors["flat"].to_dict(), stats.tensors["x"].to_dict()
    assert flat.pop("node") != x.pop("node") and flat.pop("tensor") == "flat"
    x.pop("tensor")
    assert flat == x


def test_streaming_merge_equals_one_shot_and_jobs_agree(tmp_path, save):
    # x -> Mul(x, x) -> sq -> Sub(sq, x) -> y
    model = load_model(save("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[8,8] x) => (float[8,8] y) { sq = Mul(x, x)  y = Sub(sq, x) }
    """))
    rng = np.random.default_rng(1)
    arrays = [(rng.standard_normal((8, 8)) * 10 ** rng.uniform(-3, 3)).astype(np.float32) for _ in range(6)]
    folder = write_samples(tmp_path, arrays)
    streamed = calibrate(model, load_samples(folder, model.proto), detail="all")
    # One shot: numpy over all samples at once.
    everything = np.concatenate([(a * a).ravel() for a in arrays])
    sq = streamed.tensors["sq"]
    assert sq.exp_hist == numpy_hist(everything)
    assert (sq.max, sq.min, sq.count) == (float(everything.max()), float(everything.min()), everything.size)
    assert sq.per_sample_absmax == tuple(float(np.abs(a * a).max()) for a in arrays)
    parallel = calibrate(model, load_samples(folder, model.proto), jobs=2, detail="all")
    assert parallel.to_dict() == streamed.to_dict()
    auto1 = calibrate(model, load_samples(folder, model.proto))
    auto3 = calibrate(model, load_samples(folder, model.proto), jobs=3)
    assert auto1.to_dict() == auto3.to_dict()


def test_fractions_read_from_exact_counts_and_histogram(special):
    model, samples = special
    s = calibrate(model, samples, detail="all").tensors["big"]
    ref = np.abs(reference(model.proto, samples)["big"])
    assert s.fraction_above(65504.0) == (ref > 65504).sum() / ref.size
    assert s.fraction_above(1e30) == 0.0
    # 2^16 is a bin edge: values in [2^16, 2^17) are all above it.
    assert s.fraction_above(2.0**16) >= (ref > 2**16).sum() / ref.size
    nonzero = ref[ref > 0]
    assert s.fraction_below(2.0**-14) == (nonzero < 2.0**-14).sum() / ref.size
    assert s.fraction_below(1.0) == (nonzero < 1.0).sum() / ref.size


def test_stats_round_trip_and_refuse_another_model(special, tmp_path, save):
    model, samples = special
    stats = calibrate(model, samples)
    path = save_stats(stats, tmp_path / "stats.json")
    loaded = load_stats(path, model)
    assert loaded.to_dict() == stats.to_dict()
    assert path.read_text() == save_stats(loaded, tmp_path / "again.json").read_text()
    other = load_model(save("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[4,16] x) => (float[4,16] y) { y = Relu(x) }
    """, "other.onnx"))
    with pytest.raises(NpuprepError, match="another model"):
        load_stats(path, other)


# x -> If(c, then: Mul(x, 3) -> t, else: Neg(x) -> e) -> r;  Loop 3 times: acc -> Add(acc, x) -> acc
SUBGRAPHS = """
<ir_version: 8, opset_import: ["" : 18]>
sub (float[5] x, bool c) => (float[5] r, float[5] acc_out) {
    r = If(c) <
        then_branch = thenb () => (float[5] t) { three = Constant<value = float {3.0}>()  t = Mul(x, three) },
        else_branch = elseb () => (float[5] e) { e = Neg(x) }
    >
    n = Constant<value = int64 {3}>()
    go = Constant<value = bool {1}>()
    acc_out = Loop(n, go, x) <
        body = loopb (int64 i, bool cin, float[5] acc) => (bool cout, float[5] acc2) {
            cout = Identity(cin)
            acc2 = Add(acc, x)
        }
    >
}
"""


def subgraph_samples(tmp_path, save):
    """SUBGRAPHS with two samples, one through each branch; and x."""
    model = load_model(save(SUBGRAPHS))
    x = np.array([1.0, -2.0, 0.0, 300.0, 0.25], np.float32)
    folder = tmp_path / "d"
    folder.mkdir()
    np.savez(folder / "a.npz", x=x, c=np.array(True))
    np.savez(folder / "b.npz", x=x * 2, c=np.array(False))
    return model, load_samples(str(folder), model.proto), x


def test_if_and_loop_body_tensors_are_observed(tmp_path, save):
    model, samples, x = subgraph_samples(tmp_path, save)
    stats = calibrate(model, samples, detail="all")
    assert stats.unobserved == {}
    t, e = stats.tensors["t"], stats.tensors["e"]
    assert t.scope.endswith(".then_branch") and e.scope.endswith(".else_branch")
    assert (t.count, t.max, t.min) == (5, 900.0, -6.0)
    assert (e.count, e.max, e.min) == (5, 4.0, -600.0)
    assert t.per_sample_absmax == (900.0,) and e.per_sample_absmax == (600.0,)
    acc2 = stats.tensors["acc2"]
    # Iterations give x*2, x*3, x*4 (sample a) and 2x*2.. 2x*4 (sample b).
    values = np.concatenate([x * k for k in (2, 3, 4)] + [2 * x * k for k in (2, 3, 4)])
    assert acc2.count == values.size and acc2.max == values.max() and acc2.min == values.min()
    assert acc2.exp_hist == numpy_hist(values) and acc2.zero_count == 6
    assert acc2.per_sample_absmax == (1200.0, 2400.0)


def test_body_tensors_get_the_detail_on_demand_like_the_main_graph(tmp_path, save):
    # SUBGRAPHS again: every tensor-sample is above the ordinary range, so auto details all
    model, samples, _ = subgraph_samples(tmp_path, save)
    auto, full = calibrate(model, samples), calibrate(model, samples, detail="all")
    assert {k: v.to_dict() for k, v in auto.tensors.items()} == {k: v.to_dict() for k, v in full.tensors.items()}
    assert auto.tensors["acc2"].exp_hist and auto.tensors["t"].exp_hist


def test_body_tensors_below_the_range_get_the_lean_detail_with_the_same_statistics(tmp_path, save, opened_lean):
    # SUBGRAPHS with small values and no zero: t (run by sample 0) takes the lean detail
    model = load_model(save(SUBGRAPHS))
    x = np.array([0.01, -0.02, 0.03, 0.004, 0.025], np.float32)
    folder = tmp_path / "d"
    folder.mkdir()
    for i, (scale, c) in enumerate(((1.0, True), (0.5, False), (0.25, True))):
        np.savez(folder / f"s{i}.npz", x=x * np.float32(scale), c=np.array(c))
    samples = load_samples(str(folder), model.proto)
    auto, full = calibrate(model, samples), calibrate(model, samples, detail="all")
    assert "t" in opened_lean[1]
    assert {k: v.to_dict() for k, v in auto.tensors.items()} == {k: v.to_dict() for k, v in full.tensors.items()}


# x -> Scan(body: s -> Add(s, row) -> s2, scan out Mul(row, row) -> sq)
SCAN = """
<ir_version: 8, opset_import: ["" : 18]>
sc (float[3,4] x, float[4] s0) => (float[4] s_out, float[3,4] sq_out) {
    s_out, sq_out = Scan(s0, x) <
        num_scan_inputs = 1,
        body = scanb (float[4] s, float[4] row) => (float[4] s2, float[4] sq) {
            s2 = Add(s, row)
            sq = Mul(row, row)
        }
    >
}
"""


def test_scan_body_tensors_are_observed(tmp_path, save):
    model = load_model(save(SCAN))
    x = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    np.savez(tmp_path / "a.npz", x=x, s0=np.ones(4, np.float32))
    stats = calibrate(model, load_samples(str(tmp_path / "a.npz"), model.proto), detail="all")
    sq = stats.tensors["sq"]
    assert sq.count == 12 and sq.max == 36.0 and sq.min == 0.0 and sq.zero_count == 1
    assert sq.exp_hist == numpy_hist((x * x).ravel())
    s2 = stats.tensors["s2"]
    cums = np.cumsum(np.vstack([np.ones(4, np.float32), x]), axis=0)[1:]
    assert s2.max == cums.max() and s2.min == cums.min() and s2.count == 12


def test_untyped_tensors_are_listed_not_skipped(tmp_path, save):
    # x -> CustomOp (unknown domain, no type) -> y -> Relu -> z
    proto = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Mystery", ["x"], ["y"], domain="example.custom")],
            "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        ),
        opset_imports=[onnx.helper.make_opsetid("", 18), onnx.helper.make_opsetid("example.custom", 1)],
    )
    del proto.graph.output[:]
    proto.graph.output.append(onnx.helper.make_empty_tensor_value_info("y"))
    inst = instrument(proto)
    assert "y" in inst.unobserved and "type unknown" in inst.unobserved["y"]
    assert [s.tensor for s in inst.slots] == ["x"]


def test_fp16_tensors_are_observed_exactly(tmp_path, save):
    # x -> Cast(fp16) -> h -> Mul(h, h) -> hh -> Cast(fp32) -> y
    model = load_model(save("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[6] x) => (float[6] y) { h = Cast<to = 10>(x)  hh = Mul(h, h)  y = Cast<to = 1>(hh) }
    """))
    # Products exact in FP16: onnxruntime's CPU computes FP16 Mul in FP32 and drops the
    # rounding (DESIGN.md), so only exact values make a fair test.
    x = np.array([0.0, 1.0, 200.0, -128.0, 0.5, 3.0], np.float32)
    np.savez(tmp_path / "a.npz", x=x)
    stats = calibrate(model, load_samples(str(tmp_path / "a.npz"), model.proto), detail="all")
    hh = (x.astype(np.float16) * x.astype(np.float16)).astype(np.float32)
    assert stats.tensors["hh"].max == float(hh.max()) and stats.tensors["hh"].zero_count == 1
    assert stats.tensors["hh"].exp_hist == numpy_hist(hh)
    assert stats.tensors["y"].to_dict()["exp_hist"] == stats.tensors["hh"].to_dict()["exp_hist"]


def test_external_data_models_are_calibrated_from_disk(tmp_path, save):
    # x -> MatMul(x, W) -> y, with W stored as external data
    inline, external = save_matmul_eye(save, tmp_path, 3)
    folder = external.parent
    np.savez(tmp_path / "a.npz", x=np.arange(128, dtype=np.float32).reshape(2, 64))
    ext_model, inline_model = load_model(external), load_model(inline)
    ext = calibrate(ext_model, load_samples(str(tmp_path / "a.npz"), ext_model.proto), detail="all")
    ref = calibrate(inline_model, load_samples(str(tmp_path / "a.npz"), inline_model.proto), detail="all")
    assert ext.tensors["y"].to_dict() == ref.tensors["y"].to_dict() and ext.tensors["y"].max == 127 * 3
    assert sorted(p.name for p in folder.iterdir()) == ["m.data", "m.onnx"]


def test_histogram_is_exact_at_every_power_of_two(tmp_path, save):
    # x -> Neg -> y ; values on and next to every power of two, normal and subnormal
    model = load_model(save("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N] x) => (float[N] y) { y = Neg(x) }
    """))
    powers = np.ldexp(np.float32(1), np.arange(-149, 128)).astype(np.float32)
    around = np.concatenate([powers, np.nextafter(powers, np.float32(0)), np.nextafter(powers, np.float32(np.inf))])
    normal = around[np.isfinite(around) & (around >= np.finfo(np.float32).tiny)]
    folder = tmp_path / "d"
    folder.mkdir()
    np.savez(folder / "a_normal.npz", x=np.concatenate([normal, -normal, [0.0, 0.0]]).astype(np.float32))
    np.savez(folder / "b_all.npz", x=np.concatenate([around[np.isfinite(around)], [0.0]]).astype(np.float32))
    np.savez(folder / "c_no_zero.npz", x=np.concatenate([normal[::-1], -normal]).astype(np.float32))
    samples = load_samples(str(folder), model.proto)
    stats = calibrate(model, samples, detail="all")
    values = np.concatenate([f["x"] for f in samples])
    y = stats.tensors["y"]
    assert y.exp_hist == numpy_hist(values) and y.zero_count == int((values == 0).sum())
    assert y.under["fp32"] == int(((np.abs(values) < np.finfo(np.float32).tiny) & (values != 0)).sum())


def test_opset_13_counts_without_scatter_reduction(tmp_path, save):
    # x -> Mul(x, x) -> sq (opset 13: no ScatterElements reduction; TfIdfVectorizer counts)
    text = """
        <ir_version: 7, opset_import: ["" : {opset}]>
        g (float[3,5] x) => (float[3,5] sq) {{ sq = Mul(x, x) }}
    """
    old = load_model(save(text.format(opset=13), "old.onnx"))
    new = load_model(save(text.format(opset=18), "new.onnx"))
    x = np.array([[0, 1, 2, 3, 300], [0.5, 0.25, 1e-3, 7, 256], [-1, -2, 0, 1e-20, 4]], np.float32)
    np.savez(tmp_path / "a.npz", x=x)
    a = calibrate(old, load_samples(str(tmp_path / "a.npz"), old.proto), detail="all").tensors["sq"]
    b = calibrate(new, load_samples(str(tmp_path / "a.npz"), new.proto), detail="all").tensors["sq"]
    assert a.to_dict() == b.to_dict()
    assert a.exp_hist == numpy_hist((x * x).ravel()) and a.over["fp16"] == 2


def test_empty_tensors_and_integer_graphs(tmp_path, save):
    # x -> Slice(2:2) -> y (empty) ;  x -> ReduceSum -> z
    model = load_model(save("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[4] x) => (float[0] y, float z) {
            s = Constant<value = int64[1] {2}>()
            y = Slice(x, s, s)
            z = ReduceSum(x)
        }
    """))
    np.savez(tmp_path / "a.npz", x=np.arange(4, dtype=np.float32))
    for detail in ("auto", "all"):
        stats = calibrate(model, load_samples(str(tmp_path / "a.npz"), model.proto), detail=detail)
        y = stats.tensors["y"]
        assert y.count == 0 and math.isnan(y.absmax) and y.per_sample_absmax == ()
        assert stats.tensors["z"].max == 6.0
    # x -> Neg -> y, int64 only: nothing to observe, nothing unobserved
    ints = load_model(save("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (int64[4] x) => (int64[4] y) { y = Neg(x) }
    """, "ints.onnx"))
    np.savez(tmp_path / "b.npz", x=np.arange(4))
    stats = calibrate(ints, load_samples(str(tmp_path / "b.npz"), ints.proto))
    assert stats.tensors == {} and stats.unobserved == {}


def conv_model(inf_weight: bool) -> onnx.ModelProto:
    """x [1,3,8,8] -> Conv(W) -> y -> Relu -> r -> Conv(V) -> z (4-D, kept in NCHWc by onnxruntime)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 3, 3, 3)).astype(np.float32)
    if inf_weight:
        w[2, 1, 1, 1] = np.inf  # Inf x 0 = NaN wherever the input is 0
    v = rng.standard_normal((4, 5, 1, 1)).astype(np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
         onnx.helper.make_node("Relu", ["y"], ["r"]),
         onnx.helper.make_node("Conv", ["r", "v"], ["z"])],
        "conv", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8])],
        [onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [1, 4, 8, 8])],
        [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(v, "v")],
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])


@pytest.mark.parametrize("inf_weight", [False, True])
def test_channel_pooled_statistics_of_conv_activations_are_exact(tmp_path, save, inf_weight):
    # conv_model: its 4-D activations are reduced through global pools, not ReduceMax
    model = load_model(save(conv_model(inf_weight)))
    inst = instrument(model.proto, detailed=(), nan_checked=())
    # y and z: max and -min through pools; r = Relu(y) takes Relu of y's max and min
    assert sum(n.op_type == "GlobalMaxPool" for n in inst.model.graph.node) == 4
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal((1, 3, 8, 8)).astype(np.float32) * s for s in (1.0, 0.05, 300.0)]
    arrays[1][0, 1, 4, 4] = 0.0
    samples = load_samples(write_samples(tmp_path, arrays), model.proto)
    auto, full = calibrate(model, samples), calibrate(model, samples, detail="all")
    ref = reference(model.proto, samples)
    for name in ("y", "r", "z"):
        x = ref[name]
        finite = x[~np.isnan(x)]
        for s in (auto.tensors[name], full.tensors[name]):
            assert (s.min, s.max, s.count) == (float(finite.min()), float(finite.max()), x.size), name
            assert s.nan_count == int(np.isnan(x).sum()), name
        assert full.tensors[name].exp_hist == numpy_hist(x), name
    assert (auto.tensors["y"].nan_count > 0) == inf_weight


def conv_bn_model(negative_scales: bool, negative_variance: bool) -> onnx.ModelProto:
    """x [1,3,16,16] -> (Conv -> y_i -> BatchNormalization -> b_i -> Relu -> r_i) x 2, 32 channels
    (the second BatchNormalization with a variance < 0 when asked)."""
    rng = np.random.default_rng(0)
    nodes, inits, x, cin = [], [], "x", 3
    for i in range(2):
        w = rng.standard_normal((32, cin, 3, 3)) * np.sqrt(2 / (cin * 9))
        scale = rng.uniform(0.5, 1.5, 32) * (np.where(np.arange(32) % 3 == 0, -1, 1) if negative_scales else 1)
        var = rng.uniform(0.5, 2, 32)
        if negative_variance and i == 1:
            var[1] = -5.0  # sqrt(var + eps) is NaN in that channel whatever the input
        params = [scale, rng.standard_normal(32) * 0.1, rng.standard_normal(32) * 0.1, var]
        names = [f"w{i}"] + [f"bn{i}_{k}" for k in range(4)]
        inits += [onnx.numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in zip(names, [w, *params], strict=True)]
        nodes += [onnx.helper.make_node("Conv", [x, f"w{i}"], [f"y{i}"], pads=[1, 1, 1, 1]),
                  onnx.helper.make_node("BatchNormalization", [f"y{i}", *names[1:]], [f"b{i}"]),
                  onnx.helper.make_node("Relu", [f"b{i}"], [f"r{i}"])]
        x, cin = f"r{i}", 32
    graph = onnx.helper.make_graph(
        nodes, "conv_bn", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 16, 16])],
        [onnx.helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, [1, 32, 16, 16])], inits)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])


@pytest.mark.parametrize(("negative_scales", "negative_variance"), [(False, False), (True, False), (False, True)])
def test_batchnorm_of_a_pooled_activation_takes_its_range_from_the_pools_exactly(
        tmp_path, save, negative_scales, negative_variance):
    # conv_bn_model: b_i's max and min come from y_i's per-channel pools through the same
    # BatchNormalization (no pass over b_i) unless a variance < 0 can make NaN out of finite y_i.
    model = load_model(save(conv_bn_model(negative_scales, negative_variance)))
    inst = instrument(model.proto, detailed=(), nan_checked=())
    readers_of_b = sorted(n.op_type for n in inst.model.graph.node if "b1" in n.input)
    assert readers_of_b == (["GlobalAveragePool", "GlobalMaxPool", "Mul", "Relu"] if negative_variance else ["Relu"])
    samples = synthetic_samples(model.proto, 4)
    stats = calibrate(model, samples)
    ref = reference(model.proto, samples)
    for name in ("y0", "b0", "r0", "y1", "b1", "r1"):
        x = ref[name]
        finite = x[~np.isnan(x)]
        s = stats.tensors[name]
        assert (s.min, s.max, s.count) == (float(finite.min()), float(finite.max()), x.size), name
        assert s.nan_count == int(np.isnan(x).sum()), name
        per_sample = [float(np.nanmax(np.abs(c))) for c in np.split(x, 4)]
        assert s.per_sample_absmax == tuple(per_sample), name
    assert (stats.tensors["b1"].nan_count > 0) == negative_variance


def test_pooled_reductions_run_right_after_their_conv_in_the_nchwc_layout(tmp_path, monkeypatch):
    # conv_bn_model: onnxruntime moves both Convs to NCHWc with new nodes; y0's pools must
    # still run before the second Conv, not after the whole model (activations would stay alive).
    model = conv_bn_model(False, False)
    inst = instrument(model, detailed=(), nan_checked=())
    real_options = runtime_session.session_options

    def profiled(**kwargs):  # noqa: ANN003, ANN202 - stands in for session_options
        opts = real_options(**kwargs)
        opts.enable_profiling = True
        opts.profile_file_prefix = str(tmp_path / "profile")
        return opts

    monkeypatch.setattr(runtime_session, "session_options", profiled)
    session = runtime_session.make_session_external(inst.model, threads=1, optimize="all")
    run(session, {"x": np.ones((1, 3, 16, 16), np.float32)}, inst.outputs)
    kernels = [e["name"].removesuffix("_kernel_time") for e in json.loads(Path(session.end_profiling()).read_text())
               if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    assert "y1_nchwc" in kernels  # the second Conv in the NCHWc layout (named after its output)
    first_pool = next(i for i, k in enumerate(kernels) if k.startswith("__npuprep_pooled"))
    assert first_pool < kernels.index("y1_nchwc")


@pytest.mark.parametrize("prepack", [True, False])
def test_a_session_without_prepacked_weights_asks_onnxruntime_for_none(prepack):
    # x -> MatMul(x, W) -> y: onnxruntime prepacks W unless told not to; the result is the same
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
        [onnx.numpy_helper.from_array(w, "w")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    session = runtime_session.make_session_external(model, threads=1, prepack=prepack)
    options = session.get_session_options()
    if prepack:
        with pytest.raises(RuntimeError, match="does not have configuration"):
            options.get_session_config_entry("session.disable_prepacking")
    else:
        assert options.get_session_config_entry("session.disable_prepacking") == "1"
    x = np.ones((2, 4), np.float32)
    assert np.array_equal(run(session, {"x": x})["y"], x @ w)


def test_fp16_scope_is_exact_for_fp16_and_bf16_and_details_less(special):
    # The same graph calibrated for FP16/BF16 only: x (abs-max 100, past "auto"'s ordinary
    # range, inside the fp16 scope's [2^-4, 2^14]) goes undetailed; big (4e5) keeps its detail.
    from npuprep.calibrate.layout import SCOPES

    model, samples = special
    full = calibrate(model, samples, detail="all")
    auto = calibrate(model, samples, detail="auto")
    fp16 = calibrate(model, samples, detail="fp16")
    scope = SCOPES["fp16"]
    limit = 0.5 * 65504.0  # the profiles' headroom limit
    assert fp16.detail == "fp16"
    for name, f in full.tensors.items():
        s = fp16.tensors[name]
        for key in ("min", "max", "absmax", "count", "nan_count", "inf_count", "per_sample_absmax"):
            assert getattr(s, key) == getattr(f, key), (name, key)
        assert s.over == {fmt: f.over[fmt] for fmt in ("fp16", "bf16")}, name
        assert s.fraction_above(limit) == f.fraction_above(limit), name
        if s.complete:
            assert (s.zero_count, s.exp_hist) == (f.zero_count, f.exp_hist), name
        else:
            assert all(scope.lo <= v <= scope.hi for v in f.per_sample_absmax), name
    assert auto.tensors["x"].complete and fp16.tensors["x"].detailed_count == 0
    assert fp16.tensors["big"].complete and fp16.tensors["big"].over["fp16"] > 0
    # Saved and read back: the scope's range travels with the stats.
    assert fp16.tensors["x"].ordinary_hi == scope.hi
    assert type(fp16.tensors["x"]).from_dict(fp16.tensors["x"].to_dict()) == fp16.tensors["x"]


def test_fp16_scoped_stats_are_refused_for_an_fp8_target(special):
    from npuprep.analyse.measured import measured_findings
    from npuprep.profiles import load_profile

    model, samples = special
    fp16 = calibrate(model, samples, detail="fp16")
    assert measured_findings(model, load_profile("a2000").resolve("fp16"), fp16) is not None
    with pytest.raises(NpuprepError, match="detail 'fp16'.*not fp8_e4m3"):
        measured_findings(model, load_profile("a2000").resolve("fp8_e4m3"), fp16)


# x -> Mul(x, x) -> sq -> Add(sq, 1e-10) -> fl -> Log -> y ;  x -> Mul(x, 300) -> big
POWER_LOG = """
<ir_version: 8, opset_import: ["" : 18]>
power_log (float[4,64] x) => (float[4,64] y, float[4,64] big) {
    sq = Mul(x, x)
    eps = Constant<value = float {1e-10}>()
    fl = Add(sq, eps)
    y = Log(fl)
    c = Constant<value = float {300.0}>()
    big = Mul(x, c)
}
"""


def test_fp16_scope_keeps_the_detail_of_a_power_spectrum_on_its_way_into_a_log(tmp_path, save):
    # A spectrum spanning 1e-14 .. 324: most of it under FP16's smallest normal, which the
    # Log magnifies; past 64 (and far past FP16's 2^-4 floor) the fp16 scope would call it
    # ordinary, so the chain into the Log keeps "auto"'s range. `big` (abs-max ~5e3) has no Log.
    from npuprep.calibrate.instrument import log_chains

    model = load_model(save(POWER_LOG))
    rng = np.random.default_rng(3)
    arrays = []
    for _ in range(3):
        x = (rng.uniform(1e-7, 1e-5, (4, 64)) * rng.choice([-1, 1], (4, 64))).astype(np.float32)
        x[0, :4] = rng.uniform(10, 18, 4)
        arrays.append(x)
    samples = load_samples(write_samples(tmp_path, arrays), model.proto)
    assert log_chains(model.proto.graph) == {"fl", "sq", "x"}
    full = calibrate(model, samples, detail="all")
    fp16 = calibrate(model, samples, detail="fp16")
    min_normal = 2.0**-14
    for name in ("sq", "fl"):
        assert fp16.tensors[name].complete and fp16.tensors[name].ordinary_hi == HI
        below = fp16.tensors[name].fraction_below(min_normal)
        assert below == full.tensors[name].fraction_below(min_normal) and below > 0.9
    assert fp16.tensors["big"].absmax > HI and fp16.tensors["big"].detailed_count == 0
