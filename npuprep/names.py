"""Names are data: node, tensor and profile names shown on a terminal, in a comment, in
Markdown or in a file name, never read as control sequences, markup or paths.

    "mul\\n  - action: pin_fp32"  ->  terminal/comment: mul\\n  - action: pin_fp32 (one line)
    "/../../../tmp/x"            ->  file name part: _.._.._.._tmp_x
"""

from __future__ import annotations

import re
import unicodedata

# Characters that reorder or hide text on a terminal although they are not C0/C1 controls.
_INVISIBLE = frozenset("\u200b\u200e\u200f\u2028\u2029\u202a\u202b\u202c\u202d\u202e"
                       "\u2066\u2067\u2068\u2069\ufeff")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _escape_char(c: str) -> str:
    if c in _NAMED:
        return _NAMED[c]
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _unsafe(c: str) -> bool:
    return c in _INVISIBLE or unicodedata.category(c) == "Cc"


def shown(text: object) -> str:
    """`text` on one line with every control character (ESC, newline, bidi overrides) written
    as a backslash escape, so a name cannot move the cursor, recolour a terminal or start a
    new line in a comment. Plain text passes unchanged (a backslash is doubled only where
    the text holds something to escape, so ordinary Windows-style names read as before)."""
    s = str(text)
    if not any(_unsafe(c) for c in s):
        return s
    return "".join(_escape_char(c) if _unsafe(c) or c == "\\" else c for c in s)


def comment(text: object) -> str:
    """Text safe after `#` in YAML or shell: one line, controls escaped."""
    return shown(text)


def md_code(text: object) -> str:
    """An inline Markdown code span holding `text` verbatim (controls escaped): the fence is
    one backtick longer than any run of backticks inside, and `|` is escaped for tables."""
    s = shown(text).replace("|", "\\|")
    longest = max((len(m) for m in re.findall(r"`+", s)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if s.startswith("`") or s.endswith("`") or not s.strip() else ""
    return f"{fence}{pad}{s}{pad}{fence}"


_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|#!~{}])")


def md_text(text: object) -> str:
    """Plain Markdown text (a table cell, a list item): markup characters and controls escaped."""
    return _MD_SPECIAL.sub(r"\\\1", shown(text))


def md_cell(text: object) -> str:
    """A Markdown table cell that reads as written: controls escaped, `|` kept inside the
    cell, `<` written as an entity so a name cannot open an HTML tag in a rendered report."""
    return shown(text).replace("|", "\\|").replace("<", "&lt;")


_FILE_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")


def file_part(text: object, default: str = "out") -> str:
    """`text` as one file-name component: no separators, no leading dot, no '..' path."""
    s = _FILE_UNSAFE.sub("_", str(text)).lstrip(".")
    return s or default
