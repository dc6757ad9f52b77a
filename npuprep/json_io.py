"""JSON for artefacts: numbers that JSON cannot hold (Inf, NaN) written as strings; stable dumps."""

from __future__ import annotations

import json
import math
from typing import Any


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
