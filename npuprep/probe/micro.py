"""Micro-probes: one tiny ONNX model per unit that may overflow its own way (MAC array, vector unit, input Cast).

The values come from designs.py (shared with the PyTorch twins); this module wraps each
in a one-node graph, in FP32 (the reference) and in the target precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.errors import NpuprepError
from npuprep.numerics import NumberFormat
from npuprep.probe.designs import DESIGNS, Design


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
    # The temporary file (npuprep.model_io.WeightScratch) holding weights the reference graph
    # refers to instead of carrying them (an amplified layer of a large model): kept alive here.
    scratch: Any = None


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


def _graph(name: str, fmt: NumberFormat, cast_to: int) -> tuple[Design, list[onnx.NodeProto],
                                                                 dict[str, np.ndarray]]:
    """The design's values, its ONNX nodes and its integer constants."""
    design = DESIGNS[name](fmt)
    ints: dict[str, np.ndarray] = {}
    if name == "conv":
        # x [1,64,2,2] -> Conv(W = v, 1x1) -> y [1,1,2,2]
        nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")]
    elif name == "matmul":
        # a [4,64] -> MatMul(B = v [64,2]) -> y [4,2]
        nodes = [helper.make_node("MatMul", ["a", "b"], ["y"], name="matmul")]
    elif name == "gemm":
        # a [4,64] -> Gemm(B = v [64,2], C = v [2]) -> y [4,2]
        nodes = [helper.make_node("Gemm", ["a", "b", "c"], ["y"], name="gemm")]
    elif name in ("add", "mul"):
        # a, b -> Add|Mul -> y
        nodes = [helper.make_node(name.capitalize(), ["a", "b"], ["y"], name=name)]
    elif name == "exp":
        # x -> Exp -> y
        nodes = [helper.make_node("Exp", ["x"], ["y"], name="exp")]
    elif name == "pow":
        # x -> Pow(x, 2) -> y
        nodes = [helper.make_node("Pow", ["x", "e"], ["y"], name="pow")]
    elif name == "reducesum":
        # x [4,64] -> ReduceSum(axis 1) -> y [4]
        nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0, name="reducesum")]
        ints["axes"] = np.array([1], np.int64)
    elif name == "cast":
        # x (FP32) -> Cast(to target) -> y
        nodes = [helper.make_node("Cast", ["x"], ["y"], to=cast_to, name="cast")]
    else:
        # x [2,8] -> Softmax(axis -1) -> y   (a naive exp(max/2) overflows; max-subtraction does not)
        nodes = [helper.make_node("Softmax", ["x"], ["y"], axis=-1, name="softmax")]
    return design, nodes, ints


MICRO_PROBES = tuple(DESIGNS)


def _assemble(name: str, fmt: NumberFormat, elem: int, opset: int) -> onnx.ModelProto:
    design, nodes, ints = _graph(name, fmt, elem)
    np_dtype = helper.tensor_dtype_to_np_dtype(elem)
    # The Cast probe's input is FP32 whatever the target: the Cast is what it probes.
    inputs = [
        helper.make_tensor_value_info(k, TensorProto.FLOAT if name == "cast" else elem, v.shape)
        for k, v in design.inputs.items()
    ]
    inits = [numpy_helper.from_array(v.astype(np_dtype), k) for k, v in design.weights.items()]
    inits += [numpy_helper.from_array(v, k) for k, v in ints.items()]
    out = helper.make_tensor_value_info("y", elem, None)
    graph = helper.make_graph(nodes, f"probe_{name}", inputs, [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="npuprep-probe")
    model.ir_version = 9
    # Give the output its inferred shape: board compilers and onnx.checker's full check want one.
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    model.graph.output[0].CopyFrom(inferred.graph.output[0])
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
        design = DESIGNS[name](fmt)
        reference = _assemble(name, fmt, TensorProto.FLOAT, opset)
        target = None if elem == TensorProto.FLOAT else _assemble(name, fmt, elem, opset)
        probes.append(ProbeModel(name, design.unit, reference, target, dict(design.inputs), ("y",)))
    return probes
