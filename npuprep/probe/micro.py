"""Micro-probes: one tiny model per unit that may overflow its own way (MAC array, vector unit, input Cast).

Every probe's inputs and weights are exactly representable in the probed format and every
product stays in range, so only the unit under test can overflow: a Conv sums 64 in-range
products to 4x the format's max, an Add of two 0.75*max values reaches 1.5*max, and so on.
Each probe also carries in-range rows, so a unit that corrupts ordinary values shows too.
Values are derived from the format's max, so the same probes serve FP16 and FP8.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.errors import NpuprepError
from npuprep.numerics import NumberFormat

ACCUM_TERMS = 64


@dataclass(frozen=True)
class ProbeModel:
    """A probe: the FP32 reference graph, the same graph in the target precision, its feeds.

    `target` is None when a backend must lower `reference` itself (the single-layer probe).
    Feeds are FP32 arrays; a backend casts them to its model's input types.
    """

    name: str
    unit: str
    reference: onnx.ModelProto
    target: onnx.ModelProto | None
    feeds: dict[str, np.ndarray]
    outputs: tuple[str, ...]
    notes: dict[str, str] = field(default_factory=dict)


def target_elem_type(fmt: NumberFormat) -> int:
    """Element type probe models are written in for `fmt`.

    ONNX has no FP8 Conv or MatMul, so FP8 probes ship as FP32 graphs for the board's
    compiler to lower with its FP8 setting (the kit README says so).
    """
    if fmt.name in ("fp16", "bf16"):
        return fmt.onnx_type
    if fmt.name.startswith("fp8"):
        return TensorProto.FLOAT
    raise NpuprepError(f"cannot probe {fmt.name}: it has FP32's range; probe fp16 or fp8 targets")


def opset_for(fmt: NumberFormat) -> int:
    return 19 if fmt.name.startswith("fp8") else 17


@dataclass(frozen=True)
class _Design:
    """One probe's graph and values, independent of the element type."""

    unit: str
    nodes: list[onnx.NodeProto]
    inputs: dict[str, np.ndarray]
    weights: dict[str, np.ndarray]
    fp32_inputs: tuple[str, ...] = ()
    int_weights: dict[str, np.ndarray] = field(default_factory=dict)


def _pow2_ceil(x: float) -> float:
    return float(2.0 ** math.ceil(math.log2(x)))


def _pow2_floor(x: float) -> float:
    return float(2.0 ** math.floor(math.log2(x)))


def _rows(big: float, small: float, width: int) -> np.ndarray:
    """Four rows: +big, -big (they overflow when summed), +small, -small (they stay in range)."""
    return np.array([[big] * width, [-big] * width, [small] * width, [-small] * width], np.float32)


def _accum_values(fmt: NumberFormat) -> tuple[float, float]:
    """(v, s): ACCUM_TERMS products v*v reach 4x max; products s*v stay far below it."""
    v = _pow2_floor(math.sqrt(fmt.max / 4))
    s = _pow2_floor(fmt.max / (8 * ACCUM_TERMS * v))
    return v, s


def _conv(fmt: NumberFormat, cast_to: int) -> _Design:
    v, s = _accum_values(fmt)
    x = _rows(v, s, ACCUM_TERMS).T.reshape(1, ACCUM_TERMS, 2, 2).copy()
    w = np.full((1, ACCUM_TERMS, 1, 1), v, np.float32)
    # x [1,64,2,2] -> Conv(W = v, 1x1) -> y [1,1,2,2]
    return _Design("Conv accumulation", [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")],
                   {"x": x}, {"w": w})


def _matmul(fmt: NumberFormat, cast_to: int) -> _Design:
    v, s = _accum_values(fmt)
    # a [4,64] -> MatMul(B = v [64,2]) -> y [4,2]
    return _Design("MatMul accumulation", [helper.make_node("MatMul", ["a", "b"], ["y"], name="matmul")],
                   {"a": _rows(v, s, ACCUM_TERMS)}, {"b": np.full((ACCUM_TERMS, 2), v, np.float32)})


def _gemm(fmt: NumberFormat, cast_to: int) -> _Design:
    v, s = _accum_values(fmt)
    # a [4,64] -> Gemm(B = v [64,2], C = v [2]) -> y [4,2]
    return _Design("Gemm (accumulation + bias)",
                   [helper.make_node("Gemm", ["a", "b", "c"], ["y"], name="gemm")],
                   {"a": _rows(v, s, ACCUM_TERMS)},
                   {"b": np.full((ACCUM_TERMS, 2), v, np.float32), "c": np.full((2,), v, np.float32)})


def _add(fmt: NumberFormat, cast_to: int) -> _Design:
    h = float(fmt.round(np.float32(0.75 * fmt.max), saturate=True))
    # a, b -> Add -> y   (0.75*max + 0.75*max = 1.5*max)
    return _Design("elementwise Add", [helper.make_node("Add", ["a", "b"], ["y"], name="add")],
                   {"a": np.array([h, -h, 1, -1], np.float32), "b": np.array([h, -h, 2, -2], np.float32)}, {})


def _mul(fmt: NumberFormat, cast_to: int) -> _Design:
    p = _pow2_ceil(math.sqrt(fmt.max))
    # a, b -> Mul -> y   (p * 2p = 2p^2 >= 2*max)
    return _Design("elementwise Mul", [helper.make_node("Mul", ["a", "b"], ["y"], name="mul")],
                   {"a": np.array([p, -p, 3, -3], np.float32),
                    "b": np.array([2 * p, 2 * p, 2, 2], np.float32)}, {})


def _exp(fmt: NumberFormat, cast_to: int) -> _Design:
    e = float(math.ceil(math.log(2 * fmt.overflow_threshold)))
    # x -> Exp -> y   (exp(e) >= 2x the threshold)
    return _Design("Exp (vector unit)", [helper.make_node("Exp", ["x"], ["y"], name="exp")],
                   {"x": np.array([e, e + 1, 1, 2], np.float32)}, {})


def _pow(fmt: NumberFormat, cast_to: int) -> _Design:
    p = 2 * _pow2_ceil(math.sqrt(fmt.max))
    # x -> Pow(x, 2) -> y   ((2p)^2 >= 4*max)
    return _Design("Pow (square)", [helper.make_node("Pow", ["x", "e"], ["y"], name="pow")],
                   {"x": np.array([p, -p, 3, -3], np.float32)}, {"e": np.array(2, np.float32)})


def _reducesum(fmt: NumberFormat, cast_to: int) -> _Design:
    r = _pow2_ceil(fmt.max / 16)
    s = _pow2_floor(fmt.max / (8 * ACCUM_TERMS))
    # x [4,64] -> ReduceSum(axis 1) -> y [4]
    return _Design("ReduceSum", [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0,
                                                  name="reducesum")],
                   {"x": _rows(r, s, ACCUM_TERMS)}, {}, int_weights={"axes": np.array([1], np.int64)})


