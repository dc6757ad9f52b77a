"""YAML files read with one-line errors that name the file (and the line, for syntax), with a
guard on size and nesting depth."""

from __future__ import annotations

import math
from collections.abc import Collection
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


def type_name(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


class YamlReader:
    """Typed access to parsed YAML that names the file and the key path in every error: the
    one validator under target profiles and plans (each adds its own domain checks)."""

    # A plan's names must say something; a profile's free text may be empty.
    allow_empty = True

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, message: str) -> NpuprepError:
        return NpuprepError(f"{self.source}: key '{key}': {message}")

    def mapping(self, value: Any, key: str, allowed: Collection[str] | None = None) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(key, f"expected a mapping, got {type_name(value)}")
        if allowed is not None:
            shown = sorted(allowed) if isinstance(allowed, set | frozenset) else list(allowed)
            for k in value:
                if k not in allowed:
                    path = f"{key}.{k}" if key else str(k)
                    raise self.fail(path, f"unknown key (allowed: {', '.join(shown)})")
        return value

    def string(self, value: Any, key: str) -> str:
        if not isinstance(value, str) or not (value or self.allow_empty):
            kind = "a string" if self.allow_empty else "a non-empty string"
            raise self.fail(key, f"expected {kind}, got {type_name(value)}")
        return value

    def text(self, value: Any, key: str) -> str:
        """Optional free text: absent is ''."""
        if value is None:
            return ""
        if not isinstance(value, str):
            raise self.fail(key, f"expected a string, got {type_name(value)}")
        return value

    def choice(self, value: Any, key: str, choices: Collection[str]) -> str:
        text = self.string(value, key)
        if text not in choices:
            raise self.fail(key, f"'{text}' is not one of {', '.join(choices)}")
        return text

    def integer(self, value: Any, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {type_name(value)}")
        return value

    def number(self, value: Any, key: str, optional: bool = False) -> float | None:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"expected a number, got {type_name(value)}")
        if math.isnan(value):
            raise self.fail(key, "NaN is not a bound")
        return float(value)

    def boolean(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {type_name(value)}")
        return value

    def items(self, value: Any, key: str) -> list[Any]:
        """An optional list: absent is []."""
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(key, f"expected a list, got {type_name(value)}")
        return value

    def strings(self, value: Any, key: str) -> tuple[str, ...]:
        return tuple(self.string(v, f"{key}[{i}]") for i, v in enumerate(self.items(value, key)))
