"""calibrate(model, samples) -> CalibrationStats: stream samples through the instrumented graph."""

from __future__ import annotations

import math
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from npuprep.calibrate.fetched import fetchable, fits, row_of, with_outputs
from npuprep.calibrate.instrument import Instrumented, instrument
from npuprep.calibrate.layout import FLAGGED, HEADER, WIDTH, scope_of
from npuprep.calibrate.stats import Accumulator, CalibrationStats
from npuprep.data import Feed, FeedStream, SampleSet
from npuprep.errors import NpuprepError
from npuprep.model_io import Model
from npuprep.opsets import WORKING_OPSET, at_least, check_opset_supported
from npuprep.progress import progress_counter


def calibrate_here(
    model: Model,
    samples: SampleSet | Iterable[Feed],
    *,
    jobs: int = 1,
    streams: int = 0,
    show_progress: bool = False,
    detail: str = "auto",
    n_cores: int | None = None,
    on_progress: Callable[[int], None] | None = None,
    tensors: Collection[str] | None = None,
) -> CalibrationStats:
    """Range statistics of every float tensor over `samples` (see npuprep.calibrate.instrument),
    or of `tensors` only (a few filled in: the instrumented session is then far cheaper to build).

    `samples`: a SampleSet (files, see npuprep.data), or any iterable of feed dicts (a
    generator over a data loader), read once, in order, with or without a length.
    Samples stream and merge associatively, so memory does not grow with their number.
    `streams` samples run at once in each process, on threads sharing one session, each run
    on its share of the cores (see `fold_streams`); 0 picks the count (see `plan_streams`).
    `jobs` > 1 splits the samples after the first into contiguous ranges, one forked process
    each (see `_fold_parallel`); 0 picks the count (see `plan_jobs`); an iterable runs in
    this process. `n_cores`: the cores to
    plan for (default: those this process may run on). `on_progress` is called with the
    count of samples done as it grows. `detail`: "auto" (exact for every format), "fp16"
    (exact for FP16 and BF16 only, much cheaper on large activations) or "all" (every
    tensor-sample detailed); see npuprep.calibrate.layout.Scope.
    """
    scope_of(detail)  # a wrong name refused before any work
    check_opset_supported(model.proto, model.path or "model")
    if not isinstance(samples, SampleSet):
        samples = FeedStream(samples, model.proto)
        if jobs not in (0, 1):
            raise NpuprepError(f"jobs={jobs}: forked processes need samples read by range (files); "
                               "a stream of feeds runs in this process (use streams)")
        jobs = 1
    count = samples.count
    if count is not None:
        jobs = plan_jobs(jobs, count, n_cores)
    streams = plan_streams(streams, count, jobs, n_cores)
    prepared = prepare(model, detail, tensors)
    written = _fetching(prepared, samples, tensors, detail, jobs, streams)
    if written is not None:
        with _progress(count, show_progress, on_progress) as set_done:
            return _calibrated_fetched(model, prepared, samples, written, streams, n_cores, set_done)
    # Given cores (a Ray task's share of a machine) are shared out even to one run.
    threads = session_threads(jobs * streams) if n_cores is None else max(1, n_cores // (jobs * streams))
    if jobs == 1:
        folding = Folding(prepared, threads)
        with _progress(count, show_progress, on_progress) as set_done:
            done = _Tally(set_done)
            # Sample 0 runs alone: it settles which tensors get the detail, so the streams
            # start on the session they keep.
            for feed in samples.iter_range(0, 1):
                folding.add(feed, 0)
                done()
            if done.value == 0:
                raise NpuprepError("calibration: the sample stream gave no sample")
            acc = folding.acc
            # A stream is read to its end, whatever length it claimed.
            stop = count if isinstance(samples, SampleSet) else None
            acc.merge(fold_streams(folding, samples, 1, stop, streams, done))
        inst = folding.inst
    else:
        # Settled before forking: a fork must not copy a thread in the middle of its work.
        _ = model.fingerprint
        # The rows are the same in every variant of the graph: the settled one names them.
        acc, inst = _fold_parallel(prepared, samples, jobs, streams, threads, show_progress, on_progress)
    stats = {}
    keys = _keys(inst)
    scope = inst.scope
    for i, slot in enumerate(inst.slots):
        stats[keys[i]] = acc.row(i, slot.tensor, slot.scope, slot.node, scope, slot.narrow)
    row_of = {slot.tensor: i for i, slot in enumerate(inst.slots)}
    for tensor, root in inst.alias_of.items():
        slot = inst.aliases[tensor]
        stats[tensor] = acc.row(row_of[root], slot.tensor, slot.scope, slot.node, scope,
                                inst.slots[row_of[root]].narrow)
    return CalibrationStats(
        fingerprint=model.fingerprint, samples=samples.describe(), synthetic=samples.synthetic,
        sample_count=acc.samples, detail=detail, tensors=stats, unobserved=dict(inst.unobserved),
        sample_ids=samples.sample_ids(), source=samples.source_info(),
    )


def _fetching(prepared: Prepared, samples: SampleSet | FeedStream, tensors: Collection[str] | None,
              detail: str, jobs: int, streams: int) -> dict[str, str] | None:
    """The tensors a calibration fetches and bins in numpy (tensor -> its writer's label,
    npuprep.calibrate.fetched), or None where it runs the instrumented graph: with every
    rule's detail only (the in-graph histogram costs ~60 ns an element, the numpy one a
    fraction; "auto" details few elements), in one process, main-graph float32 tensors; every
    tensor only from files (sample 0 read to size them) where they fit (fetched.fits)."""
    if detail != "all" or jobs != 1:
        return None
    if tensors is not None:
        return fetchable(prepared.graph, tensors)
    written = fetchable(prepared.graph, None) if isinstance(samples, SampleSet) and len(samples) else None
    if written is None or not fits(prepared.graph, written, next(samples.iter_range(0, 1)), streams):
        return None
    return written


def _calibrated_fetched(model: Model, prepared: Prepared, samples: SampleSet | FeedStream,
                        written: dict[str, str], streams: int, n_cores: int | None,
                        set_done: Callable[[int], None]) -> CalibrationStats:
    """The statistics of main-graph float32 tensors (`written`: tensor -> the label of its
    writer) with every rule's detail, from their values fetched and binned in numpy
    (npuprep.calibrate.fetched): the rows the instrumented graph gives, without its ~60 ns an
    element of histogram. The session is built as the instrumented one is (prepacked weights,
    every optimisation, a thread a stream), so the values are those it reads. `set_done`:
    the count of samples done, as it grows."""
    from npuprep.runtime.session import run_in_streams

    names = list(written)
    threads = session_threads(streams) if n_cores is None else max(1, n_cores // streams)
    session = prepared.session(with_outputs(prepared.graph, names), threads)
    acc = Accumulator(len(names))
    # A stream is read to its end, whatever length it claimed.
    stop = samples.count if isinstance(samples, SampleSet) else None
    for index, out in enumerate(run_in_streams(session, samples.iter_range(0, stop), names, streams)):
        rows = [row_of(out[t]) for t in names]
        acc.add(np.array([r[0] for r in rows]), np.array([r[1] for r in rows]),
                np.concatenate([r[2] for r in rows]), index)
        set_done(index + 1)
    if acc.samples == 0:
        raise NpuprepError("calibration: the sample stream gave no sample")
    scope = scope_of("all")
    return CalibrationStats(
        fingerprint=model.fingerprint, samples=samples.describe(), synthetic=samples.synthetic,
        sample_count=acc.samples, detail="all",
        tensors={t: acc.row(i, t, "main", written[t], scope) for i, t in enumerate(names)},
        sample_ids=samples.sample_ids(), source=samples.source_info(),
    )


@contextmanager
def _progress(
    total: int | None, show: bool, on_progress: Callable[[int], None] | None
) -> Iterator[Callable[[int], None]]:
    """A setter of the count of samples done: the progress bar's, and `on_progress`."""
    with progress_counter(total, "calibrating", show) as set_done:
        if on_progress is None:
            yield set_done
            return

        def both(done: int) -> None:
            set_done(done)
            on_progress(done)

        yield both


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# With jobs=0, one process per core only when each gets at least this many samples: below,
# forking and the first sample settled alone cost more than the other cores gain (benchmark,
# 2 cores: at 8 samples two processes were slower than one, at 32 about even, at 128
# 1.2-1.4x plain against 1.5x).
SAMPLES_PER_JOB = 32


def plan_jobs(jobs: int, count: int, n_cores: int | None = None) -> int:
    """Processes for `count` samples: `jobs`, at most one per sample; 0 means one per core
    (one thread each, so they share one session: see _fold_parallel) when every process gets
    at least SAMPLES_PER_JOB samples, else one. 1 where processes cannot be forked."""
    if jobs < 0:
        raise NpuprepError(f"jobs must be at least 0 (0: one per core), got {jobs}")
    if jobs == 0:
        n = n_cores or cores()
        jobs = n if count >= SAMPLES_PER_JOB * n else 1
    jobs = max(1, min(jobs, count))
    if jobs > 1:
        import multiprocessing as mp

        if "fork" not in mp.get_all_start_methods():
            return 1
    return jobs


# With streams=0, one stream per core of the process only when each gets at least this many
# samples: sample 0 runs alone on one thread first (it settles the session the streams share).
SAMPLES_PER_STREAM = 4


def plan_streams(streams: int, count: int | None, jobs: int = 1, n_cores: int | None = None) -> int:
    """Samples in flight at once in each of `jobs` processes: `streams`, at most one per sample
    of the process; 0 means one per core of the process when each stream gets at least
    SAMPLES_PER_STREAM samples, else one (whose session then runs on all those cores).
    A count of None (a stream of unknown length) is taken as plenty."""
    if streams < 0:
        raise NpuprepError(f"streams must be at least 0 (0: one per core), got {streams}")
    per_job = math.inf if count is None else -(-count // max(1, jobs))
    if streams == 0:
        n = max(1, (n_cores or cores()) // max(1, jobs))
        streams = n if per_job >= SAMPLES_PER_STREAM * n else 1
    return int(max(1, min(streams, per_job)))


def pass_streams(count: int, n_cores: int | None = None) -> int:
    """Samples run at once by a pass over a few samples of a QDQ or instrumented graph (the
    8-bit conversion's measurements), each stream on a session of one thread: one per core,
    at most one per sample, one under a memory budget. Such a graph is thousands of small
    kernels, which a second thread of one run mostly waits on: dnsmos_p835's all-INT8 model,
    4 samples, 3.5 CPU s on two threads a run, 2.3 one thread a run two runs at once, its
    outputs bit for bit the same (a kernel that splits a sum over threads adds in another
    order: ppocr_det's reference moved its rel L2 by 1.7e-4 relative); plan_streams gives a
    stream only from 4 samples each."""
    from npuprep.resources import budget

    return 1 if budget() is not None else max(1, min(count, n_cores or cores()))


def session_threads(runs: int, n_cores: int | None = None) -> int | None:
    """Intra-op threads per session for `runs` sessions running at once (processes times
    streams): onnxruntime's default (every core) for one, else the cores shared out, so the
    runs do not oversubscribe them."""
    return None if runs == 1 else max(1, (n_cores or cores()) // runs)


@dataclass(frozen=True)
class Prepared:
    """A model ready for instrumented sessions, its weights held by Python at most once.

    A graph whose large initialisers are external references (into the model file itself or
    a data file, see load_model's weights="file") is instrumented without them and written
    next to the files holding them (`folder`) for each session, so onnxruntime reads the
    weights from disk and Python never holds them. Any other graph is a weightless skeleton
    and onnxruntime gets `weights` as arrays. Peak memory stays near a plain session's."""

    graph: onnx.ModelProto
    weights: dict[str, np.ndarray]
    folder: Path | None
    detail: str
    # The user's file, named when onnxruntime refuses the graph.
    source: str = ""
    only: frozenset[str] | None = None  # the tensors observed (None: every float tensor)

    def open(
        self, threads: int | None, detailed: Collection[str] | None, nan_checked: Collection[str] | None = None,
        lean: Collection[str] = (), prepack: bool = True,
    ) -> tuple[Instrumented, object]:
        """The graph instrumented (detail for `detailed` only, lean for `lean`, the L1 pass
        skipped where it can be but for `nan_checked`; see instrument) and a session, with
        prepacked weights unless `prepack` is False."""
        inst = instrument(self.graph, detail=self.detail, detailed=detailed, nan_checked=nan_checked, lean=lean,
                          only=self.only)
        return inst, self.session(inst.model, threads, prepack)

    def session(self, graph: onnx.ModelProto, threads: int | None, prepack: bool = True) -> object:
        """A session of `graph` (this model's graph, with nodes or outputs added) on this
        model's weights, every optimisation on."""
        from npuprep.runtime.session import make_session_external

        if self.folder is None:
            return make_session_external(graph, self.weights, threads=threads, optimize="all",
                                         prepack=prepack, source=self.source or None)
        fd, name = tempfile.mkstemp(prefix=".npuprep-calibrate-", suffix=".onnx", dir=self.folder)
        os.close(fd)
        try:
            # Bytes, not onnx.save_model: that writes any raw_data an external tensor holds
            # into the tensor's data file, which may be the input model itself.
            Path(name).write_bytes(graph.SerializeToString())
            return make_session_external(name, threads=threads, optimize="all", prepack=prepack,
                                         source=self.source or None)
        finally:
            os.unlink(name)


def prepare(model: Model, detail: str, only: Collection[str] | None = None) -> Prepared:
    """Ready `model` for instrumented sessions, its weights left on disk for onnxruntime
    to read wherever it can.

    A model whose large initialisers are external references (a light load, or external
    data not read in) is used as it is. A model with its weights in memory whose file keeps
    them in a data file is replaced by the file's light graph (such a proto may be too big
    to serialise). The graphs go where the data files really are (see external_home). Any
    other model, and any whose data files lie apart or in a folder that is not writable,
    hands onnxruntime its weights as arrays, those stored externally read from disk.
    `only`: the tensors to observe (default: every float tensor).
    """
    from npuprep.bf16 import has_bf16
    from npuprep.model_io import external_home, external_locations, light_proto, uses_external_data
    from npuprep.runtime.session import split_weights

    path = Path(model.path) if model.path else None
    folder = path.parent if path is not None and path.is_file() else None
    if folder is not None and not has_bf16(model.proto):
        graph = model.proto if uses_external_data(model.proto) else light_proto(path)
        if graph is model.proto or external_locations(graph) - {path.name}:
            found = external_home(graph, folder)
            if found is not None and os.access(found[1], os.W_OK):
                return Prepared(_working(found[0], model), {}, found[1], detail, model.path,
                                frozenset(only) if only is not None else None)
    skeleton, weights = split_weights(model.proto, folder)
    return Prepared(_working(skeleton, model), weights, None, detail, model.path,
                    frozenset(only) if only is not None else None)


def _working(graph: onnx.ModelProto, model: Model) -> onnx.ModelProto:
    """The weightless graph at the opset the statistics nodes are written for (an older
    model's graph is upgraded; tensor names, and so the statistics, are unchanged)."""
    return at_least(graph, WORKING_OPSET,
                    why=f"{model.path or 'model'}: calibrating opset {model.opset}")[0]


def _keys(inst: Instrumented) -> list[str]:
    """Tensor names, scope-qualified only where a body reuses a name."""
    seen: dict[str, int] = {}
    for s in inst.slots:
        seen[s.tensor] = seen.get(s.tensor, 0) + 1
    return [s.tensor if seen[s.tensor] == 1 else f"{s.scope}/{s.tensor}" for s in inst.slots]


class Folding:
    """Samples run through instrumented sessions and folded into one Accumulator.

    With detail "auto" (or "fp16") the first session details no tensor (creating the detail branches is
    most of a session's start-up, and few tensors need them) and skips the L1 pass wherever
    the inputs' rows can prove a tensor NaN-free. A sample that flags a tensor runs again
    on a session that details it, and every tensor whose abs-max in that sample lies near
    the ordinary range's edges, so later samples rarely flag another; a sample where that
    proof fails runs again with the L1 on the tensors concerned. A flagged tensor first gets
    the lean detail (no If, see detail.lean_detail_nodes) unless the sample already shows it
    needs the full one; a lean row that flags gets the full detail. Only rows from
    a run without flags are folded in: the statistics are those of a graph that details
    every tensor.
    """

    def __init__(self, prepared: Prepared, threads: int | None, settled: Folding | None = None) -> None:
        """`settled`: start from what another Folding has learnt (which tensors get the detail,
        the lean detail, the L1 pass) instead of from nothing."""
        self.prepared, self.threads = prepared, threads
        on_demand = prepared.detail != "all"
        self.detailed: frozenset[str] | None = frozenset() if on_demand else None
        self.nan_checked: frozenset[str] | None = frozenset() if on_demand else None
        self.lean: frozenset[str] = frozenset()
        if settled is not None:
            self.detailed, self.nan_checked, self.lean = settled.detailed, settled.nan_checked, settled.lean
        # The first session that details nothing only finds which tensors need what: it is
        # built without prepacked weights (most of a build: benchmark transformer 0.15 of
        # 0.24 s), since sample 0 usually shows it must be rebuilt with the detail, and its
        # rows are never kept. Every statistic comes from a session with prepacked weights,
        # as plain inference's: their MatMul kernels round differently, by an ulp or so. It
        # runs sample 0 alone, so on every core.
        self.prepacked = not on_demand or settled is not None
        # The instrumented graph and its session, replaced together (see measure).
        self.opened: tuple[Instrumented, object] | None = prepared.open(
            threads if self.prepacked else None, self.detailed, self.nan_checked, self.lean, prepack=self.prepacked)
        self._reopening = threading.Lock()
        self.acc = Accumulator(len(self.inst.slots))

    @property
    def inst(self) -> Instrumented:
        assert self.opened is not None, "no session: rebuilding it failed"
        return self.opened[0]

    def add(self, feed: dict[str, np.ndarray], index: int, acc: Accumulator | None = None) -> None:
        """Fold sample `index` into `acc` (default: this Folding's own)."""
        fx, fn, ii = self.measure(feed)
        (self.acc if acc is None else acc).add(fx.astype(np.float64), fn.astype(np.float64), ii, index)

    def measure(self, feed: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One sample's FX, FN and I outputs from a run that flagged nothing.

        Safe from several threads at once: each run takes the session current when it starts;
        a session is replaced under a lock, and a run whose session another thread replaced
        meanwhile goes again on the new one instead of replacing it a second time."""
        from npuprep.runtime.session import run

        while True:
            with self._reopening:
                opened = self.opened
            if opened is None:
                raise NpuprepError("calibration: another stream failed to rebuild the session")
            inst, session = opened
            out = run(session, feed, inst.outputs)
            fx, fn, ii, l1 = inst.read([out[name] for name in inst.outputs])
            rows = ii.reshape(-1, WIDTH)
            rows[~inst.ordinary(fx, fn, rows, l1), _DETAILED] = FLAGGED
            flagged = rows[:, _DETAILED] < 0
            if self.detailed is None or self.nan_checked is None:
                return fx, fn, ii
            # Every row is exact or ordinary once nothing is flagged, but rows proven NaN-free
            # only by inputs that turn out not finite get the L1 (and the detail) on a rerun.
            unsure = None if flagged.any() else _unsure(inst, fx, fn, rows)
            if unsure is not None and not unsure.any() and self.prepacked:
                return fx, fn, ii
            with self._reopening:
                if self.opened is not opened:
                    continue
                if unsure is None:
                    absmax, (lo, hi) = np.fmax(fx, -fn), inst.ranges
                    edge = ~((absmax >= _EDGE * lo) & (absmax <= hi / _EDGE))
                    # A tensor outside the range gets the lean detail (in every sample) unless
                    # this sample shows a NaN or Inf, or |x| above a format's max; one only near
                    # the edges gets the full detail behind its If (it runs only when needed); a
                    # lean row that flagged needed what only the full detail has.
                    plain = np.isfinite(l1) & (absmax <= inst.scope.smallest_max)
                    fresh = self._tensors(flagged & plain) - self.detailed
                    self.lean = (self.lean - self._tensors(flagged)) | fresh
                    self.detailed |= self._tensors(flagged | edge)
                elif unsure.any():
                    named = self._tensors(unsure)
                    self.detailed |= named
                    self.nan_checked |= named
                # (Neither: a first session that needs nothing more but its prepacked weights.)
                # Freed before the next one is built (unless another stream still runs on it):
                # one session's memory at a time.
                opened = session = self.opened = None
                self.prepacked = True
                self.opened = self.prepared.open(self.threads, self.detailed, self.nan_checked, self.lean)

    def _tensors(self, rows: np.ndarray) -> frozenset[str]:
        """The tensors of the rows where `rows` (a mask over the slots) is True."""
        return frozenset(self.inst.slots[i].tensor for i in np.flatnonzero(rows))


def _unsure(inst: Instrumented, fx: np.ndarray, fn: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rows without the L1 pass that this sample cannot prove NaN-free: some float input (or
    an input's input, through other such rows) held a NaN or an Inf."""
    suspect = ~np.isfinite(fx) | ~np.isfinite(fn) | (rows[:, _NAN] > 0) | (rows[:, _NONFINITE_BIN] > 0)
    unsure = np.zeros(len(suspect), bool)
    for i in sorted(inst.nan_inputs):
        if any(suspect[j] for j in inst.nan_inputs[i]):
            unsure[i] = suspect[i] = True
    return unsure


# Columns of the "detailed" and NaN counts and of the Inf/NaN histogram bin; abs-max within
# this factor of LO or HI is near the edge (measured on the benchmark transformer: 2 settles
# in one reopen, 4 details 3x the tensors).
_DETAILED = HEADER.index("detailed")
_NAN = HEADER.index("nan")
_NONFINITE_BIN = WIDTH - 1
_EDGE = 2.0


class _Tally:
    """Samples done, counted from any stream, shown through `show` (a progress bar's setter)."""

    def __init__(self, show: Callable[[int], None]) -> None:
        self.value, self._show, self._lock = 0, show, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.value += 1
            self._show(self.value)


def fold_streams(
    folding: Folding, samples: SampleSet | FeedStream, start: int, stop: int | None, streams: int,
    done: Callable[[], None],
) -> Accumulator:
    """Samples start..stop-1 (to the end of a stream with None) folded by `streams` threads at once, all on `folding`'s session
    (onnxruntime runs one session from several threads, each run on the session's own thread
    count), each thread into its own Accumulator, merged at the end. The samples are read one
    at a time and in order, by whichever stream is free; the first error stops every stream
    after its current sample and is the one raised."""
    feeds = enumerate(samples.iter_range(start, stop), start)
    taking = threading.Lock()
    errors: list[BaseException] = []
    # Read once: a stream may be rebuilding the session (inst) while another starts.
    rows = len(folding.inst.slots)

    def stream() -> Accumulator:
        acc = Accumulator(rows)
        try:
            while not errors:
                with taking:
                    item = next(feeds, None)
                if item is None:
                    break
                folding.add(item[1], item[0], acc)
                done()
        except BaseException as exc:
            errors.append(exc)
        return acc

    if streams == 1:
        parts = [stream()]
    else:
        parts = []  # in any order: merging is associative and commutative
        threads = [threading.Thread(target=lambda: parts.append(stream()), name=f"npuprep-stream-{i}")
                   for i in range(streams)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        except BaseException as exc:  # Ctrl-C here: the streams stop after their sample
            errors.insert(0, exc)
            for t in threads:
                t.join()
    if errors:
        raise errors[0]
    acc, *others = parts
    for part in others:
        acc.merge(part)
    return acc


# The forked worker's inherited state, set once per process by _start_worker.
_worker_state: dict[str, object] = {}


def _start_worker(settled: Folding, samples: SampleSet, shared: bool, streams: int, done: object) -> None:
    """Runs in each forked worker: the parent's settled Folding, the samples and the shared
    count of samples done are inherited (copy on write, not pickled). With `shared`, the
    worker runs on the parent's session itself, weights included; else it builds its own
    from what the parent settled."""
    # Ctrl-C reaches every process of the terminal's group: the parent alone handles it and
    # ends the workers; SIGTERM ends a worker silently (it inherited the parent's handler,
    # whose KeyboardInterrupt would print a traceback per worker).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    folding = settled if shared else Folding(settled.prepared, settled.threads, settled=settled)
    _worker_state.update(folding=folding, samples=samples, streams=streams, done=done)


def _fold_range(bounds: tuple[int, int]) -> Accumulator:
    folding: Folding = _worker_state["folding"]  # type: ignore[assignment]
    samples: SampleSet = _worker_state["samples"]  # type: ignore[assignment]
    done = _worker_state["done"]

    def count_one() -> None:
        with done.get_lock():  # type: ignore[attr-defined]
            done.value += 1  # type: ignore[attr-defined]

    return fold_streams(folding, samples, *bounds, _worker_state["streams"], count_one)  # type: ignore[arg-type]


def _fold_parallel(
    prepared: Prepared, samples: SampleSet, jobs: int, streams: int, threads: int | None, show_progress: bool = False,
    on_progress: Callable[[int], None] | None = None,
) -> tuple[Accumulator, Instrumented]:
    """Sample 0 runs here first and settles which tensors get the detail; forked workers then
    fold contiguous ranges of the other samples, `streams` at a time, merged in sample order.

    A session on one thread has no thread pool, so the workers run on this process's session
    itself: its weights (prepacked by onnxruntime) are shared copy on write instead of built
    once per worker, and no worker builds a session unless a sample flags a new tensor. A
    session with a pool must not cross a fork (its threads would not), so with more threads
    each worker builds its own from the settled sets and this one is dropped first."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    folding = Folding(prepared, threads)
    folding.add(next(samples.iter_range(0, 1)), 0)
    acc = folding.acc
    shared = threads == 1
    inst = folding.inst
    if not shared:
        folding.opened = None
    edges = np.linspace(1, len(samples), jobs + 1).astype(int)
    ranges = [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]
    context = mp.get_context("fork")
    done = context.Value("i", 1)  # sample 0, folded here
    try:
        with ProcessPoolExecutor(
            max_workers=len(ranges) or 1, mp_context=context, initializer=_start_worker,
            initargs=(folding, samples, shared, streams, done),
        ) as pool:
            try:
                futures = [pool.submit(_fold_range, r) for r in ranges]
                # The bar (a drawing thread on a terminal) starts once the workers are forked.
                with _progress(len(samples), show_progress, on_progress) as set_done:
                    while wait(futures, timeout=0.2).not_done:
                        set_done(done.value)
                    set_done(done.value)
                parts = [f.result() for f in futures]
            except KeyboardInterrupt:
                # Else leaving the pool would wait for every range to finish.
                for process in list((pool._processes or {}).values()):
                    process.terminate()
                raise
    except BrokenProcessPool:
        raise NpuprepError(f"calibration: a worker process died (out of memory with {jobs} jobs?)") from None
    for part in parts:
        acc.merge(part)
    return acc, inst
