"""JSON for artefacts: numbers that JSON cannot hold (Inf, NaN) written as strings; JSON
read with a guard on nesting depth and size, so a hostile file is one error, not a crash."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from npuprep.errors import NpuprepError

# npuprep's own files nest a few levels; a compiler report a dozen at most.
MAX_DEPTH = 64
MAX_CHARS = 2**31

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


def json_number(x: float) -> float | str:
    """A float for JSON: Inf and NaN become "inf", "-inf", "nan", so overflow, exactly what
    npuprep's artefacts must be able to say, stays valid JSON."""
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def to_jsonable(obj: Any) -> Any:
    """Dataclasses with to_dict, enums, numpy scalars and non-finite floats made JSON-safe."""
    import enum

    import numpy as np

    if hasattr(obj, "to_dict"):
        return to_jsonable(obj.to_dict())
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return str(obj.value) if not isinstance(obj, enum.IntEnum) else str(obj)
    if isinstance(obj, np.generic):
        return to_jsonable(obj.item())
    if isinstance(obj, float):
        return json_number(obj)
    return obj


def dump_json(obj: Any) -> str:
    """Sorted, indented JSON text of `obj` (same input, same bytes)."""
    return json.dumps(to_jsonable(obj), indent=2, sort_keys=True, allow_nan=False) + "\n"


def loads(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads for files a user hands in: nesting deeper than `max_depth` or text longer
    than MAX_CHARS raise json.JSONDecodeError (as bad syntax does) before parsing, instead of
    a RecursionError or memory exhaustion."""
    if len(text) > MAX_CHARS:
        raise json.JSONDecodeError(f"larger than {MAX_CHARS} characters", text[:100], 0)
    check_depth(text, max_depth)
    return json.loads(text)


def check_depth(text: str, max_depth: int = MAX_DEPTH) -> None:
    """Raise json.JSONDecodeError where brackets outside strings nest deeper than `max_depth`.
    Only brackets and strings are visited, so long arrays of numbers cost nothing here."""
    if text.count("[") + text.count("{") <= max_depth:
        return
    depth = 0
    for m in _TOKEN.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > max_depth:
                raise json.JSONDecodeError(f"nested deeper than {max_depth} levels", text, m.start())
        elif c in "]}":
            depth -= 1


def read_json(path: str | Path, what: str) -> Any:
    """The JSON in `path`; a missing, unreadable or malformed file is one NpuprepError that
    names the file and `what` it should have been ("stats file", "probe kit manifest")."""
    path = Path(path)
    try:
        return loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NpuprepError(f"{path}: {what} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise NpuprepError(f"{path}: cannot read the {what} ({exc})") from None
    except json.JSONDecodeError as exc:
        raise NpuprepError(f"{path}: not a valid {what} (JSON line {exc.lineno}: {exc.msg})") from None
