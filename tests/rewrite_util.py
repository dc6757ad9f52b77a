"""Helpers for the rewrite tests: models from ONNX text with numpy weights, ORT runs, errors."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper, parser

from npuprep.runtime.session import make_session, run


def build(text: str, **weights: np.ndarray) -> onnx.ModelProto:
    """Parse ONNX text whose `<...>` initialisers are declared without values; fill them in."""
    model = parser.parse_model(text)
    declared = {i.name for i in model.graph.initializer}
    for name, value in weights.items():
        if name in declared:
            model.graph.initializer.remove(next(i for i in model.graph.initializer if i.name == name))
        model.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    onnx.checker.check_model(model, full_check=True)
    return model


def outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return run(make_session(model, optimize=False), feeds)


def rel_err(ref: np.ndarray, cand: np.ndarray) -> float:
    """max |cand - ref| / max |ref| (0 for an all-zero reference that matches)."""
    ref = np.asarray(ref, np.float64)
    cand = np.asarray(cand, np.float64)
    scale = float(np.abs(ref).max()) or 1.0
    return float(np.abs(cand - ref).max()) / scale
