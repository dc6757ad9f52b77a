"""Detail added on demand: the first session details nothing; a flagged sample reruns on one
that does, and the statistics are those of a graph detailing every tensor."""

from __future__ import annotations

import numpy as np
import pytest

import npuprep.calibrate.fetched as calibrate_fetched
import npuprep.calibrate.run as calibrate_run
from npuprep.calibrate import calibrate
from npuprep.calibrate.layout import HI, LO
from npuprep.data import load_samples
from npuprep.model_io import load_model
from tests.conftest import save_matmul_eye

# x -> Mul(x, 2) -> y -> Relu -> r;  x -> Mul(x, 0.25) -> q
MODEL = """
<ir_version: 8, opset_import: ["" : 18]>
g (float[4,16] x) => (float[4,16] r, float[4,16] q) {
    two = Constant<value = float {2.0}>()
    y = Mul(x, two)
    r = Relu(y)
    quarter = Constant<value = float {0.25}>()
    q = Mul(x, quarter)
}
"""


def numpy_hist(x: np.ndarray) -> dict[int, int]:
    a = np.abs(x[np.isfinite(x) & (x != 0)]).astype(np.float64)
    exps, counts = np.unique(np.frexp(a)[1] - 1, return_counts=True)
    return {int(e): int(c) for e, c in zip(exps, counts, strict=True)}


def samples_scaled(tmp_path, save, scales):
    model = load_model(save(MODEL))
    rng = np.random.default_rng(7)
    arrays = []
    for s in scales:
        a = rng.uniform(-1, 1, (4, 16)).astype(np.float32)
        a *= np.float32(s / np.abs(a).max())  # abs-max exactly s (up to rounding)
        arrays.append(a)
    folder = tmp_path / "data"
    folder.mkdir()
    for i, a in enumerate(arrays):
        np.savez(folder / f"s{i:03d}.npz", x=a)
    return model, load_samples(folder, model.proto), arrays


def test_a_late_outlier_reruns_its_sample_with_detail_and_counts_exactly(tmp_path, save, opened_detailed):
    # abs-max of x: ordinary (1) for three samples, then 1000 (above the ordinary range), then 1 again.
    model, samples, arrays = samples_scaled(tmp_path, save, [1.0, 1.0, 1.0, 1000.0, 1.0])
    stats = calibrate(model, samples)
    # The first session, then the same with prepacked weights, then one detailing the outlier's
    # tensors: x and y flagged (abs-max 1000, 2000); q (250) and r too, all outside the range.
    assert opened_detailed[0] == opened_detailed[1] == frozenset() and len(opened_detailed) == 3
    assert {"x", "y", "r", "q"} <= opened_detailed[2]
    outlier = arrays[3]
    for name, values in (("x", outlier), ("y", outlier * 2), ("q", outlier * np.float32(0.25)),
                         ("r", np.maximum(outlier * 2, 0))):
        s = stats.tensors[name]
        assert s.detailed_count == values.size, name  # only the outlier sample is detailed
        assert s.exp_hist == numpy_hist(values), name
        assert s.zero_count == int((values == 0).sum()), name
    everything = np.concatenate([a.ravel() for a in arrays])
    assert stats.tensors["x"].absmax == float(np.abs(everything).max())
    assert stats.tensors["x"].count == everything.size


def test_the_same_statistics_as_detailing_every_tensor_from_the_start(tmp_path, save, monkeypatch, opened_detailed):
    model, samples, _ = samples_scaled(tmp_path, save, [1.0, 0.01, 3.0, 200.0, 0.5, 1e-3])
    adaptive = calibrate(model, samples)
    assert opened_detailed[0] == frozenset() and len(opened_detailed) > 1
    # A Folding that starts with every tensor detailed (the graph before detail on demand).
    real_init = calibrate_run.Folding.__init__

    def everything_detailed(self, prepared, threads):
        real_init(self, prepared, threads)
        self.detailed = None
        self.opened = prepared.open(threads, None)

    monkeypatch.setattr(calibrate_run.Folding, "__init__", everything_detailed)
    assert calibrate(model, samples).to_dict() == adaptive.to_dict()


def test_ordinary_samples_never_detail(tmp_path, save, opened_detailed):
    model, samples, _ = samples_scaled(tmp_path, save, [1.0, 2.0, 3.0])
    stats = calibrate(model, samples)
    assert opened_detailed == [frozenset(), frozenset()]  # the second only for prepacked weights
    assert all(s.detailed_count == 0 for s in stats.tensors.values())


def test_only_sessions_that_stay_get_prepacked_weights(tmp_path, save, opened_detailed, opened_prepacked,
                                                       monkeypatch):
    # Sample 0 below the range: the first session (no detail) is rebuilt, so it was built
    # without prepacked weights; the one rebuilt with the detail has them.
    model, samples, _ = samples_scaled(tmp_path, save, [0.01, 1.0, 2.0])
    calibrate(model, samples)
    assert len(opened_prepacked) > 1 and opened_detailed[1]
    assert opened_prepacked == [False] + [True] * (len(opened_prepacked) - 1)
    opened_prepacked.clear()
    # In the graph (fetched, every tensor's values come from one session of its own).
    monkeypatch.setattr(calibrate_fetched, "FETCH_BYTES", 0)
    calibrate(model, samples, detail="all")  # its only session: prepacked from the start
    assert opened_prepacked == [True]


