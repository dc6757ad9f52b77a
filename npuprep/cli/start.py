"""The console script's first module (`npuprep`, `python -m npuprep`): SIGINT and SIGTERM
are held from its first line, before the command's modules load, and take effect once the
command has started, where they end it in one line (exit 130/143) instead of a traceback
from inside an import. Only the entry points import this module: it sets signal handlers."""

from __future__ import annotations

import signal
import threading

held: list[int] = []


def _hold(signum: int, frame: object) -> None:
    held.append(signum)


if threading.current_thread() is threading.main_thread():
    for _s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_s, _hold)


def entry() -> None:
    from npuprep.cli.main import entry as run_command

    run_command(held)
