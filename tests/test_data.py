"""Samples in the forms people have, and one clear line for each kind of bad data."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import model_from_text
from polygraphy.json import save_json

from npuprep.data import load_samples, synthetic_samples
from npuprep.errors import NpuprepError

# (x, ids) -> Gather(x, ids) -> y ; x is float[2,3] with a symbolic leading dim
MODEL = model_from_text("""
<ir_version: 8, opset_import: ["" : 18]>
g (float[N,3] x, int64[2] ids) => (float[2,3] y) { y = Gather(x, ids) }
""")


def sample(i: int) -> dict[str, np.ndarray]:
    return {"x": np.full((2, 3), float(i), np.float32), "ids": np.array([0, 1], np.int64)}


def collect(samples) -> list[dict[str, np.ndarray]]:
    return [dict(f) for f in samples]


def same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True)
    )


def test_every_form_gives_the_same_feeds(tmp_path):
    feeds = [sample(i) for i in range(3)]
    folder = tmp_path / "dir"
    folder.mkdir()
    for i, f in enumerate(feeds):
        np.savez(folder / f"{i}.npz", **f)
    np.savez(tmp_path / "batch.npz", x=np.stack([f["x"] for f in feeds]), ids=np.stack([f["ids"] for f in feeds]))
    save_json(feeds, str(tmp_path / "inputs.json"))

    from_dir = load_samples(folder, MODEL)
    from_batch = load_samples(tmp_path / "batch.npz", MODEL, batched=True)
    from_json = load_samples(tmp_path / "inputs.json", MODEL)
    single = load_samples(folder / "1.npz", MODEL)
    assert (from_dir.kind, from_batch.kind, from_json.kind, single.kind) == ("dir", "batched", "polygraphy", "npz")
    for s in (from_dir, from_batch, from_json):
        assert len(s) == 3 and same(collect(s), feeds)
    assert same(collect(single), [feeds[1]])
    assert same(list(from_batch.iter_range(1, 3)), feeds[1:])
    assert "3 samples" in from_dir.describe() and not from_dir.synthetic


def test_synthetic_samples_are_seeded_and_say_so():
    a = synthetic_samples(MODEL, 2, seed=5)
    b = synthetic_samples(MODEL, 2, seed=5)
    c = synthetic_samples(MODEL, 2, seed=6)
    assert a.synthetic and "synthetic" in a.describe() and "not real data" in a.describe()
    assert same(collect(a), collect(b)) and not same(collect(a), collect(c))
    first = collect(a)[0]
    assert first["x"].shape == (1, 3) and first["x"].dtype == np.float32 and first["ids"].dtype == np.int64


@pytest.mark.parametrize(
    ("feed", "message"),
    [
        ({"ids": np.array([0, 1])}, "missing input 'x'"),
        ({"x": np.zeros((2, 3), np.float32), "ids": np.array([0, 1]), "z": np.zeros(1)}, "unknown input 'z'"),
        ({"x": np.zeros((2, 3), np.float64), "ids": np.array([0, 1])}, "input 'x' has dtype float64"),
        ({"x": np.zeros((2, 4), np.float32), "ids": np.array([0, 1])}, "input 'x' has shape (2, 4)"),
        ({"x": np.array([[0, np.nan, 1], [1, 1, 1]], np.float32), "ids": np.array([0, 1])},
         "input 'x' holds 1 NaN and 0 Inf values (first at index (0, 1))"),
        ({"x": np.array([[0, 1, 1], [1, -np.inf, 1]], np.float32), "ids": np.array([0, 1])},
         "input 'x' holds 0 NaN and 1 Inf values (first at index (1, 1))"),
    ],
)
def test_bad_sample_names_the_file_and_tensor(tmp_path, feed, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **feed)
    with pytest.raises(NpuprepError, match="bad.npz") as err:
        load_samples(path, MODEL)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_bad_sample_deep_in_a_directory_is_named_when_reached(tmp_path):
    for i in range(3):
        np.savez(tmp_path / f"{i}.npz", **sample(i))
    bad = sample(9)
    bad["x"][0, 0] = np.nan
    np.savez(tmp_path / "3.npz", **bad)
    samples = load_samples(tmp_path, MODEL)
    with pytest.raises(NpuprepError, match=r"3\.npz: input 'x' holds 1 NaN and 0 Inf"):
        collect(samples)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.with_suffix(".npz").write_bytes(b"not a zip"), "not a readable .npz"),
        (lambda p: p.with_suffix(".json").write_text("{broken"), "not a Polygraphy inputs JSON"),
        (lambda p: p.with_suffix(".json").write_text("[]"), "non-empty list"),
        (lambda p: p.with_suffix(".txt").write_text("1 2 3"), "unknown data format"),
        (lambda p: p.mkdir(), "holds no .npz samples"),
    ],
)
def test_unreadable_sources_are_one_line(tmp_path, make, message):
    target = tmp_path / "data"
    make(target)
    path = next(tmp_path.iterdir())
    with pytest.raises(NpuprepError, match=message):
        load_samples(path, MODEL)


def test_batched_needs_a_common_first_axis(tmp_path):
    np.savez(tmp_path / "b.npz", x=np.zeros((3, 2, 3), np.float32), ids=np.zeros((2, 2), np.int64))
    with pytest.raises(NpuprepError, match="share axis 0"):
        load_samples(tmp_path / "b.npz", MODEL, batched=True)
    with pytest.raises(NpuprepError, match="not found"):
        load_samples(tmp_path / "missing.npz", MODEL)


def test_polygraphy_json_with_a_bad_sample_names_its_index(tmp_path):
    feeds = [sample(0), {"x": np.zeros((2, 3), np.float32)}]
    save_json(feeds, str(tmp_path / "in.json"))
    samples = load_samples(tmp_path / "in.json", MODEL)
    with pytest.raises(NpuprepError, match=r"in\.json\[1\]: missing input 'ids'"):
        collect(samples)


def test_batched_keeps_a_batch_axis_of_one(tmp_path):
    # x -> Relu -> y with a fixed batch of 1: a batched file of 5 rows gives five [1, 3] feeds
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[1,3] x) => (float[1,3] y) { y = Relu(x) }
    """)
    rows = np.arange(15, dtype=np.float32).reshape(5, 3)
    np.savez(tmp_path / "b.npz", x=rows)
    feeds = collect(load_samples(tmp_path / "b.npz", model, batched=True))
    assert len(feeds) == 5 and all(f["x"].shape == (1, 3) for f in feeds)
    assert np.array_equal(feeds[3]["x"], rows[3:4])
