"""YAML files read with one-line errors that name the file (and the line, for syntax), with a
guard on size and nesting depth."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from npuprep.errors import NpuprepError

# Profiles and plans are small; a plan pinning every node of a 100k-node model is a few MB.
MAX_BYTES = 64 * 2**20
MAX_DEPTH = 32


def read_yaml(path: Path, what: str) -> Any:
    """Parse `path`; a missing file, bad syntax, non-UTF-8 text, a file over MAX_BYTES or
    nesting deeper than MAX_DEPTH is a one-line NpuprepError."""
    if not path.is_file():
        raise NpuprepError(f"{path}: {what} file not found")
    if path.stat().st_size > MAX_BYTES:
        raise NpuprepError(f"{path}: {what} file larger than {MAX_BYTES // 2**20} MB; not a {what}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}:" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise NpuprepError(f"{path}:{where} YAML syntax error: {problem}") from None
    except UnicodeDecodeError:
        raise NpuprepError(f"{path}: not a UTF-8 text file") from None
    except RecursionError:
        raise NpuprepError(f"{path}: {what} nested too deeply to read") from None
    if _depth(data) > MAX_DEPTH:
        raise NpuprepError(f"{path}: {what} nested deeper than {MAX_DEPTH} levels")
    return data


def _depth(data: Any) -> int:
    """The nesting depth of parsed YAML, iteratively (aliases make it a graph: each node once)."""
    deepest = 0
    seen: set[int] = set()
    stack = [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, dict | list) or id(item) in seen:
            continue
        seen.add(id(item))
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            return deepest
        children = list(item.keys()) + list(item.values()) if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children)
    return deepest