def _cast(fmt: NumberFormat, cast_to: int) -> _Design:
    # x (FP32) -> Cast(to target) -> y   (2*max does not fit)
    m = fmt.max
    return _Design("FP32-to-target Cast at the input",
                   [helper.make_node("Cast", ["x"], ["y"], to=cast_to, name="cast")],
                   {"x": np.array([2 * m, -2 * m, m / 2, 1], np.float32)}, {}, fp32_inputs=("x",))


def _softmax(fmt: NumberFormat, cast_to: int) -> _Design:
    x = np.zeros((2, 8), np.float32)
    x[0, 0] = fmt.max / 2
    x[1] = np.arange(8, dtype=np.float32)
    # x [2,8] -> Softmax(axis -1) -> y   (a naive exp(max/2) overflows; max-subtraction does not)
    return _Design("Softmax (internal exp)", [helper.make_node("Softmax", ["x"], ["y"], axis=-1,
                                                               name="softmax")], {"x": x}, {})


MICRO_PROBES: dict[str, Callable[[NumberFormat, int], _Design]] = {
    "conv": _conv,
    "matmul": _matmul,
    "gemm": _gemm,
    "add": _add,
    "mul": _mul,
    "exp": _exp,
    "pow": _pow,
    "reducesum": _reducesum,
    "cast": _cast,
    "softmax": _softmax,
}


def _assemble(name: str, design: _Design, elem: int, opset: int) -> onnx.ModelProto:
    np_dtype = helper.tensor_dtype_to_np_dtype(elem)
    inputs = [
        helper.make_tensor_value_info(k, TensorProto.FLOAT if k in design.fp32_inputs else elem, v.shape)
        for k, v in design.inputs.items()
    ]
    inits = [numpy_helper.from_array(v.astype(np_dtype), k) for k, v in design.weights.items()]
    inits += [numpy_helper.from_array(v, k) for k, v in design.int_weights.items()]
    out = helper.make_tensor_value_info("y", elem, None)
    graph = helper.make_graph(design.nodes, f"probe_{name}", inputs, [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="npuprep-probe")
    model.ir_version = 9
    return model


def micro_probes(fmt: NumberFormat, names: tuple[str, ...] | None = None) -> list[ProbeModel]:
    """The micro-probes for `fmt` (all, or those named), each in FP32 and in target precision."""
    elem = target_elem_type(fmt)
    opset = opset_for(fmt)
    chosen = names or tuple(MICRO_PROBES)
    unknown = [n for n in chosen if n not in MICRO_PROBES]
    if unknown:
        raise NpuprepError(f"unknown micro-probe {', '.join(unknown)} (known: {', '.join(MICRO_PROBES)})")
    probes = []
    for name in chosen:
        ref_design = MICRO_PROBES[name](fmt, TensorProto.FLOAT)
        tgt_design = MICRO_PROBES[name](fmt, elem)
        reference = _assemble(name, ref_design, TensorProto.FLOAT, opset)
        target = None if elem == TensorProto.FLOAT else _assemble(name, tgt_design, elem, opset)
        probes.append(ProbeModel(name, ref_design.unit, reference, target,
                                 dict(ref_design.inputs), ("y",)))
    return probes
