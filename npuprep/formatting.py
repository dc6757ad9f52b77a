"""Text for people on a terminal: `'a_very_long_node_name'` -> `'a_very…_name'`, `6.06e14` not `6.060e+14%`.

One place for how every command shortens names, writes numbers and fits a table into 100
columns. `--wide` (an `Output` with `width=None`) keeps every cell whole; `--json` and the
reports always carry the full text, so nothing shortened here is lost.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from npuprep.names import shown

WIDTH = 100
ELLIPSIS = "…"
GAP = "  "
# A column is never shrunk below this many characters (or its header), so it stays legible.
MIN_CELL = 6
# A column of sentences, which wrap, keeps at least this many characters a line.
MIN_WRAPPED = 24
# `a, b, c (+4)` or `a, b +4`: names (no spaces) listed, then how many more there are.
_LISTED = re.compile(r"(?P<items>[^ ,]+(?:, [^ ,]+)*)(?P<more> \(\+(?P<n>\d+)\)| \+(?P<m>\d+))?")


@dataclass(frozen=True)
class Output:
    """How a command prints: `width` None = --wide; `quiet` = verdict lines only; `show_all` = no row caps."""

    width: int | None = WIDTH
    quiet: bool = False
    verbose: bool = False
    show_all: bool = False


def shorten(text: str, width: int | None, at: str = "middle") -> str:
    """`text` in at most `width` characters, cut in the middle (both ends of a name tell most)
    or, with `at="end"`, at the end (lists whose first items matter most)."""
    text = " ".join(str(text).split())
    if width is None or len(text) <= width:
        return text
    if width <= 1:
        return ELLIPSIS[:width]
    if at == "end":
        return text[: width - 1] + ELLIPSIS
    head = width // 2
    tail = width - 1 - head
    return text[:head] + ELLIPSIS + (text[-tail:] if tail else "")


def _common_prefix(names: Sequence[str]) -> str:
    """The longest prefix every name shares, ending at a path separator (`/m/encoder/`)."""
    if len(names) < 2:
        return ""
    prefix = names[0]
    for name in names[1:]:
        while not name.startswith(prefix):
            prefix = prefix[:-1]
    cut = prefix.rfind("/")
    return prefix[: cut + 1] if cut > 0 else ""


def fold_names(names: Sequence[str], width: int) -> list[str]:
    """Names that tell each other apart in `width` characters: the prefix they all share is folded
    to `…` and the end is cut, so `…layer.3/attention/self/Add` keeps the layer number that a cut
    in the middle removes. Names that fit stay whole."""
    prefix = _common_prefix([n for n in names if len(n) > width])
    return [_fold(name, prefix, width) for name in names]


def _fold(name: str, prefix: str, width: int) -> str:
    if len(name) <= width:
        return name
    if prefix and len(name) > len(prefix):
        start = len(prefix)
        # Fold no more than needed: give back shared segments while the rest still fits.
        while (back := name.rfind("/", 0, start - 1)) > 0 and len(name) - back - 1 < width:
            start = back + 1
        return shorten(ELLIPSIS + name[start:], width, at="end")
    return shorten(name, width)


def _name_and_rest(text: str, width: int) -> tuple[str, str]:
    """A cell as the name to shorten and the text after it, kept whole: a list of names loses
    its last names to its `(+N)` count first (`a, b (+10)` -> `a (+11)`), and in `name (x2^1)`
    only the name is shortened."""
    listed = _LISTED.fullmatch(text)
    if listed:
        items = listed["items"].split(", ")
        more = int(listed["n"] or listed["m"] or 0)
        style = " +{}" if listed["m"] else " (+{})"
        while len(items) > 1 and len(", ".join(items) + style.format(more)) > width:
            items.pop()
            more += 1
        rest = style.format(more) if more else ""
        return (", ".join(items), rest) if len(items) > 1 else (items[0], rest)
    name, space, rest = text.partition(" ")
    return (name, space + rest) if space else (text, "")


def fit_names(cells: Sequence[str], width: int) -> list[str]:
    """A column of names, some with text after them, in `width` characters: the text stays whole
    and the names tell each other apart (`fold_names`); a cell whose text leaves a name too
    little room is cut in the middle."""
    parts = [_name_and_rest(c, width) if len(c) > width else (c, "") for c in cells]
    prefix = _common_prefix([n for n, r in parts if len(n) + len(r) > width])
    return [name + rest if len(name) + len(rest) <= width else
            _fold(name, prefix, width - len(rest)) + rest if width - len(rest) >= MIN_CELL else
            shorten(name + rest, width) for name, rest in parts]


def number(value: Any) -> str:
    """A number in engineering form: `0.0098`, `65504`, `3.97e17`, `6.1e-5`, `inf`, `nan`."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            value = float(value)
        except (TypeError, ValueError):
            return str(value)
    if isinstance(value, int) and abs(value) < 10**6:
        return str(value)
    v = float(value)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return "0"
    if 1e4 <= abs(v) < 1e6:
        return f"{v:.0f}"
    if 1e-3 <= abs(v) < 1e4:
        return f"{v:.4g}"
    return _exp(f"{v:.3g}")


