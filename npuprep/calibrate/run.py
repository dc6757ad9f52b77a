"""calibrate(model, samples) -> CalibrationStats: stream samples through the instrumented graph."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper

from npuprep.calibrate.instrument import Instrumented, instrument
from npuprep.calibrate.stats import Accumulator, CalibrationStats
from npuprep.data import SampleSet
from npuprep.errors import NpuprepError
from npuprep.model_io import PROTOBUF_LIMIT, Model


def calibrate(
    model: Model,
    samples: SampleSet,
    *,
    jobs: int = 1,
    show_progress: bool = False,
    detail: str = "auto",
) -> CalibrationStats:
    """Range statistics of every float tensor over `samples` (see npuprep.calibrate.instrument).

    Samples stream one at a time and merge associatively, so memory does not grow with their
    number; `jobs` > 1 splits the samples into contiguous ranges, one process each.
    """
    if model.opset < 13:
        raise NpuprepError(f"{model.path or 'model'}: calibration needs opset >= 13 (model has {model.opset})")
    count = len(samples)
    jobs = max(1, min(jobs, count))
    with _instrumented(model, detail) as (inst, source):
        if jobs == 1:
            acc = _run_range(source, inst, samples, 0, count, show_progress, threads=None)
        else:
            acc = _run_parallel(source, inst, samples, jobs)
    stats = {}
    names = [s.tensor for s in inst.slots]
    keys = _keys(inst)
    for i, slot in enumerate(inst.slots):
        stats[keys[i]] = acc.row(i, slot.tensor, slot.scope, slot.node)
    row_of = {name: i for i, name in enumerate(names)}
    for tensor, root in inst.alias_of.items():
        slot = inst.aliases[tensor]
        stats[tensor] = acc.row(row_of[root], slot.tensor, slot.scope, slot.node)
    return CalibrationStats(
        fingerprint=model.fingerprint, samples=samples.describe(), synthetic=samples.synthetic,
        sample_count=count, detail=detail, tensors=stats, unobserved=dict(inst.unobserved),
    )


@contextmanager
def _instrumented(model: Model, detail: str) -> Iterator[tuple[Instrumented, onnx.ModelProto | str]]:
    """The instrumented model and what a session is made from.

    A model whose weights live in external data is instrumented without loading them: the
    instrumented graph is written next to the model (so the data file resolves) and the
    session maps the weights from disk, instead of copying gigabytes in memory.
    """
    path = Path(model.path) if model.path else None
    if path is not None and path.is_file():
        light = onnx.load(str(path), load_external_data=False)
        if any(t.data_location == onnx.TensorProto.EXTERNAL for t in external_data_helper._get_all_tensors(light)):
            inst = instrument(light, detail=detail)
            try:
                fd, name = tempfile.mkstemp(prefix=f".{path.stem}.npuprep-calibrate-", suffix=".onnx", dir=path.parent)
                os.close(fd)
            except OSError:
                name = None
            if name is not None:
                try:
                    onnx.save_model(inst.model, name)
                    yield inst, name
                finally:
                    os.unlink(name)
                return
    inst = instrument(model.proto, detail=detail)
    yield inst, inst.model


def _keys(inst: Instrumented) -> list[str]:
    """Tensor names, scope-qualified only where a body reuses a name."""
    seen: dict[str, int] = {}
    for s in inst.slots:
        seen[s.tensor] = seen.get(s.tensor, 0) + 1
    return [s.tensor if seen[s.tensor] == 1 else f"{s.scope}/{s.tensor}" for s in inst.slots]


def _run_range(
    source: onnx.ModelProto | str,
    inst: Instrumented,
    samples: SampleSet,
    start: int,
    stop: int,
    show_progress: bool,
    threads: int | None,
) -> Accumulator:
    from npuprep.cli.common import progress
    from npuprep.runtime.session import make_session

    session = make_session(source, threads=threads, optimize="all")
    feeds = progress(samples.iter_range(start, stop), stop - start, "calibrating", show_progress)
    return fold(session, inst, feeds, start)


def fold(session: object, inst: Instrumented, feeds: Iterable[dict[str, np.ndarray]], start: int = 0) -> Accumulator:
    """Run each feed through the instrumented session and fold its statistics in."""
    from npuprep.runtime.session import run

    acc = Accumulator(len(inst.slots))
    for index, feed in enumerate(feeds, start):
        out = run(session, feed, inst.outputs)
        fx, fn, ii = (out[name] for name in inst.outputs)
        acc.add(np.asarray(fx, np.float64), np.asarray(fn, np.float64), np.asarray(ii), index)
    return acc


def _worker(args: tuple[onnx.ModelProto | str, Instrumented, SampleSet, int, int, int]) -> Accumulator:
    path, inst, samples, start, stop, threads = args
    return _run_range(path, inst, samples, start, stop, False, threads)


def _run_parallel(
    source: onnx.ModelProto | str, inst: Instrumented, samples: SampleSet, jobs: int
) -> Accumulator:
    """One process per contiguous sample range; the instrumented model goes through a file."""
    count = len(samples)
    bounds = np.linspace(0, count, jobs + 1).astype(int)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    # The workers read the graph from a file, not through pickling.
    light = Instrumented(onnx.ModelProto(), inst.outputs, inst.slots, inst.aliases, inst.alias_of, inst.unobserved)
    with tempfile.TemporaryDirectory(prefix="npuprep-cal-") as tmp:
        if not isinstance(source, str):
            path = Path(tmp) / "instrumented.onnx"
            big = source.ByteSize() > PROTOBUF_LIMIT - 64 * 2**20
            onnx.save_model(source, str(path), save_as_external_data=big, location="instrumented.onnx.data")
            source = str(path)
        work = [(source, light, samples, int(a), int(b), threads) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            parts = list(pool.map(_worker, work))
    acc = parts[0]
    for part in parts[1:]:
        acc.merge(part)
    return acc
