"""samples -> N shards -> N Ray tasks (each a normal calibrate run) -> merged on the driver.

The optional engine for calibrating beyond one machine (`pip install 'npuprep[ray]'`). Each
task reads the model and its slice of the samples from the shared path, runs `calibrate`
on its share of the CPUs and returns the whole shard's statistics; the driver merges them
exactly (npuprep.calibrate.merge). A task whose worker dies is run again by Ray (its task
retries) from its first sample: the driver only ever merges complete shards.

The 8-bit search's trial runs (npuprep.verify.qdq_trials) run here too, with `--ray`:
SessionsOnRay holds one session of the trial model per actor and deals each batch of runs
(a ranking's, a widening check's samples) to the actors; the outputs are those of the same
runs in one process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from types import ModuleType
from typing import Any

import onnx

from npuprep.calibrate.merge import merge_stats
from npuprep.calibrate.run import calibrate_here
from npuprep.calibrate.stats import CalibrationStats, stats_from_dict
from npuprep.data import Feed, SampleSet
from npuprep.errors import NpuprepError
from npuprep.model_io import Model, load_model
from npuprep.progress import progress_counter


def calibrate_on_ray(
    model: Model,
    samples: SampleSet | Iterable[Feed],
    *,
    address: str | None = None,
    detail: str = "auto",
    streams: int = 0,
    show_progress: bool = False,
    cpus_per_task: int = 1,
    shards: int | None = None,
    retries: int = 3,
    task: Callable[..., dict[str, Any]] | None = None,
) -> CalibrationStats:
    """`calibrate(model, samples)` run as Ray tasks, one per `cpus_per_task` CPUs of the
    cluster (or `shards` of them), each on the samples of one shard (SampleSet.shard).

    Uses the Ray this process is already connected to; else joins the cluster at `address`
    ("auto", "ray://host:10001", ...) or, with None, starts a local Ray on this machine's
    cores (Ray's own rule: it joins RAY_ADDRESS or a `ray start` cluster of this machine
    instead, where there is one), and leaves it again at the end. Each task is tried up to 1 + `retries` times
    when its worker dies; an error in the data or the model (NpuprepError) is not retried.
    `task` is the function each Ray task runs (default `calibrate_shard`)."""
    if not isinstance(samples, SampleSet):
        raise NpuprepError("executor='ray': the workers read the samples themselves, so they must be files "
                           "(or --synthetic), not a stream of feeds")
    if not model.path:
        raise NpuprepError("executor='ray': the workers read the model themselves: give a model file")
    if cpus_per_task < 1:
        raise NpuprepError(f"Ray: CPUs per task must be at least 1, got {cpus_per_task}")
    with joined(address) as ray:
        cpus = int(ray.cluster_resources().get("CPU", 0))
        if cpus_per_task > cpus:
            # Ray would wait for such a worker for ever.
            raise NpuprepError(f"--ray-cpus {cpus_per_task}: the Ray cluster has {cpus} CPUs; "
                               f"give at most {cpus}")
        if shards is None:
            shards = cpus // cpus_per_task
        n = max(1, min(shards, len(samples)))
        model_path = os.path.abspath(model.path)
        parts = [_absolute(samples.shard(k, n)) for k in range(1, n + 1)]
        counter = ray.remote(num_cpus=0)(_Done).remote(n) if show_progress else None
        remote = ray.remote(num_cpus=cpus_per_task, max_retries=retries, retry_exceptions=False)(
            task or calibrate_shard)
        refs = [remote.remote(model_path, part, detail, streams, cpus_per_task, counter, i)
                for i, part in enumerate(parts)]
        docs = _gather(ray, refs, counter, len(samples), show_progress, retries)
    merged = merge_stats([(f"Ray shard {i + 1}/{n}", stats_from_dict(doc)) for i, doc in enumerate(docs)])
    if merged.fingerprint != model.fingerprint:
        raise NpuprepError(f"{model.path}: the Ray workers read another model at {model_path} "
                           f"(fingerprint {merged.fingerprint}, here {model.fingerprint})")
    return merged


@contextlib.contextmanager
def joined(address: str | None) -> Iterator[ModuleType]:
    """Ray for the time of the block: the one this process is connected to, else the
    cluster at `address` joined (None: a local Ray started) and left again at the end, with
    the caller's SIGINT/SIGTERM handlers kept (npuprep's one-line ending)."""
    check_address(address)
    ray = _import_ray()
    started = not ray.is_initialized()
    if started:
        _join(ray, address)
    try:
        yield ray
    finally:
        if started:
            _shutdown(ray)


def check_address(address: str | None) -> None:
    """None (a local Ray), 'auto', HOST:PORT or ray://HOST:PORT; anything else is refused
    before Ray starts (it would raise its own traceback)."""
    if not address or address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not (host and port.isdigit() and 0 < int(port) < 65536 and re.fullmatch(r"[\w.\-\[\]:]+", host)):
        raise NpuprepError(f"--ray {address!r}: not a Ray address; expected 'auto', HOST:PORT or "
                           "ray://HOST:PORT")


def _join(ray: ModuleType, address: str | None) -> None:
    """ray.init, its refusals as one line. Ray's core logs each failed connection attempt to
    stderr; only errors are shown. Ray replaces the SIGTERM and SIGINT handlers with its own
    (a stack dump, exit 134, no clean-up): the caller's are put back."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    terminated = False
    try:
        with _stderr_dropped():
            ray.init(address=address or None, include_dashboard=False, logging_level=logging.ERROR,
                     log_to_driver=False)
    except SystemExit as exc:
        # Ray's handler, set for the time of ray.init, turns SIGTERM into sys.exit(15): the
        # signal is sent again once the caller's handler is back (which then ends the run).
        if exc.code != signal.SIGTERM:
            raise
        terminated = True
    except ConnectionError as exc:
        raise NpuprepError(f"Ray: cannot join the cluster at {address}: {exc}") from None
    except (ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "ray[client]" in first:
            raise NpuprepError(f"--ray {address}: a ray:// address needs Ray's client: "
                               "pip install 'ray[client]'") from None
        raise NpuprepError(f"Ray: cannot start or join a cluster at {address or 'this machine'}: {first}") from None
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
        if terminated:
            os.kill(os.getpid(), signal.SIGTERM)


def _shutdown(ray: ModuleType) -> None:
    """ray.shutdown with SIGINT and SIGTERM held until it returns: a signal inside it stopped
    Ray's core halfway, and its own threads then ended the process with exit 1. Sent again
    after, the signal ends the run as anywhere else (one line, 130/143). Ray's C++ core logs
    the tasks it cancels on the way out ("Failed to push error to driver") to fd 2: dropped,
    as the run's own line says how it ended."""
    if threading.current_thread() is not threading.main_thread():
        with _stderr_dropped():
            ray.shutdown()
        return
    held: list[int] = []
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for sig in handlers:
        signal.signal(sig, lambda signum, frame: held.append(signum))
    try:
        with _stderr_dropped():
            ray.shutdown()
    finally:
        # Ray's shutdown may put back handlers of its own: the caller's come first.
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
        for signum in dict.fromkeys(held):
            os.kill(os.getpid(), signum)


@contextlib.contextmanager
def _stderr_dropped() -> Iterator[None]:
    """File descriptor 2 into a discarded file: Ray's C++ core writes a warning per failed
    connection attempt, and an error per task cancelled at shutdown, there, past Python's
    logging."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def calibrate_shard(
    model_path: str, shard: SampleSet, detail: str, streams: int, cpus: int, counter: Any, index: int
) -> dict[str, Any]:
    """One Ray task: a normal calibration of `shard` on `cpus` cores; its stats as JSON.
    Reports its count of samples done to `counter` (restarting from 0 on a retry)."""

    report = None if counter is None else (lambda done: counter.set.remote(index, done))
    model = load_model(model_path, weights="file")
    return calibrate_here(model, shard, detail=detail, streams=streams, n_cores=cpus, on_progress=report).to_dict()


class _Done:
    """A Ray actor: samples done per shard, set by the tasks, summed for the progress bar."""

    def __init__(self, shards: int) -> None:
        self.done = [0] * shards

    def set(self, shard: int, done: int) -> None:
        self.done[shard] = done

    def total(self) -> int:
        return sum(self.done)


def _gather(ray: ModuleType, refs: list[Any], counter: Any, total: int, show: bool, retries: int) -> list[dict[str, Any]]:
    """Every task's result, in shard order, with a progress bar over the samples done."""
    with _task_errors("a shard", retries), \
            progress_counter(total, "calibrating on Ray", show) as set_done:
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.25)
            if counter is not None:
                set_done(ray.get(counter.total.remote()))
        results = ray.get(refs)
        # The tasks' last counts may still be in flight to the counter actor: every shard
        # is done, so every sample is.
        set_done(total)
        return results


