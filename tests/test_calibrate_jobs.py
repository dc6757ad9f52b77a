"""Calibration over forked processes: how many, on how many threads, and the same statistics."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import square_samples

import npuprep.calibrate.run as calibrate_run
from npuprep.calibrate import calibrate
from npuprep.calibrate.run import plan_jobs, session_threads
from npuprep.errors import NpuprepError


@pytest.fixture
def squares(tmp_path, save):
    # Samples over six orders of magnitude: tensors flagged at different samples.
    scales = list(10 ** np.random.default_rng(4).uniform(-3, 3, 7))
    model, samples, _ = square_samples(tmp_path, save, scales, seed=4)
    return model, samples


@pytest.mark.parametrize(
    ("jobs", "count", "n_cores", "expected"),
    [
        (1, 10, 8, 1),
        (3, 10, 8, 3),
        (5, 2, 8, 2),  # never more processes than samples
        (0, 10, 8, 1),  # auto: one per core if each gets SAMPLES_PER_JOB (32) samples, else one
        (0, 100, 8, 1),  # not 3 processes of 2 threads, which would build 3 sessions
        (0, 256, 8, 8),
        (0, 255, 8, 1),
        (0, 64, 2, 2),
        (0, 63, 2, 1),
        (0, 1, 8, 1),
    ],
)
def test_plan_jobs(jobs, count, n_cores, expected):
    assert plan_jobs(jobs, count, n_cores) == expected


def test_negative_jobs_are_refused():
    with pytest.raises(NpuprepError, match="jobs must be at least 0"):
        plan_jobs(-1, 10, 2)


def test_threads_share_the_cores_out():
    assert session_threads(1, 8) is None  # one process: onnxruntime's default, every core
    assert session_threads(2, 8) == 4
    assert session_threads(3, 8) == 2
    assert session_threads(4, 2) == 1


def test_workers_run_on_their_share_of_threads_and_agree_with_one_process(squares, monkeypatch, tmp_path):
    model, samples = squares
    one = calibrate(model, samples, detail="all")
    log = tmp_path / "sessions.txt"
    real_open = calibrate_run.Prepared.open

    def recording_open(self, threads, detailed, nan_checked=None, lean=(), prepack=True):
        inst, session = real_open(self, threads, detailed, nan_checked, lean, prepack)
        opts = session.get_session_options()
        with log.open("a") as f:
            f.write(f"{os.getpid()} {opts.intra_op_num_threads}\n")
        return inst, session

    # Forked workers inherit the patched module.
    monkeypatch.setattr(calibrate_run.Prepared, "open", recording_open)
    monkeypatch.setattr(calibrate_run, "cores", lambda: 6)
    three = calibrate(model, samples, jobs=3, detail="all")
    assert three.to_dict() == one.to_dict()
    rows = [line.split() for line in log.read_text().splitlines()]
    # This process settles sample 0; each worker builds one session from what it settled.
    assert sorted(r[0] == str(os.getpid()) for r in rows) == [False, False, False, True]
    assert len({r[0] for r in rows}) == 4
    assert {r[1] for r in rows} == {"2"}  # 6 cores // 3 jobs


def test_auto_jobs_agree_with_one_process(squares, monkeypatch):
    model, samples = squares
    monkeypatch.setattr(calibrate_run, "cores", lambda: 3)
    monkeypatch.setattr(calibrate_run, "SAMPLES_PER_JOB", 2)
    assert plan_jobs(0, len(samples)) == 3
    assert calibrate(model, samples, jobs=0).to_dict() == calibrate(model, samples).to_dict()


def test_one_thread_workers_run_on_the_settled_session_itself(squares, monkeypatch, tmp_path):
    # 2 cores, 2 jobs: one thread each, so the workers share this process's session (no
    # session of their own) unless a sample flags a tensor the settled session does not detail.
    model, samples = squares
    log = tmp_path / "sessions.txt"
    real_open = calibrate_run.Prepared.open

    def recording_open(self, threads, detailed, nan_checked=None, lean=(), prepack=True):
        with log.open("a") as f:
            f.write(f"{os.getpid()}\n")
        return real_open(self, threads, detailed, nan_checked, lean, prepack)

    monkeypatch.setattr(calibrate_run.Prepared, "open", recording_open)
    monkeypatch.setattr(calibrate_run, "cores", lambda: 2)
    for detail in ("all", "auto"):
        log.unlink(missing_ok=True)
        two = calibrate(model, samples, jobs=2, detail=detail)
        assert two.to_dict() == calibrate(model, samples, detail=detail).to_dict()
        openers = [int(line) for line in log.read_text().splitlines()]
        if detail == "all":
            assert set(openers) == {os.getpid()}  # one session, built here, run by both workers


def test_the_progress_bar_counts_the_workers_samples(squares, monkeypatch, shown_progress):
    model, samples = squares
    monkeypatch.setattr(calibrate_run, "cores", lambda: 2)
    calibrate(model, samples, jobs=2, show_progress=True)
    shown, bars = shown_progress
    assert bars == [(len(samples), True)]
    assert shown and shown == sorted(shown) and shown[-1] == len(samples)
