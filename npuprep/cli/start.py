"""The console script's first module (`npuprep`, `python -m npuprep`): SIGINT and SIGTERM
are held from its first line, before the command's modules load, and take effect once the
command has started, where they end it in one line (exit 130/143) instead of a traceback
from inside an import. Only the entry points import this module: it sets signal handlers.

What comes before this module cannot be held here: Python's own start-up (site, and in an
editable install the setuptools path finder) and the `import re` of pip's console script
(bench/bench_signal_startup.py measures how often a signal lands there)."""

from __future__ import annotations

# The C module: `signal` first builds its enums and `threading` loads, a millisecond or two
# in which a Ctrl-C would still be a traceback.
import _signal

held: list[int] = []


def _hold(signum: int, frame: object) -> None:
    held.append(signum)


try:
    for _s in (_signal.SIGINT, _signal.SIGTERM):
        _signal.signal(_s, _hold)
except ValueError:  # imported outside the main thread: the handlers are not ours to set
    pass


def entry() -> None:
    from npuprep.cli.main import entry as run_command

    run_command(held)
