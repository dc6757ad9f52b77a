"""`calibrate(model, samples, executor=...)`: the samples run here (threads, forked processes) or as Ray tasks."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from npuprep.calibrate.on_ray import calibrate_on_ray
from npuprep.calibrate.run import calibrate_here
from npuprep.calibrate.stats import CalibrationStats
from npuprep.data import Feed, SampleSet
from npuprep.errors import NpuprepError
from npuprep.model_io import Model


def calibrate(
    model: Model,
    samples: SampleSet | Iterable[Feed],
    *,
    jobs: int = 1,
    streams: int = 0,
    show_progress: bool = False,
    detail: str = "auto",
    executor: str = "local",
    address: str | None = None,
    n_cores: int | None = None,
    on_progress: Callable[[int], None] | None = None,
    tensors: Collection[str] | None = None,
) -> CalibrationStats:
    """Range statistics of every float tensor over `samples` (npuprep.calibrate.run.calibrate_here
    says how they run on this machine), or of `tensors` only (here, not on Ray: a pass that
    fills in a few). `executor="ray"` runs shards of a SampleSet as Ray tasks, on a local Ray
    or, with `address`, a cluster (npuprep.calibrate.on_ray)."""
    if executor == "ray":
        if tensors is not None:
            raise NpuprepError("executor='ray' calibrates every tensor: tensors= runs here")
        if jobs not in (0, 1):
            raise NpuprepError(f"executor='ray' runs one process per shard: jobs={jobs} does not apply")
        return calibrate_on_ray(model, samples, address=address, detail=detail, streams=streams,
                                show_progress=show_progress)
    if executor != "local":
        raise NpuprepError(f"unknown executor {executor!r} (use 'local' or 'ray')")
    from npuprep.runtime.session import release_freed_memory

    try:
        stats = calibrate_here(model, samples, jobs=jobs, streams=streams, show_progress=show_progress,
                               detail=detail, n_cores=n_cores, on_progress=on_progress, tensors=tensors)
    except NpuprepError:
        raise
    except Exception:
        # The instrumented graph failed: the user's model, where it fails alone on the first
        # sample (onnxruntime cannot run one of its nodes), else npuprep's statistics nodes.
        if isinstance(samples, SampleSet) and model.path:
            from npuprep.runtime.session import check_runs

            check_runs(model.proto, next(iter(samples.iter_range(0, 1))), model.path)
        raise
    release_freed_memory()  # the next stage starts from what the statistics need
    return stats
