"""Shared CLI pieces: common arguments, JSON and table output, progress bars."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

# Library modules use these too; they live outside cli/ (no library module imports cli/).
from npuprep.json_io import dump_json, to_jsonable  # noqa: F401 - re-exported for the commands
from npuprep.names import shown
from npuprep.progress import progress_counter

T = TypeVar("T")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def add_target(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "--target", "-t", required=required, default=None if required else "generic",
        help="built-in profile name (generic, orin, a2000) or a profile YAML path",
    )


def add_data(p: argparse.ArgumentParser, required: bool = False) -> None:
    g = p.add_argument_group("samples")
    src = g.add_mutually_exclusive_group(required=required)
    src.add_argument("--data", "-d", help=".npz sample, directory of .npz, batched .npz or Polygraphy JSON")
    src.add_argument("--synthetic", type=int, metavar="N", help="N seeded random samples (reports say so)")
    g.add_argument("--batched", action="store_true", help="split a single .npz along axis 0")
    g.add_argument("--seed", type=_seed, default=0, help="seed for --synthetic (default 0)")


def add_jobs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", "-j", type=_count, default=1,
                   help="calibration processes over sample ranges (default 1); 'auto': one per core when "
                        "each gets at least 32 samples, else 1")
    p.add_argument("--streams", type=_count, default=0,
                   help="samples calibrated at once in each process, on threads sharing one session, each "
                        "on its share of the cores. Default 0 or 'auto': one per core when each gets at "
                        "least 4 samples, else 1 (on every core)")


def _count(text: str) -> int:
    """`--jobs`, `--streams`: a count >= 0, or 'auto' (= 0)."""
    if text == "auto":
        return 0
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0 or 'auto', got {text!r}")
    return value


def _seed(text: str) -> int:
    """`--seed`: an integer >= 0 (numpy's generators refuse negative seeds)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An option that is a count >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An option that is a finite number > 0 (a tolerance, a gain)."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """An option that is a finite number >= 0 (an absolute tolerance)."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def check_rtol(value: float | None, flag: str) -> None:
    """A tolerance given from Python rather than the parser: finite and > 0."""
    from npuprep.errors import NpuprepError

    if value is not None and not (math.isfinite(value) and value > 0):
        raise NpuprepError(f"{flag} needs a finite number > 0, got {value!r}")


def open_samples(args: argparse.Namespace, model: Any) -> Any:
    """The SampleSet chosen by --data/--synthetic, or None when neither was given."""
    from npuprep.data import load_samples, synthetic_samples

    if getattr(args, "data", None):
        return load_samples(args.data, model, batched=args.batched)
    if getattr(args, "synthetic", None):
        return synthetic_samples(model, args.synthetic, args.seed)
    return None



def print_json(obj: Any) -> None:
    sys.stdout.write(dump_json(obj))


def say(text: str) -> None:
    """Print one line built from names: control characters in them are shown escaped."""
    print(shown(text))


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """A table: drawn by rich on a terminal, plain aligned text when piped (greppable, and
    without rich's ~0.1 s of import and layout)."""
    if not sys.stdout.isatty():
        cells = [[fmt(v) for v in r] for r in rows]
        widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
        lines = [shown(title), "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip(),
                 "  ".join("-" * w for w in widths)]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]
        sys.stdout.write("\n".join(lines) + "\n")
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(shown(title)), show_lines=False, title_justify="left")
    for c in columns:
        table.add_column(c, overflow="fold")
    for r in rows:
        # Node names like `{ForeignNode[a...b]}` are text, not rich markup.
        table.add_row(*[escape(fmt(v)) for v in r])
    Console().print(table)


def fmt(v: Any) -> str:
    """A table cell: numbers in short form, text with control characters escaped."""
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v == 0 or 1e-3 <= abs(v) < 1e5:
            return f"{v:.4g}"
        return f"{v:.3e}"
    return shown(v)


def progress(items: Iterable[T], total: int, description: str, enabled: bool) -> Iterator[T]:
    """A progress bar on a terminal's stderr over `items`; silent when piped or when JSON is
    asked for."""
    with progress_counter(total, description, enabled) as set_done:
        for done, item in enumerate(items, 1):
            yield item
            set_done(done)
