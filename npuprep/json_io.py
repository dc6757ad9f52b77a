"""JSON for artefacts: numbers that JSON cannot hold (Inf, NaN) written as strings."""

from __future__ import annotations

import math


def json_number(x: float) -> float | str:
    """A float for JSON: Inf and NaN become "inf", "-inf", "nan", so overflow, exactly what
    npuprep's artefacts must be able to say, stays valid JSON."""
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x
