"""`npuprep` entry point: an explicit list of commands, each in its own module.

Command modules import only argparse-level code at start-up, so `npuprep --help` stays
fast; each imports its heavy stages (onnxruntime, graphsurgeon) inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from typing import NoReturn

from npuprep import __version__
from npuprep.cli.bug import ENVIRONMENT_ERRNOS, report_bug
from npuprep.cli.common import add_output_options, configure_output
from npuprep.errors import NpuprepError
from npuprep.names import shown

# name -> module under npuprep.cli; each module has `help`, `add_arguments(p)` and `run(args) -> int`.
COMMANDS: dict[str, str] = {
    "targets": "targets",
    "check": "check",
    "calibrate": "calibrate",
    "convert": "convert",
    "compare": "compare",
    "probe": "probe",
    "crosscheck": "crosscheck",
    "checklist": "checklist",
    "report": "report",
    "stats": "stats",
    "ledger": "ledger",
}


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake in the arguments as one line (no usage block above it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; with `command`, only that command's (start-up imports only its module)."""
    parser = _Parser(
        prog="npuprep",
        description="Make FP32/BF16-trained ONNX models safe and fast on FP16/FP8 targets.",
    )
    parser.add_argument("--version", action="version", version=f"npuprep {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        if command is not None and name != command:
            continue
        try:
            module = importlib.import_module(f"npuprep.cli.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"npuprep.cli.{module_name}":
                raise
            continue
        p = sub.add_parser(name, help=module.help, description=module.help)
        module.add_arguments(p)
        add_output_options(p)
        p.set_defaults(_run=module.run)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every `finally` (temporary files) runs."""


_terminated: list[int] = []  # a library (Ray) may re-raise Terminated as a plain KeyboardInterrupt


def _terminate(signum: int, frame: object) -> None:
    _terminated.append(signum)
    raise Terminated()


# Compiled modules every command loads: a KeyboardInterrupt inside their initialisation
# surfaces as an ImportError ("numpy._core.umath failed to import") or a crash.
_COMPILED = ("numpy", "ml_dtypes", "onnx", "onnxruntime")
_early: list[int] = []  # SIGINT/SIGTERM received before the command started


def _record(signum: int, frame: object) -> None:
    _early.append(signum)


def _load_compiled() -> None:
    for name in _COMPILED:
        try:
            importlib.import_module(name)
        except ImportError:
            continue  # reported by the command that needs it


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(words[0] if words and words[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:
        previous = {s: signal.signal(s, _record) for s in (signal.SIGINT, signal.SIGTERM)}
    _load_compiled()
    if in_main_thread:
        signal.signal(signal.SIGTERM, _terminate)
        int_handler = previous[signal.SIGINT]
        signal.signal(signal.SIGINT, signal.default_int_handler if int_handler is _record else int_handler)
    configure_output(args)
    try:
        # A signal during start-up takes effect now, where it is reported in one line.
        if signal.SIGTERM in _early:
            _terminate(signal.SIGTERM, None)
        if _early:
            raise KeyboardInterrupt
        return int(args._run(args) or 0)
    except NpuprepError as exc:
        print(f"npuprep: error: {shown(exc)}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        # `npuprep check ... | head`: the reader has what it wanted.
        sys.stderr.close()
        return 0
    except KeyboardInterrupt as exc:
        terminated = isinstance(exc, Terminated) or bool(_terminated)
        print("npuprep: terminated" if terminated else "npuprep: interrupted", file=sys.stderr)
        return 143 if terminated else 130
    except OSError as exc:
        if exc.errno not in ENVIRONMENT_ERRNOS:
            return report_bug(exc, words)
        # The machine, not the input and not npuprep: a full disk, a lost mount.
        where = f" ({shown(exc.filename)})" if exc.filename else ""
        print(f"npuprep: error: {exc.strerror or exc}{where}; no output of this run was put in place",
              file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - anything else that escapes is a bug
        return report_bug(exc, words)


def entry(held: list[int] | None = None) -> None:
    """The console script (through npuprep.cli.start, which passes the signals it `held`):
    SIGINT and SIGTERM are held until the command starts, then end it in one line; after
    an interrupt, leave without running onnxruntime's C++ teardown while its worker threads
    may still be busy, which aborts (exit 134)."""
    global _early
    if held is not None:
        _early = held  # the same list: a signal between the two handlers is kept
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, _record)
    code = main()
    if code in (130, 143):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
