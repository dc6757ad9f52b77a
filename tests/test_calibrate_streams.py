"""Calibration streams: several samples at once on threads sharing one session, same statistics."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from conftest import SQUARES, run_cli, square_samples

import npuprep.calibrate.run as calibrate_run
import npuprep.runtime.session as runtime_session
from npuprep.calibrate import calibrate
from npuprep.calibrate.run import plan_streams, session_threads
from npuprep.data import load_samples
from npuprep.errors import NpuprepError

# Scales of the samples: ordinary ones, then outliers that flag tensors only later on, so
# sessions are rebuilt while other streams run.
SCALES = [1.0, 2.0, 1.5, 200.0, 1e-3, 1.0, 3e3, 0.5, 1e-5, 1.0, 40.0]


@pytest.fixture
def scaled(tmp_path, save):
    return square_samples(tmp_path, save, SCALES, seed=11)


@pytest.fixture
def slow_runs(monkeypatch):
    """Every session run takes >= 10 ms and records its thread, so the streams interleave."""
    threads: list[str] = []
    real_run = runtime_session.run

    def slow(session, feeds, outputs=None):  # noqa: ANN001, ANN202 - stands in for run
        threads.append(threading.current_thread().name)
        time.sleep(0.01)
        return real_run(session, feeds, outputs)

    monkeypatch.setattr(runtime_session, "run", slow)
    return threads


@pytest.mark.parametrize(
    ("streams", "count", "jobs", "n_cores", "expected"),
    [
        (1, 100, 1, 8, 1),
        (3, 100, 1, 8, 3),
        (5, 2, 1, 8, 2),  # never more streams than samples
        (0, 100, 1, 8, 8),  # auto: one per core when each gets SAMPLES_PER_STREAM (4)
        (0, 31, 1, 8, 1),
        (0, 32, 1, 8, 8),
        (0, 8, 1, 2, 2),
        (0, 7, 1, 2, 1),
        (0, 100, 2, 8, 4),  # per process: its share of the cores and of the samples
        (0, 100, 8, 8, 1),
        (4, 6, 2, 8, 3),
        (0, 1, 1, 8, 1),
    ],
)
def test_plan_streams(streams, count, jobs, n_cores, expected):
    assert plan_streams(streams, count, jobs, n_cores) == expected


def test_negative_streams_are_refused():
    with pytest.raises(NpuprepError, match="streams must be at least 0"):
        plan_streams(-1, 10)


def test_runs_at_once_share_the_cores_out():
    assert session_threads(1, 8) is None
    assert session_threads(2 * 2, 8) == 2  # two processes of two streams
    assert session_threads(3, 2) == 1


@pytest.mark.parametrize("detail", ["auto", "all"])
def test_streams_agree_with_one_and_run_at_once(scaled, slow_runs, monkeypatch, detail):
    model, samples, _ = scaled
    one = calibrate(model, samples, streams=1, detail=detail)
    assert set(slow_runs) == {threading.main_thread().name}
    slow_runs.clear()
    monkeypatch.setattr(calibrate_run, "cores", lambda: 3)
    three = calibrate(model, samples, streams=3, detail=detail)
    assert three.to_dict() == one.to_dict()
    assert len(set(slow_runs) - {threading.main_thread().name}) == 3
    # The statistics themselves: exact against numpy.
    xs = [np.load(f)["x"] for f in sorted(scaled[2].glob("*.npz"))]
    sq = [x * x for x in xs]
    assert three.tensors["sq"].max == float(max(s.max() for s in sq))
    assert three.tensors["x"].per_sample_absmax == tuple(float(np.abs(x).max()) for x in xs)


def test_streams_share_one_session_on_one_thread_each(scaled, monkeypatch):
    model, samples, _ = scaled
    opened: list[int] = []
    real_session = calibrate_run.Prepared.session

    # Every session a calibration builds, instrumented or fetching (detail "all" from files).
    def recording_session(self, graph, threads, prepack=True):  # noqa: ANN001, ANN202
        session = real_session(self, graph, threads, prepack)
        opened.append(session.get_session_options().intra_op_num_threads)
        return session

    monkeypatch.setattr(calibrate_run.Prepared, "session", recording_session)
    monkeypatch.setattr(calibrate_run, "cores", lambda: 2)
    calibrate(model, samples, streams=2, detail="all")
    assert opened == [1]  # one session, built once, run by both streams


def test_a_session_rebuilt_by_one_stream_serves_the_others(scaled, slow_runs, monkeypatch, opened_detailed):
    model, samples, _ = scaled
    monkeypatch.setattr(calibrate_run, "cores", lambda: 2)
    two = calibrate(model, samples, streams=2)
    sets = [opened_detailed[i] for i in range(len(opened_detailed))]
    assert len(sets) > 1  # later samples flagged tensors while the other stream ran
    assert all(a <= b for a, b in zip(sets, sets[1:], strict=False))  # a rebuild never loses detail
    assert two.to_dict() == calibrate(model, samples, streams=1).to_dict()


def test_a_bad_sample_stops_every_stream_with_its_own_error(scaled, slow_runs, monkeypatch):
    model, _, folder = scaled
    bad = np.load(folder / "s006.npz")["x"].copy()
    bad[2, 3] = np.nan
    np.savez(folder / "s006.npz", x=bad)
    samples = load_samples(folder, model.proto)
    monkeypatch.setattr(calibrate_run, "cores", lambda: 2)
    with pytest.raises(NpuprepError, match=r"s006\.npz: input 'x' holds 1 NaN"):
        calibrate(model, samples, streams=2)
    assert len(slow_runs) < 2 * len(SCALES)  # the streams stopped instead of running the rest


def test_the_progress_bar_counts_every_streams_samples(scaled, monkeypatch, shown_progress):
    model, samples, _ = scaled
    monkeypatch.setattr(calibrate_run, "cores", lambda: 2)
    calibrate(model, samples, streams=2, show_progress=True)
    shown, bars = shown_progress
    assert bars == [(len(samples), True)] and shown == list(range(1, len(samples) + 1))


def test_forked_processes_run_streams_too(scaled, monkeypatch):
    model, samples, _ = scaled
    monkeypatch.setattr(calibrate_run, "cores", lambda: 4)
    assert calibrate(model, samples, jobs=2, streams=2).to_dict() == calibrate(model, samples, streams=1).to_dict()


def test_streams_on_the_command_line(save, tmp_path):
    model = save(SQUARES)
    one = run_cli("calibrate", model, "--synthetic", "9", "--streams", "1", "--json")
    three = run_cli("calibrate", model, "--synthetic", "9", "--streams", "3", "--json")
    assert one.returncode == 0 and three.returncode == 0, one.stderr + three.stderr
    assert json.loads(three.stdout)["tensors"] == json.loads(one.stdout)["tensors"]
    bad = run_cli("calibrate", model, "--synthetic", "2", "--streams", "x")
    assert bad.returncode == 2 and "--streams" in bad.stderr and "expected a count >= 0 or 'auto'" in bad.stderr


def test_the_first_session_runs_sample_0_on_every_core_and_the_streams_on_one_each(scaled, monkeypatch):
    model, samples, _ = scaled
    opened: list[tuple[int, bool]] = []
    real_open = calibrate_run.Prepared.open

    def recording_open(self, threads, detailed, nan_checked=None, lean=(), prepack=True):  # noqa: ANN001, ANN202
        inst, session = real_open(self, threads, detailed, nan_checked, lean, prepack)
        opened.append((session.get_session_options().intra_op_num_threads, prepack))
        return inst, session

    monkeypatch.setattr(calibrate_run.Prepared, "open", recording_open)
    monkeypatch.setattr(calibrate_run, "cores", lambda: 2)
    calibrate(model, samples, streams=2)
    # onnxruntime's default (0: every core) for the first, without prepacked weights.
    assert opened[0] == (0, False) and len(opened) > 1
    assert set(opened[1:]) == {(1, True)}
