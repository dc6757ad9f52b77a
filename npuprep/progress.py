"""A progress bar on a terminal's stderr, for long library loops (calibration) and the CLI."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_counter(total: int, description: str, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar on a terminal's stderr, set to how many of `total` are done by the
    function this yields; silent when piped or when JSON is asked for."""
    if not enabled or not sys.stderr.isatty():
        yield lambda done: None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda done: bar.update(task, completed=done)
