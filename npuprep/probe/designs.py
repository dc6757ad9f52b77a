"""Micro-probe values, numpy only: each unit overflows on its own while its inputs and products stay in range.

Shared by the ONNX micro-probes (micro.py) and their PyTorch twins (torch_runner.py), so a
GPU and a board see the same numbers. Values derive from the format's max and are powers of
two (or 1.5x one), so they are exact in the format: a Conv sums 64 in-range products to 4x
the max, an Add of two 1.5*2^k values reaches 1.5x the max, and so on. Each probe also holds
in-range values, so a unit that corrupts ordinary values shows too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

ACCUM_TERMS = 64


class FormatLimits(Protocol):
    """What a design needs of a format (npuprep.numerics.NumberFormat qualifies)."""

    name: str
    max: float

    @property
    def overflow_threshold(self) -> float: ...


@dataclass(frozen=True)
class Design:
    """One probe's values: FP32 inputs (exact in the format) and constant weights."""

    unit: str
    inputs: dict[str, np.ndarray]
    weights: dict[str, np.ndarray] = field(default_factory=dict)


def _pow2_ceil(x: float) -> float:
    return float(2.0 ** math.ceil(math.log2(x)))


def _pow2_floor(x: float) -> float:
    return float(2.0 ** math.floor(math.log2(x)))


def _rows(big: float, small: float, width: int) -> np.ndarray:
    """Four rows: +big, -big (they overflow when summed), +small, -small (they stay in range)."""
    return np.array([[big] * width, [-big] * width, [small] * width, [-small] * width], np.float32)


def _accum_values(fmt: FormatLimits) -> tuple[float, float]:
    """(v, s): ACCUM_TERMS products v*v reach 4x max; products s*v stay far below it."""
    v = _pow2_floor(math.sqrt(fmt.max / 4))
    s = _pow2_floor(fmt.max / (8 * ACCUM_TERMS * v))
    return v, s


def conv(fmt: FormatLimits) -> Design:
    v, s = _accum_values(fmt)
    x = _rows(v, s, ACCUM_TERMS).T.reshape(1, ACCUM_TERMS, 2, 2).copy()
    return Design("Conv accumulation", {"x": x}, {"w": np.full((1, ACCUM_TERMS, 1, 1), v, np.float32)})


def matmul(fmt: FormatLimits) -> Design:
    v, s = _accum_values(fmt)
    return Design("MatMul accumulation", {"a": _rows(v, s, ACCUM_TERMS)},
                  {"b": np.full((ACCUM_TERMS, 2), v, np.float32)})


def gemm(fmt: FormatLimits) -> Design:
    v, s = _accum_values(fmt)
    return Design("Gemm (accumulation + bias)", {"a": _rows(v, s, ACCUM_TERMS)},
                  {"b": np.full((ACCUM_TERMS, 2), v, np.float32), "c": np.full((2,), v, np.float32)})


def add(fmt: FormatLimits) -> Design:
    h = 1.5 * _pow2_floor(fmt.max)
    return Design("elementwise Add", {"a": np.array([h, -h, 1, -1], np.float32),
                                      "b": np.array([h, -h, 2, -2], np.float32)})


def mul(fmt: FormatLimits) -> Design:
    p = _pow2_ceil(math.sqrt(fmt.max))
    return Design("elementwise Mul", {"a": np.array([p, -p, 3, -3], np.float32),
                                      "b": np.array([2 * p, 2 * p, 2, 2], np.float32)})


def exp(fmt: FormatLimits) -> Design:
    e = float(math.ceil(math.log(2 * fmt.overflow_threshold)))
    return Design("Exp (vector unit)", {"x": np.array([e, e + 1, 1, 2], np.float32)})


def pow_(fmt: FormatLimits) -> Design:
    p = 2 * _pow2_ceil(math.sqrt(fmt.max))
    return Design("Pow (square)", {"x": np.array([p, -p, 3, -3], np.float32)},
                  {"e": np.array(2, np.float32)})


def reducesum(fmt: FormatLimits) -> Design:
    r = _pow2_ceil(fmt.max / 16)
    s = _pow2_floor(fmt.max / (8 * ACCUM_TERMS))
    return Design("ReduceSum", {"x": _rows(r, s, ACCUM_TERMS)})


def cast(fmt: FormatLimits) -> Design:
    m = fmt.max
    return Design("FP32-to-target Cast at the input", {"x": np.array([2 * m, -2 * m, m / 2, 1], np.float32)})


def softmax(fmt: FormatLimits) -> Design:
    x = np.zeros((2, 8), np.float32)
    x[0, 0] = fmt.max / 2
    x[1] = np.arange(8, dtype=np.float32)
    return Design("Softmax (internal exp)", {"x": x})


DESIGNS = {
    "conv": conv, "matmul": matmul, "gemm": gemm, "add": add, "mul": mul, "exp": exp,
    "pow": pow_, "reducesum": reducesum, "cast": cast, "softmax": softmax,
}
