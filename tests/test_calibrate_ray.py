"""Calibration as Ray tasks (local Ray, 2 CPUs): the zoo's stats equal one process's; a dead
worker's shard runs again and is merged once; errors in the data stay one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_cli

from npuprep.calibrate import calibrate
from npuprep.calibrate.on_ray import calibrate_on_ray, calibrate_shard, check_address
from npuprep.data import load_samples
from npuprep.errors import NpuprepError
from npuprep.examples.zoo import ZOO
from npuprep.model_io import load_model

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'npuprep[ray]')")


def zoo_on_disk(folder: Path, name: str) -> tuple[Path, Path]:
    """A zoo model saved as a file, its samples as a folder of .npz."""
    z = ZOO[name]()
    folder.mkdir()
    onnx.save(z.model, str(folder / "model.onnx"))
    (folder / "data").mkdir()
    for i, feed in enumerate(z.samples):
        np.savez(folder / "data" / f"{i:03d}.npz", **feed)
    return folder / "model.onnx", folder / "data"


def test_the_zoo_on_ray_equals_one_process(local_ray, tmp_path):
    for name in ZOO:
        path, data = zoo_on_disk(tmp_path / name, name)
        model = load_model(path, weights="file")
        samples = load_samples(data, model.proto)
        one = calibrate(model, samples)
        on_ray = calibrate(model, samples, executor="ray")
        assert on_ray.to_dict() == one.to_dict(), name


def test_the_progress_bar_counts_the_samples_of_every_task(local_ray, tmp_path, monkeypatch):
    import contextlib

    import npuprep.calibrate.on_ray as on_ray

    path, data = zoo_on_disk(tmp_path / "z", "bev_distance")
    model = load_model(path, weights="file")
    shown: list[int] = []

    @contextlib.contextmanager
    def recording(total, description, enabled):  # noqa: ANN001, ANN202 - stands in for progress_counter
        yield shown.append

    monkeypatch.setattr(on_ray, "progress_counter", recording)
    calibrate_on_ray(model, load_samples(data, model.proto), show_progress=True)
    assert shown and shown == sorted(shown) and shown[-1] == 8


def test_a_dead_worker_is_retried_and_its_shard_merged_once(local_ray, tmp_path):
    path, data = zoo_on_disk(tmp_path / "z", "residual_outliers")
    model = load_model(path, weights="file")
    samples = load_samples(data, model.proto)
    marker = tmp_path / "died"

    def dies_once(model_path, shard, detail, streams, cpus, counter, index):  # noqa: ANN001, ANN202
        # Shard 1 computes its whole result, then its worker dies before returning it.
        result = calibrate_shard(model_path, shard, detail, streams, cpus, counter, index)
        if index == 1 and not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)
        return result

    stats = calibrate_on_ray(model, samples, task=dies_once, retries=1)
    assert marker.exists()
    assert stats.to_dict() == calibrate(model, samples).to_dict()


def test_a_worker_that_always_dies_fails_in_one_line(local_ray, tmp_path):
    path, data = zoo_on_disk(tmp_path / "z", "guidance")
    model = load_model(path, weights="file")

    def always_dies(*args):  # noqa: ANN002, ANN202
        os._exit(1)

    with pytest.raises(NpuprepError, match=r"^Ray: a shard failed after 1 try \(WorkerCrashedError"):
        calibrate_on_ray(model, load_samples(data, model.proto), task=always_dies, retries=0)


def test_bad_data_on_a_worker_is_the_users_error(local_ray, tmp_path):
    path, data = zoo_on_disk(tmp_path / "z", "exp_logits")
    model = load_model(path, weights="file")
    samples = load_samples(data, model.proto)
    (data / "007.npz").write_bytes(b"not a zip")
    with pytest.raises(NpuprepError, match=r"007\.npz: not a readable \.npz file") as caught:
        calibrate(model, samples, executor="ray")
    assert "\n" not in str(caught.value)
    with pytest.raises(NpuprepError, match="must be files"):
        calibrate(model, iter(()), executor="ray")


def test_the_command_line_on_a_local_ray_and_joining_a_cluster(local_ray, tmp_path):
    path, data = zoo_on_disk(tmp_path / "z", "decomposed_layernorm")
    one, two, three = tmp_path / "one.json", tmp_path / "ray.json", tmp_path / "joined.json"
    assert run_cli("calibrate", path, "--data", data, "-o", one).returncode == 0
    # Without an address the CLI starts a local Ray of its own and stops it.
    r = run_cli("calibrate", path, "--data", data, "--ray", "-o", two, "--json")
    assert r.returncode == 0, r.stderr
    assert two.read_bytes() == one.read_bytes()
    assert json.loads(r.stdout)["sample_count"] == 8
    # With one it joins that cluster (here the module's) and leaves it running.
    address = ray.get_runtime_context().gcs_address
    r = run_cli("calibrate", path, "--data", data, "--ray", address, "-o", three)
    assert r.returncode == 0, r.stderr
    assert three.read_bytes() == one.read_bytes()
    assert ray.is_initialized() and ray.cluster_resources().get("CPU") == 2
    r = run_cli("calibrate", path, "--data", data, "--ray", "--jobs", "2")
    assert r.returncode == 2 and "--jobs does not apply" in r.stderr


def test_tasks_of_two_cpus_and_synthetic_samples(local_ray, tmp_path):
    # 2 CPUs per task on a 2-CPU Ray: one shard; synthetic samples are sharded by index.
    from npuprep.data import synthetic_samples

    path, _ = zoo_on_disk(tmp_path / "z", "conv_stack")
    model = load_model(path, weights="file")
    samples = synthetic_samples(model.proto, 5, seed=3)
    one = calibrate(model, samples)
    assert calibrate_on_ray(model, samples, cpus_per_task=2).to_dict() == one.to_dict()
    assert calibrate_on_ray(model, samples, shards=5).to_dict() == one.to_dict()
    with pytest.raises(NpuprepError, match="CPUs per task must be at least 1"):
        calibrate_on_ray(model, samples, cpus_per_task=0)
    with pytest.raises(NpuprepError, match=r"--ray-cpus 3: the Ray cluster has 2 CPUs"):
        calibrate_on_ray(model, samples, cpus_per_task=3)  # Ray would wait for ever


def test_bad_addresses_are_one_line_before_ray_starts(tmp_path):
    path, data = zoo_on_disk(tmp_path / "z", "conv_stack")
    for address, says in (("not an address", "not a Ray address"), ("host:99999", "not a Ray address"),
                          ("ray://:10001", "not a Ray address")):
        r = run_cli("calibrate", path, "--data", data, "--ray", address, "-o", tmp_path / "s.json")
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "s.json").exists()
    for good in ("auto", "ray://head:10001", "10.0.0.1:6379", None):
        check_address(good)


def test_sigterm_during_a_ray_run_ends_in_one_line_and_cleans_up(local_ray, tmp_path):
    # Ray installs its own SIGTERM handler (a stack dump, exit 134, the lock left behind);
    # npuprep puts its own back, so the run ends as any other: one line, 143, nothing changed.
    import signal
    import subprocess
    import sys
    import time

    path, _ = zoo_on_disk(tmp_path / "z", "conv_stack")
    out = tmp_path / "s.json"
    out.write_text("an earlier run's stats\n")
    address = ray.get_runtime_context().gcs_address
    # 50000 samples take far longer (2000 took ~2 s on 2 cores) than the 1 s after which the
    # signal comes, so it lands while Ray's tasks run.
    proc = subprocess.Popen([sys.executable, "-m", "npuprep", "calibrate", path, "--synthetic", "50000",
                             "--ray", address, "-o", out], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lock = tmp_path / ".s.json.lock"
    deadline = time.monotonic() + 60
    while not lock.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1)  # the lock is taken once the cluster is joined: its tasks are running
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and err.strip() == "npuprep: terminated", err
    assert out.read_text() == "an earlier run's stats\n" and not lock.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "z"]


def test_sigterm_inside_ray_init_reaches_npuprep_s_handler():
    # A fake ray.init that does what Ray's does first: SIGTERM -> sys.exit(15); then the signal.
    import signal
    import sys
    import types

    from npuprep.calibrate.on_ray import _join

    class Ended(Exception):
        pass

    def ours(signum, frame):
        raise Ended(signum)

    def init(**kwargs):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, ours)
    try:
        with pytest.raises(Ended):
            _join(types.SimpleNamespace(init=init), None)
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_inside_ray_shutdown_ends_the_run_after_it_returns():
    # fake ray.shutdown: SIGTERM arrives inside it, then Ray resets the handler to the default
    import os
    import signal
    import types

    from npuprep.calibrate.on_ray import _shutdown

    class Ended(Exception):
        pass

    def ours(signum, frame):
        raise Ended(signum)

    done = []

    def shutdown():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        done.append("shut down")

    previous = signal.signal(signal.SIGTERM, ours)
    try:
        with pytest.raises(Ended):
            _shutdown(types.SimpleNamespace(shutdown=shutdown))
        assert done == ["shut down"] and signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, previous)