def _exp(text: str) -> str:
    """`3.97e+17` -> `3.97e17`, `6.1e-05` -> `6.1e-5`."""
    if "e" not in text:
        return text
    mantissa, _, exponent = text.partition("e")
    sign = "-" if exponent.startswith("-") else ""
    return f"{mantissa}e{sign}{exponent.lstrip('+-').lstrip('0') or '0'}"


def ratio(value: Any) -> str:
    """A ratio as `9.7x` (`3.97e17x` when huge, `infx` never: `inf` alone)."""
    if value is None:
        return ""
    v = float(value)
    if not math.isfinite(v):
        return number(v)
    if 1e-3 <= abs(v) < 10:
        return f"{v:.2g}x"
    return f"{number(float(round(v)) if 10 <= abs(v) < 1e6 else v)}x"


def percent(value: Any) -> str:
    """A percentage (given as a fraction: 0.5 -> `50%`); 10x and beyond read as a ratio, not `6e14%`."""
    if value is None:
        return ""
    v = float(value)
    if not math.isfinite(v):
        return number(v)
    if abs(v) >= 10:
        return ratio(v)
    return f"{v * 100:.3g}%"


def cell(value: Any) -> str:
    if isinstance(value, float | int) and not isinstance(value, bool):
        return number(value)
    # Names are data: control characters in them are shown escaped, never sent raw.
    return "" if value is None else " ".join(shown(value).split())


def fit_widths(natural: Sequence[int], minimum: Sequence[int], budget: int) -> list[int]:
    """Column widths that add up to at most `budget`: the widest column gives way first."""
    widths = list(natural)
    while sum(widths) > budget:
        i = max(range(len(widths)), key=lambda k: (widths[k] - minimum[k] > 0, widths[k]))
        if widths[i] <= minimum[i]:
            break
        widths[i] -= 1
    return widths


def table_lines(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]],
                width: int | None = WIDTH, cut_end: Sequence[str] = (),
                wrap: Sequence[str] = ()) -> list[str]:
    """A plain aligned table (title, header, rule, rows), no line wider than `width` (None: no limit).

    Names keep the part that differs (`fit_names`); the `cut_end` columns (evidence lists) are
    cut at the end; the `wrap` columns (sentences) continue on the lines below, whole.
    """
    cells = [[cell(v) for v in r] for r in rows]
    at = ["wrap" if c in wrap else "end" if c in cut_end else "middle" for c in columns]
    natural = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    if width is None:
        widths = natural
    else:
        minimum = [min(n, max(MIN_WRAPPED if a == "wrap" else MIN_CELL, len(c)))
                   for n, c, a in zip(natural, columns, at, strict=True)]
        widths = fit_widths(natural, minimum, width - len(GAP) * (len(columns) - 1))
    lines = [shorten(title, width) if width else title,
             GAP.join(shorten(c, w).ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip(),
             GAP.join("-" * w for w in widths)]
    folded = [fit_names([r[i] for r in cells], w) if a == "middle" else
              [r[i] for r in cells] if a == "wrap" else [shorten(r[i], w, a) for r in cells]
              for i, (w, a) in enumerate(zip(widths, at, strict=True))]
    for k in range(len(cells)):
        parts = [textwrap.wrap(col[k], w, break_on_hyphens=False) or [""] if a == "wrap" else [col[k]]
                 for col, w, a in zip(folded, widths, at, strict=True)]
        lines += [GAP.join((p[j] if j < len(p) else "").ljust(w) for p, w in zip(parts, widths, strict=True))
                  .rstrip() for j in range(max(len(p) for p in parts))]
    return lines


def wrap(text: str, width: int | None = WIDTH, indent: str = "  ") -> str:
    """A message line wrapped to `width` (continuation lines indented); whole with None."""
    if width is None or len(text) <= width:
        return text
    return textwrap.fill(text, width=width, subsequent_indent=indent, break_on_hyphens=False)


def capped(rows: Sequence[Any], limit: int, show_all: bool) -> tuple[list[Any], int]:
    """The first `limit` rows (all with `show_all`) and how many were left out."""
    if show_all or len(rows) <= limit:
        return list(rows), 0
    return list(rows[:limit]), len(rows) - limit


def wrap_markdown(text: str, width: int | None = WIDTH) -> str:
    """Markdown list text wrapped to `width`: a long item continues under its own indentation."""
    if width is None:
        return text
    lines = []
    for line in text.split("\n"):
        body = line.lstrip(" ")
        marker = body.split(" ", 1)[0] if body.startswith(("- ", "* ")) or body[:1].isdigit() else ""
        indent = " " * (len(line) - len(body) + len(marker) + (1 if marker else 0))
        lines.append(line if len(line) <= width else
                     textwrap.fill(line, width=width, subsequent_indent=indent, break_on_hyphens=False))
    return "\n".join(lines)