def test_a_first_session_kept_is_rebuilt_prepacked_and_its_rows_never_kept(
        tmp_path, save, opened_detailed, opened_prepacked, monkeypatch):
    # Every sample ordinary: the first session needs no detail, only its prepacked weights.
    model, samples, arrays = samples_scaled(tmp_path, save, [1.0, 2.0, 3.0])
    runs: list[bool] = []
    real_measure_run = calibrate_run.Folding.measure

    def recording(self, feed):  # noqa: ANN001, ANN202 - stands in for measure
        result = real_measure_run(self, feed)
        runs.append(self.prepacked)
        return result

    monkeypatch.setattr(calibrate_run.Folding, "measure", recording)
    stats = calibrate(model, samples, streams=1)
    assert opened_prepacked == [False, True] and opened_detailed == [frozenset(), frozenset()]
    assert runs == [True, True, True]  # every row folded in came from the prepacked session
    assert stats.tensors["x"].per_sample_absmax == tuple(float(np.abs(a).max()) for a in arrays)


def test_external_data_models_detail_on_demand_too(tmp_path, save, opened_detailed):
    # x -> MatMul(x, W) -> y, W = 1000 * I stored as external data: y is not ordinary
    inline, external = save_matmul_eye(save, tmp_path, 1000)
    inline_model = load_model(inline)
    np.savez(tmp_path / "a.npz", x=np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64))
    ext_model = load_model(external)
    ext = calibrate(ext_model, load_samples(str(tmp_path / "a.npz"), ext_model.proto))
    assert opened_detailed == [frozenset(), frozenset({"y"})]  # onnxruntime rereads the weights from the page cache
    opened_detailed.clear()
    inline = calibrate(inline_model, load_samples(str(tmp_path / "a.npz"), inline_model.proto))
    assert opened_detailed[0] == frozenset() and "y" in opened_detailed[1]
    assert ext.tensors["y"].to_dict() == inline.tensors["y"].to_dict()
    assert ext.tensors["y"].detailed_count == 128


# x -> Mul(x, 0.5) -> y;  x -> Sqrt -> root (NaN for x < 0)
LEAN_MODEL = """
<ir_version: 8, opset_import: ["" : 18]>
g (float[4,16] x) => (float[4,16] y, float[4,16] root) {
    half = Constant<value = float {0.5}>()
    y = Mul(x, half)
    root = Sqrt(x)
}
"""


def _lean_then(kind: str) -> list[np.ndarray]:
    """Sample 0 puts every tensor below the ordinary range (finite, no zero: the lean detail
    takes it); sample 1 then needs what only the full detail has."""
    rng = np.random.default_rng(3)
    first = rng.uniform(0.5, 1.0, (4, 16)).astype(np.float32) * np.float32(0.01)
    second = first.copy()
    if kind == "zeros":
        second[0, :5] = 0.0  # zeros in x, y and root
    elif kind == "nan":
        second[1, 2] = np.float32(-0.005)  # a NaN in root
    elif kind == "over":
        second[2, 3] = np.float32(1000.0)  # above fp8_e4m3's max in x and y
    return [first, second, first * np.float32(0.5)]


@pytest.mark.parametrize(("kind", "upgraded"), [("zeros", "x"), ("nan", "root"), ("over", "y")])
def test_a_lean_detail_that_cannot_count_a_sample_reruns_it_with_the_full_detail(
        tmp_path, save, opened_lean, opened_detailed, kind, upgraded):
    model = load_model(save(LEAN_MODEL))
    arrays = _lean_then(kind)
    folder = tmp_path / "data"
    folder.mkdir()
    for i, a in enumerate(arrays):
        np.savez(folder / f"s{i:03d}.npz", x=a)
    stats = calibrate(model, load_samples(folder, model.proto))
    # Session 2: the lean detail for every tensor; session 3: the full one where sample 1 flagged.
    assert len(opened_lean) == 3 and opened_lean[0] == frozenset()
    assert opened_lean[1] == opened_detailed[1] == frozenset({"x", "y", "root"})
    assert upgraded in opened_detailed[2] and upgraded not in opened_lean[2]
    x = np.stack(arrays)
    with np.errstate(invalid="ignore"):
        reference = {"x": x, "y": x * np.float32(0.5), "root": np.sqrt(x)}
    for name, values in reference.items():
        s = stats.tensors[name]
        finite = values[~np.isnan(values)]
        # Detail for the samples outside the ordinary range: the histogram counts those.
        outside = [v for v in values if not (np.isfinite(v).all() and LO <= np.abs(v).max() <= HI)]
        assert s.detailed_count == sum(v.size for v in outside), name
        assert s.exp_hist == numpy_hist(np.stack(outside)), name
        assert s.zero_count == int((values == 0).sum()), name
        assert s.nan_count == int(np.isnan(values).sum()), name
        assert s.over["fp8_e4m3"] == int((np.abs(values) > 448).sum()), name
        assert s.max == float(finite.max()) and s.min == float(finite.min()), name
    found = stats.tensors[upgraded]
    assert (found.zero_count, found.nan_count, found.over["fp8_e4m3"]) == {
        "zeros": (5, 0, 0), "nan": (0, 1, 0), "over": (0, 0, 1)}[kind]


def test_the_lean_detail_counts_what_the_full_detail_counts(tmp_path, save, monkeypatch):
    # Every tensor below the range in every sample: all lean after the first sample.
    model, samples, _ = samples_scaled(tmp_path, save, [0.01, 0.02, 0.005])
    lean = calibrate(model, samples)
    real_open = calibrate_run.Prepared.open

    def never_lean(self, threads, detailed, nan_checked=None, lean=(), prepack=True):  # noqa: ANN001, ANN202
        return real_open(self, threads, detailed, nan_checked, prepack=prepack)

    monkeypatch.setattr(calibrate_run.Prepared, "open", never_lean)
    assert calibrate(model, samples).to_dict() == lean.to_dict()
