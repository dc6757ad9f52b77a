"""The L1 pass skipped behind NaN-safe ops: a tensor whose producer cannot make a NaN out of
finite inputs is proven NaN-free from its inputs' rows, and a sample where that proof fails
reruns with the L1 (and the detail) on it, so the counts stay exact."""

from __future__ import annotations

import numpy as np
import pytest

from npuprep.calibrate import calibrate
from npuprep.calibrate.instrument import instrument
from npuprep.data import load_samples
from npuprep.model_io import load_model
from tests.conftest import model_from_text

# x -> Sqrt -> s -> Add(s, 1) -> y -> Mul(y, 2) -> z;  x -> Relu -> r
MODEL = """
<ir_version: 8, opset_import: ["" : 18]>
g (float[4,16] x) => (float[4,16] z, float[4,16] r) {
    s = Sqrt(x)
    one = Constant<value = float {1.0}>()
    y = Add(s, one)
    two = Constant<value = float {2.0}>()
    z = Mul(y, two)
    r = Relu(x)
}
"""


def reference(x: np.ndarray) -> dict[str, np.ndarray]:
    with np.errstate(invalid="ignore"):
        s = np.sqrt(x)
    y = s + np.float32(1)
    return {"x": x, "s": s, "y": y, "z": y * np.float32(2), "r": np.maximum(x, 0)}


def write_samples(tmp_path, model, arrays):
    folder = tmp_path / "data"
    folder.mkdir()
    for i, a in enumerate(arrays):
        np.savez(folder / f"s{i:03d}.npz", x=a)
    return load_samples(folder, model.proto)


def test_safe_ops_skip_the_l1_pass_and_name_the_inputs_that_prove_them():
    model = model_from_text(MODEL)
    inst = instrument(model, detailed=(), nan_checked=())
    row = {slot.tensor: i for i, slot in enumerate(inst.slots)}
    assert inst.nan_inputs == {row["y"]: (row["s"],), row["z"]: (row["y"],), row["r"]: (row["x"],)}
    l1_inputs = [n.input[0] for n in inst.model.graph.node if n.op_type == "ReduceL1"]
    assert len(l1_inputs) == 2  # x (a graph input) and s (Sqrt can make NaN)
    full = instrument(model, detailed=(), nan_checked=None)
    assert full.nan_inputs == {}
    assert sum(n.op_type == "ReduceL1" for n in full.model.graph.node) == 5


def test_a_constant_that_is_not_finite_keeps_the_l1_pass():
    model = model_from_text(MODEL.replace("float {1.0}", "float {nan}"))
    inst = instrument(model, detailed=(), nan_checked=())
    row = {slot.tensor: i for i, slot in enumerate(inst.slots)}
    assert row["y"] not in inst.nan_inputs  # Add with a NaN constant: measured, not proven
    assert row["z"] in inst.nan_inputs


def test_finite_samples_need_no_rerun(tmp_path, save, opened_nan_checked):
    model = load_model(save(MODEL))
    rng = np.random.default_rng(1)
    arrays = [rng.uniform(0.2, 3.0, (4, 16)).astype(np.float32) for _ in range(3)]
    stats = calibrate(model, write_samples(tmp_path, model, arrays))
    assert opened_nan_checked == [frozenset(), frozenset()]  # the second only for prepacked weights
    for name in ("y", "z", "r"):
        want = np.concatenate([reference(a)[name].ravel() for a in arrays])
        got = stats.tensors[name]
        assert got.nan_count == 0 and got.inf_count == 0
        assert got.max == float(want.max()) and got.min == float(want.min())


def test_a_nan_upstream_reruns_with_the_l1_and_counts_exactly(tmp_path, save, opened_nan_checked):
    model = load_model(save(MODEL))
    rng = np.random.default_rng(2)
    arrays = [rng.uniform(0.2, 3.0, (4, 16)).astype(np.float32) for _ in range(3)]
    # Negative inputs make NaN in s, y and z; at position 1, where onnxruntime's ReduceMax
    # returns a wrong maximum instead of noticing the NaN.
    arrays[1][0, 1] = -1.0
    arrays[2][3, 7:9] = -4.0
    stats = calibrate(model, write_samples(tmp_path, model, arrays))
    assert {"y", "z"} <= opened_nan_checked[-1]
    assert "r" not in opened_nan_checked[-1]  # its input x stayed finite
    for name in ("s", "y", "z", "r"):
        want = np.concatenate([reference(a)[name].ravel() for a in arrays])
        got = stats.tensors[name]
        assert got.nan_count == int(np.isnan(want).sum()), name
        assert got.max == float(np.nanmax(want)) and got.min == float(np.nanmin(want)), name
        assert got.count == want.size
    assert stats.tensors["z"].nan_count == 3


# x -> Sqrt -> s;  s -> Relu -> a;  s -> Neg -> b;  s -> Sub(3, s) -> c;  s -> Mul(s, -2) -> d;
# d -> Add(d, 0.5) -> e;  e -> Mul(e, 1e38) -> f (overflows to -Inf)
MONOTONE = """
<ir_version: 8, opset_import: ["" : 18]>
g (float[4,16] x) => (float[4,16] a, float[4,16] b, float[4,16] c, float[4,16] f) {
    s = Sqrt(x)
    a = Relu(s)
    b = Neg(s)
    three = Constant<value = float {3.0}>()
    c = Sub(three, s)
    m2 = Constant<value = float {-2.0}>()
    d = Mul(s, m2)
    half = Constant<value = float {0.5}>()
    e = Add(d, half)
    huge = Constant<value = float {1e38}>()
    f = Mul(e, huge)
}
"""


def monotone_reference(x: np.ndarray) -> dict[str, np.ndarray]:
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.sqrt(x)
        d = s * np.float32(-2)
        e = d + np.float32(0.5)
        return {"a": np.maximum(s, 0), "b": -s, "c": np.float32(3) - s, "d": d, "e": e, "f": e * np.float32(1e38)}


def test_monotone_maps_take_their_input_s_max_and_min():
    inst = instrument(model_from_text(MONOTONE), detailed=(), nan_checked=())
    reduced = {n.input[0] for n in inst.model.graph.node if n.op_type == "ReduceMax"}
    assert len(reduced) == 2  # x and s; a..f come from s's max and min


@pytest.mark.parametrize("negative", [False, True])
def test_monotone_maps_are_exact_and_rerun_behind_a_nan(tmp_path, save, negative, opened_nan_checked):
    model = load_model(save(MONOTONE))
    rng = np.random.default_rng(5)
    arrays = [rng.uniform(0.5, 9.0, (4, 16)).astype(np.float32) for _ in range(3)]
    if negative:
        arrays[2][1, 3] = -1.0  # a NaN in s and everything after it
    stats = calibrate(model, write_samples(tmp_path, model, arrays))
    for name in "abcdef":
        want = np.concatenate([monotone_reference(a)[name].ravel() for a in arrays])
        got = stats.tensors[name]
        finite = want[~np.isnan(want)]
        assert (got.max, got.min) == (float(finite.max()), float(finite.min())), name
        assert got.nan_count == int(np.isnan(want).sum()) and got.inf_count == int(np.isinf(want).sum()), name
    assert stats.tensors["f"].inf_count > 0
    assert ("a" in opened_nan_checked[-1]) == negative
