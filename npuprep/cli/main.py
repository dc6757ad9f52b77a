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

from npuprep import __version__
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


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; with `command`, only that command's (start-up imports only its module)."""
    parser = argparse.ArgumentParser(
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


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(words[0] if words and words[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    configure_output(args)
    try:
        return int(args._run(args) or 0)
    except NpuprepError as exc:
        print(f"npuprep: error: {shown(exc)}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        # `npuprep check ... | head`: the reader has what it wanted.
        sys.stderr.close()
        return 0
    except KeyboardInterrupt as exc:
        print("npuprep: terminated" if isinstance(exc, Terminated) else "npuprep: interrupted",
              file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130


def entry() -> None:
    """The console script: after an interrupt, leave without running onnxruntime's C++
    teardown while its worker threads may still be busy, which aborts (exit 134)."""
    code = main()
    if code in (130, 143):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