@contextlib.contextmanager
def _task_errors(what: str, retries: int) -> Iterator[None]:
    """A task's NpuprepError as itself, Ray's failures as one line (what failed, after how
    many tries)."""
    from ray.exceptions import RayError, RayTaskError

    try:
        yield
    except RayTaskError as exc:
        if isinstance(exc.cause, NpuprepError):
            raise NpuprepError(str(exc.cause)) from None
        raise
    except RayError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        tries = f"{retries + 1} tries" if retries else "1 try"
        raise NpuprepError(f"Ray: {what} failed after {tries} ({type(exc).__name__}: {first})") from None


class SessionsOnRay:
    """Runs of models on Ray actors, one per `cpus_per_actor` CPUs of the cluster, started
    once: called with a model and its samples (as npuprep.verify.qdq_trials.RunsFactory), it
    puts both into Ray's object store once and each actor builds a session of the model (as
    this process would: npuprep.runtime.session.make_session); each batch of jobs (sample
    index, extra feeds) is dealt to the actors and the outputs come back in the jobs' order.
    An actor whose worker dies is restarted up to `retries` times and its call run again."""

    def __init__(self, ray: ModuleType, *, cpus_per_actor: int = 1, retries: int = 3) -> None:
        if cpus_per_actor < 1:
            raise NpuprepError(f"Ray: CPUs per task must be at least 1, got {cpus_per_actor}")
        cpus = int(ray.cluster_resources().get("CPU", 0))
        if cpus_per_actor > cpus:
            # Ray would wait for such an actor for ever.
            raise NpuprepError(f"--ray-cpus {cpus_per_actor}: the Ray cluster has {cpus} CPUs; "
                               f"give at most {cpus}")
        self.ray, self.retries, self.cpus = ray, retries, cpus_per_actor
        actor = ray.remote(num_cpus=cpus_per_actor, max_restarts=retries,
                           max_task_retries=retries)(_Sessions)
        self.actors = [actor.remote(cpus_per_actor) for _ in range(max(1, cpus // cpus_per_actor))]
        self.models = 0

    def __call__(self, model: onnx.ModelProto, samples: Iterable[Feed]) -> _RunsOnRay:
        if model.ByteSize() >= 2**31:
            raise NpuprepError("--ray: the 8-bit trial model is over protobuf's 2 GB and cannot be "
                               "sent to the Ray workers; run without --ray")
        self.models += 1
        # In a list, the references reach the actors unresolved: an actor restarted after its
        # worker died reads the model again from them.
        refs = [self.ray.put(model.SerializeToString()), self.ray.put([dict(f) for f in samples])]
        runs = _RunsOnRay(self, self.models, refs)
        with _task_errors("loading a trial model", self.retries):
            self.ray.get([a.load.remote(self.models, refs) for a in self.actors])
        return runs

    def close(self) -> None:
        """The actors ended (their sessions freed)."""
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []


class _RunsOnRay:
    """One model's runs on the actors of a SessionsOnRay (npuprep.verify.qdq_trials.TrialRuns)."""

    def __init__(self, pool: SessionsOnRay, key: int, refs: list[Any]) -> None:
        self.pool, self.key, self.refs = pool, key, refs

    def run(self, jobs: Sequence[tuple[int, Mapping[str, Any]]]) -> list[dict[str, Any]]:
        """Each job's outputs: the jobs dealt to the actors in turn, one call per actor."""
        actors = self.pool.actors
        n = len(actors)
        shares = [list(jobs[k::n]) for k in range(n)]
        with _task_errors("a trial run", self.pool.retries):
            done = self.pool.ray.get([a.run.remote(self.key, self.refs, share)
                                      for a, share in zip(actors, shares, strict=True) if share])
        out: list[dict[str, Any]] = [{} for _ in jobs]
        for k, results in enumerate(done):
            out[k::n] = results
        return out

    def close(self) -> None:
        """The actors' sessions of this model freed."""
        self.pool.ray.get([a.drop.remote(self.key) for a in self.pool.actors])


class _Sessions:
    """A Ray actor: sessions of serialised models and their samples, run on request."""

    def __init__(self, cpus: int) -> None:
        self.cpus = cpus
        self.open: dict[int, tuple[Any, list[Feed], list[str]]] = {}

    def load(self, key: int, refs: list[Any]) -> None:
        import ray

        from npuprep.runtime.session import make_session

        model, samples = ray.get(refs)
        # As npuprep.verify.qdq_trials.LocalRuns: no prepacked weights (the same sums).
        session = make_session(onnx.load_from_string(model), threads=self.cpus, prepack=False)
        self.open[key] = (session, samples, [o.name for o in session.get_outputs()])

    def run(self, key: int, refs: list[Any],
            jobs: list[tuple[int, Mapping[str, Any]]]) -> list[dict[str, Any]]:
        from npuprep.runtime.session import run

        if key not in self.open:
            self.load(key, refs)
        session, samples, names = self.open[key]
        return [run(session, {**samples[i], **extra}, names) for i, extra in jobs]

    def drop(self, key: int) -> None:
        self.open.pop(key, None)


def _absolute(shard: SampleSet) -> SampleSet:
    """The shard with absolute file paths, for workers whose working folder differs (the
    source, which only describes the samples, stays as given)."""
    return replace(shard, files=tuple(os.path.abspath(f) for f in shard.files))


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise NpuprepError("Ray is not installed: pip install 'npuprep[ray]'") from None
    return ray
