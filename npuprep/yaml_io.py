"""YAML files read with one-line errors that name the file (and the line, for syntax)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from npuprep.errors import NpuprepError


def read_yaml(path: Path, what: str) -> Any:
    """Parse `path`; a missing file, bad syntax or non-UTF-8 text is a one-line NpuprepError."""
    if not path.is_file():
        raise NpuprepError(f"{path}: {what} file not found")
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}:" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise NpuprepError(f"{path}:{where} YAML syntax error: {problem}") from None
    except UnicodeDecodeError:
        raise NpuprepError(f"{path}: not a UTF-8 text file") from None
