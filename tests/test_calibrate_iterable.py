"""Calibration from any iterable of feeds (a generator over a data loader): same statistics,
read once and lazily, with or without a length."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from conftest import square_samples

from npuprep.calibrate import calibrate
from npuprep.errors import NpuprepError

SCALES = [1.0, 300.0, 1e-4, 2.0, 5e3, 0.5, 1.0, 40.0, 1e-2]


@pytest.fixture
def squares(tmp_path, save):
    model, samples, folder = square_samples(tmp_path, save, SCALES, seed=7)
    return model, samples, [np.load(f)["x"] for f in sorted(folder.glob("*.npz"))]


def tensors(stats):
    return {k: v.to_dict() for k, v in stats.tensors.items()}


@pytest.mark.parametrize("streams", [1, 2])
def test_a_generator_gives_the_stats_of_the_files(squares, streams):
    model, samples, xs = squares
    stats = calibrate(model, ({"x": x} for x in xs), streams=streams)
    files = calibrate(model, samples, streams=streams)
    assert tensors(stats) == tensors(files)
    assert stats.sample_count == len(xs) and stats.sample_ids == tuple(range(len(xs)))
    assert stats.samples == f"{len(xs)} samples from a Python iterable (stream)"
    assert stats.source == {"kind": "stream", "source": "a Python iterable"}


def test_a_sized_iterable_shows_its_length_and_an_unsized_one_none(squares, shown_progress):
    model, _, xs = squares
    calibrate(model, [{"x": x} for x in xs], show_progress=True, streams=1)
    calibrate(model, ({"x": x} for x in xs), show_progress=True, streams=1)
    shown, bars = shown_progress
    assert bars == [(len(xs), True), (None, True)]
    assert shown == list(range(1, len(xs) + 1)) * 2


@pytest.mark.parametrize("streams", [1, 2])
def test_samples_are_read_lazily_and_let_go(squares, streams):
    # Memory flat in the number of samples: when a sample is made, only those in flight (one
    # per stream, the one just read, and sample 0, which settled the session) are alive.
    model, _, _ = squares
    alive: list[weakref.ref] = []
    counts: list[int] = []

    def feeds():
        rng = np.random.default_rng(0)
        for _ in range(40):
            gc.collect()
            counts.append(sum(r() is not None for r in alive))
            x = (rng.standard_normal((8, 8)) * 10.0 ** rng.integers(-4, 4)).astype(np.float32)
            alive.append(weakref.ref(x))
            yield {"x": x}

    stats = calibrate(model, feeds(), streams=streams)
    assert stats.sample_count == 40
    assert max(counts) <= streams + 2, counts


def test_bad_streams_are_refused_with_one_line(squares):
    model, _, xs = squares
    with pytest.raises(NpuprepError, match="the sample stream gave no sample"):
        calibrate(model, iter([]))
    bad = [{"x": xs[0]}, {"x": xs[1]}, {"x": np.full((8, 8), np.nan, np.float32)}]
    with pytest.raises(NpuprepError, match=r"^sample 2 of the stream: input 'x' holds 64 NaN"):
        calibrate(model, iter(bad), streams=1)
    with pytest.raises(NpuprepError, match=r"^sample stream: sample 1 is a ndarray, not a dict"):
        calibrate(model, iter([{"x": xs[0]}, xs[1]]), streams=1)
    with pytest.raises(NpuprepError, match="jobs=2: forked processes need samples read by range"):
        calibrate(model, iter([{"x": x} for x in xs]), jobs=2)
    with pytest.raises(NpuprepError, match="unknown executor 'dask'"):
        calibrate(model, xs, executor="dask")


def test_a_stream_is_read_to_its_end_whatever_length_it_claims(squares):
    model, _, xs = squares

    class Claims3:
        def __len__(self) -> int:
            return 3

        def __iter__(self):  # noqa: ANN204 - an iterator of feeds
            return iter({"x": x} for x in xs)

    stats = calibrate(model, Claims3(), streams=1)
    assert stats.sample_count == len(xs) and len(stats.tensors["x"].per_sample_absmax) == len(xs)
