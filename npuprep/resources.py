"""What a run costs the machine: its peak resident memory (whole run and per stage), its wall
and CPU time (whole run and per stage), and a memory budget (`--max-memory`) that it respects
or stops at, with nothing written.

    with MemoryWatch(budget=parse_size("4G", "--max-memory")) as watch:
        watch.stage("lowering")  ...
    watch.to_dict() -> {"wall_s": 19.8, "cpu_s": 31.2, "peak_rss_mb": 1967,
                        "stage_seconds": {"lowering": {"wall_s": 2.1, "cpu_s": 3.9}, ...}, ...}
"""

from __future__ import annotations

import _thread
import re
import resource
import sys
import threading
import time
from types import TracebackType
from typing import Any

from npuprep.errors import NpuprepError

# How often the watch reads the resident size: often enough to stop a run within a few
# hundred MB of its budget at the rate onnxruntime allocates, rarely enough to cost nothing.
SAMPLE_SECONDS = 0.02

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}

_budget: int | None = None


def parse_size(text: str, flag: str) -> int:
    """`4G`, `3.5GiB`, `800M`, `2048MB` or a byte count as bytes (powers of 1024)."""
    match = _SIZE.match(str(text))
    if not match or float(match.group(1)) <= 0:
        raise NpuprepError(f"{flag} {text!r}: not a size (e.g. 4G, 3.5GiB, 800M)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def budget() -> int | None:
    """The resident-memory budget of this process in bytes (set by MemoryWatch), or None.
    Stages that can trade speed for memory ask it (npuprep.verify.compare)."""
    return _budget


def affordable(extra: int) -> bool:
    """Whether `extra` more bytes resident stay within the budget (always, without one):
    what a stage asks before it trades memory for speed."""
    return _budget is None or resident_bytes() + extra < _budget


def resident_bytes() -> int:
    """Resident memory now (Linux /proc; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_bytes()


def peak_bytes() -> int:
    """The kernel's high-water mark of resident memory for this process."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class BudgetExceeded(NpuprepError):
    """The run needed more resident memory than --max-memory allows."""


class MemoryWatch:
    """Samples resident memory while a run goes on: the peak per stage, and, with a
    `budget` (bytes), the run is stopped (KeyboardInterrupt in the main thread, turned
    into BudgetExceeded by `check`) once it passes it. Sets the process's budget() while
    it is active."""

    def __init__(self, budget: int | None = None, flag: str = "--max-memory") -> None:
        self.budget = budget
        self.flag = flag
        self.stages: dict[str, int] = {}
        self.current = "start"
        self.exceeded: tuple[int, str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = self._cpu_started = 0.0
        self.wall_s = 0.0
        self.cpu_s = 0.0
        # stage -> [wall, CPU] seconds spent in it (a stage entered twice adds up)
        self.seconds: dict[str, list[float]] = {}
        self._clock = (0.0, 0.0)

    def __enter__(self) -> MemoryWatch:
        global _budget
        _budget = self.budget
        self._started = time.perf_counter()
        self._cpu_started = time.process_time()
        self._clock = (self._started, self._cpu_started)
        self._thread = threading.Thread(target=self._sample, name="npuprep-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        global _budget
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._time_stage()
        self.wall_s = time.perf_counter() - self._started
        self.cpu_s = time.process_time() - self._cpu_started
        _budget = None

    def stage(self, name: str) -> None:
        """The run moved on to `name` (its peak and its time are counted from here)."""
        self._time_stage()
        self.current = name
        self._note(resident_bytes())

    def check(self, exc: BaseException) -> None:
        """Raise BudgetExceeded for an interrupt this watch caused; otherwise return."""
        if isinstance(exc, KeyboardInterrupt) and self.exceeded is not None:
            rss, stage = self.exceeded
            raise BudgetExceeded(
                f"{self.flag} {_gb(self.budget or 0)}: the run passed it ({_gb(rss)} resident) "
                f"while '{stage}', stopped and wrote nothing (raise {self.flag}, or give fewer "
                "or smaller samples)") from None

    def to_dict(self) -> dict[str, Any]:
        if not self.wall_s:
            self._time_stage()
        return {"wall_s": round(self.wall_s or time.perf_counter() - self._started, 1),
                "cpu_s": round(self.cpu_s or time.process_time() - self._cpu_started, 1),
                "peak_rss_mb": round(peak_bytes() / 2**20),
                "max_memory_mb": round(self.budget / 2**20) if self.budget else None,
                "stages_peak_rss_mb": {k: round(v / 2**20) for k, v in self.stages.items()},
                "stage_seconds": {k: {"wall_s": round(w, 2), "cpu_s": round(c, 2)}
                                  for k, (w, c) in self.seconds.items()}}

    def _time_stage(self) -> None:
        # CPU time is the whole process's: onnxruntime's threads count in the stage that ran them.
        now = (time.perf_counter(), time.process_time())
        spent = self.seconds.setdefault(self.current, [0.0, 0.0])
        spent[0] += now[0] - self._clock[0]
        spent[1] += now[1] - self._clock[1]
        self._clock = now

    def _note(self, rss: int) -> None:
        if rss > self.stages.get(self.current, 0):
            self.stages[self.current] = rss
        if self.budget is not None and rss > self.budget and self.exceeded is None:
            self.exceeded = (rss, self.current)
            _thread.interrupt_main()

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self._note(resident_bytes())


def _gb(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
