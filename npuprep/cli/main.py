"""`npuprep` entry point: an explicit list of commands, each in its own module.

Command modules import only argparse-level code at start-up, so `npuprep --help` stays
fast; each imports its heavy stages (onnxruntime, graphsurgeon) inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from npuprep import __version__
from npuprep.cli.common import add_output_options, configure_output
from npuprep.errors import NpuprepError

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


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(words[0] if words and words[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    configure_output(args)
    try:
        return int(args._run(args) or 0)
    except NpuprepError as exc:
        print(f"npuprep: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        # `npuprep check ... | head`: the reader has what it wanted.
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("npuprep: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
