"""Trials of the 8-bit search that stop once their answer is known, bit for bit the answer of
the trials run whole (npuprep.verify.qdq_trials.Trials: one session, a run per sample).

A trial's error is its outputs' worst rel L2 pooled over the trial samples: the squared
errors summed over the squared references. The references are known before any trial runs,
and the squared errors only add, so after some of the samples the sum so far over every
sample's squared references is a lower bound of the final error (PooledSums). Where the
question is "is it under this bound" (the Conv balancing: does a tensor's readers' error fall
with balancing) or "which of these errs least" (the rule choice: each activation's readers
alone at each rule), a trial whose lower bound already answers it stops: its remaining
samples are not run. The trials still in the running run a sample at a time, as batches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from npuprep.scale_rules import ScaleRule
from npuprep.verify.output_errors import PooledSums, reference_squares, worst_pooled_rel_l2

Trial = tuple[Mapping[str, str], Mapping[str, ScaleRule]]  # layer -> format, tensor -> rule


class Runs(Protocol):
    """What these read of npuprep.verify.qdq_trials.Trials (which calls them)."""

    score: Callable[..., float]
    expected: list[dict[str, np.ndarray]]
    runs: int
    trial_samples: int  # the samples a trial's error is measured on
    batch_runs: int  # the runs handed to the runner at once

    def errors(self, trials: Sequence[Trial]) -> list[float]: ...
    def switches(self, assign: Mapping[str, str], rules: Mapping[str, ScaleRule]) -> dict[str, Any]: ...
    def remember(self, switches: Mapping[str, Any], error: float) -> None: ...
    def run_on(self, sample: int, feeds: Sequence[Mapping[str, Any]]) -> list[dict[str, np.ndarray]]: ...


@dataclass
class _Partial:
    """A trial run a sample at a time: its switches, the samples it ran, their sums."""

    feed: dict[str, np.ndarray]
    ran: int = 0
    sums: PooledSums = field(default_factory=PooledSums)

    def error(self, count: int, squares: Mapping[str, float]) -> float:
        """Its error where it ran all `count` samples, else the lower bound so far."""
        return self.sums.worst() if self.ran == count else self.sums.worst(squares)


def errors_within(trials: Runs, asked: Sequence[Trial], bounds: Sequence[float]) -> list[float]:
    """Each trial's error as `trials.errors` gives it where that is at most its bound, else a
    lower bound past it: a trial whose errors so far already pass its bound stops. Under
    another score than the outputs' worst pooled rel L2, every trial runs whole."""
    if trials.score is not worst_pooled_rel_l2:
        return trials.errors(asked)
    runs = [_Partial(trials.switches(a, r)) for a, r in asked]
    count = trials.trial_samples
    squares = reference_squares(trials.expected[:count])
    _advance(trials, runs, squares, range(count), lambda i, low: low <= bounds[i])
    return [r.error(count, squares) for r in runs]


def least_errors(trials: Runs, groups: Sequence[Sequence[Trial]], *, keep_bytes: int = 0
                 ) -> list[tuple[int, float, list[dict[str, np.ndarray]] | None]]:
    """Per group of trials, the index of the one erring least (the first of equals), its
    error as `trials.errors` gives it, and its outputs where `keep_bytes` held them. Each
    trial runs the first sample, the group's least there the rest, the others a sample at a
    time while their errors so far stay under the least's (as errors_within)."""
    flat = [t for g in groups for t in g]
    if trials.score is not worst_pooled_rel_l2:
        found = iter(trials.errors(flat))
        errors = [[next(found) for _ in g] for g in groups]
        return [(min(range(len(e)), key=e.__getitem__), min(e), None) for e in errors]
    group_of = [k for k, g in enumerate(groups) for _ in g]
    runs = [_Partial(trials.switches(a, r)) for a, r in flat]
    n = trials.trial_samples
    squares = reference_squares(trials.expected[:n])
    # The outputs of the trials still in the running, held while there is room.
    held: dict[int, list[dict[str, np.ndarray]]] = {}
    room = [keep_bytes]

    def hold(i: int, sample: int, got: dict[str, np.ndarray]) -> None:
        size = sum(np.asarray(v).nbytes for v in got.values())
        if size > room[0]:
            drop(i)
        elif sample == 0 or i in held:
            room[0] -= size
            held.setdefault(i, []).append(got)

    def drop(i: int) -> None:
        room[0] += sum(np.asarray(v).nbytes for o in held.pop(i, []) for v in o.values())

    keep = hold if keep_bytes else None
    _advance(trials, runs, squares, range(1), lambda i, low: True, seen=keep)
    leads: dict[int, int] = {}
    for i, k in enumerate(group_of):
        if k not in leads or runs[i].sums.worst(squares) < runs[leads[k]].sums.worst(squares):
            leads[k] = i
    chosen = set(leads.values())
    _advance(trials, runs, squares, range(1, n), lambda i, low: i in chosen, seen=keep)
    best = {k: (runs[i].error(n, squares), i) for k, i in leads.items()}

    def within(i: int, low: float) -> bool:
        error, lead = best[group_of[i]]
        if low < error or (low == error and i < lead):
            return True
        drop(i)
        return False

    def finished(i: int) -> None:
        best[group_of[i]] = min(best[group_of[i]], (runs[i].error(n, squares), i))

    _advance(trials, runs, squares, range(1, n), within, seen=keep, done=finished)
    start = [group_of.index(k) for k in range(len(groups))]
    return [(i - start[k], error, held[i] if len(held.get(i, [])) == n else None)
            for k, (error, i) in sorted(best.items())]


def _advance(trials: Runs, runs: list[_Partial], squares: Mapping[str, float], samples: range,
             go: Callable[[int, float], bool], *,
             seen: Callable[[int, int, dict[str, np.ndarray]], None] | None = None,
             done: Callable[[int], None] | None = None) -> None:
    """Each of `samples` in turn, run by the trials that ran every one before it and
    `go(i, the lower bound of its error so far)`; `seen(i, sample, outputs)` after each run,
    `done(i)` once trial i ran all (its error kept, as `errors` keeps it)."""
    n = trials.trial_samples
    for sample in samples:
        todo = [i for i, r in enumerate(runs) if r.ran == sample and go(i, r.sums.worst(squares))]
        trials.runs += len(todo) if sample == 0 else 0
        for at in range(0, len(todo), trials.batch_runs):
            chunk = todo[at:at + trials.batch_runs]
            got = trials.run_on(sample, [runs[i].feed for i in chunk])
            for i, outputs in zip(chunk, got, strict=True):
                runs[i].sums.add(outputs, trials.expected[sample])
                runs[i].ran += 1
                if seen is not None:
                    seen(i, sample, outputs)
                if runs[i].ran == n:
                    trials.remember(runs[i].feed, runs[i].error(n, squares))
                    if done is not None:
                        done(i)
