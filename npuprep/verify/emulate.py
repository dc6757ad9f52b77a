"""Emulated target numerics: `y = Op(x)` -> `y = Cast32(Cast16(Clip?(Op(x))))` inside an FP32 graph.

Running an FP16 model on onnxruntime's CPU provider computes much of it in FP32 and hides
overflow. Explicit Cast pairs inside an FP32 graph are kept by the runtime, so they round
and overflow as the target would. Tensor names are preserved: the producer writes
`<name>__fp32` and the rounding chain writes `<name>`, so the emulated model can be compared
with the reference tensor by tensor. Nodes pinned to FP32 keep their outputs and weights.

What emulation cannot show: accumulation in FP16 inside one op (a Conv or MatMul with
FP16 accumulators), vendor kernels that compute wider or narrower than their I/O format.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.errors import NpuprepError
from npuprep.graph import node_label, tensor_types, walk_graphs
from npuprep.model_io import model_opset
from npuprep.numerics import NumberFormat
from npuprep.ops import FP32_ONLY_INPUTS

SUFFIX = "__fp32"


@dataclass(frozen=True)
class Emulation:
    """An FP32 model that rounds like the target, and what was rounded."""

    model: onnx.ModelProto
    fmt: NumberFormat
    saturate: bool
    rounded_tensors: tuple[str, ...]
    rounded_weights: tuple[str, ...]
    pinned_nodes: tuple[str, ...]


def emulate(
    model: onnx.ModelProto,
    fmt: NumberFormat,
    *,
    saturate: bool,
    pinned_nodes: Iterable[str] = (),
    round_inputs: bool = True,
    round_weights: bool = True,
) -> Emulation:
    """Build the emulation of `model` on a target computing in `fmt`.

    `saturate` says whether overflow clips to +-max (a saturating engine, or FP8 Cast with
    saturate=1) or gives Inf/NaN. It is passed explicitly: it comes from the target profile
    or from a probe, never from the format.
    """
    if fmt.name == "fp32":
        raise NpuprepError("emulating fp32 is the reference itself; pick fp16, bf16 or fp8")
    opset = model_opset(model)
    fp8 = fmt.name.startswith("fp8")
    if fp8 and opset < 19:
        raise NpuprepError(f"FP8 emulation needs opset >= 19 (the model declares {opset}); "
                           "upgrade it with onnx.version_converter first")
    if opset < 13:
        raise NpuprepError(f"emulation needs opset >= 13 (the model declares {opset})")
    pinned = set(pinned_nodes)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    types = tensor_types(model)
    rounded: list[str] = []
    weights: list[str] = []
    counter = [0]

    def fresh(base: str) -> str:
        counter[0] += 1
        return f"{base}__emu{counter[0]}"

    def rounding_chain(src: str, dst: str) -> list[onnx.NodeProto]:
        nodes: list[onnx.NodeProto] = []
        cur = src
        if saturate and not fp8:
            clipped = fresh(dst)
            lo = helper.make_node("Constant", [], [fresh(dst)],
                                  value=numpy_helper.from_array(np.array(-fmt.max, np.float32)))
            hi = helper.make_node("Constant", [], [fresh(dst)],
                                  value=numpy_helper.from_array(np.array(fmt.max, np.float32)))
            nodes += [lo, hi, helper.make_node("Clip", [cur, lo.output[0], hi.output[0]], [clipped],
                                               name=fresh("emu_clip"))]
            cur = clipped
        low = fresh(dst)
        attrs = {"saturate": int(saturate)} if fp8 else {}
        nodes.append(helper.make_node("Cast", [cur], [low], to=fmt.onnx_type, name=fresh("emu_down"), **attrs))
        nodes.append(helper.make_node("Cast", [low], [dst], to=TensorProto.FLOAT, name=fresh("emu_up")))
        return nodes

    for scope in walk_graphs(out.graph):
        graph = scope.graph
        inits = {i.name: i for i in graph.initializer}
        fp32_only: set[str] = set()
        consumers_pinned: dict[str, bool] = {}
        for node in graph.node:
            is_pinned = node_label(node) in pinned
            for pos, name in enumerate(node.input):
                if pos in FP32_ONLY_INPUTS.get(node.op_type, ()):
                    fp32_only.add(name)
                consumers_pinned[name] = consumers_pinned.get(name, True) and is_pinned

        new_nodes: list[onnx.NodeProto] = []
        if round_inputs and scope.is_main:
            for vi in graph.input:
                if vi.name in inits or types.get(vi.name) != TensorProto.FLOAT:
                    continue
                if consumers_pinned.get(vi.name, True) or vi.name in fp32_only:
                    continue
                # Consumers read the rounded copy; the graph input keeps its name.
                alias = fresh(vi.name)
                for node in graph.node:
                    for i, name in enumerate(node.input):
                        if name == vi.name:
                            node.input[i] = alias
                new_nodes += rounding_chain(vi.name, alias)
                rounded.append(vi.name)

        if round_weights:
            for name, init in inits.items():
                if init.data_type != TensorProto.FLOAT or name in fp32_only:
                    continue
                if consumers_pinned.get(name, True):
                    continue
                value = numpy_helper.to_array(init)
                low = fmt.round(value, saturate=saturate)
                if np.array_equal(low, value, equal_nan=True):
                    continue
                if not _all_consumers_unpinned(graph, name, pinned):
                    # Shared with a pinned node: the pinned node keeps the FP32 original.
                    copy = numpy_helper.from_array(low, fresh(name))
                    graph.initializer.append(copy)
                    for node in graph.node:
                        if node_label(node) in pinned:
                            continue
                        for i, n in enumerate(node.input):
                            if n == name:
                                node.input[i] = copy.name
                else:
                    init.CopyFrom(numpy_helper.from_array(low, name))
                weights.append(name)

        for node in graph.node:
            new_nodes.append(node)
            if node_label(node) in pinned or node.op_type == "Cast" and _cast_to(node) != TensorProto.FLOAT:
                continue
            for i, name in enumerate(node.output):
                if not name or types.get(name) != TensorProto.FLOAT or name in fp32_only:
                    continue
                pre = name + SUFFIX
                node.output[i] = pre
                new_nodes += rounding_chain(pre, name)
                rounded.append(name)
        del graph.node[:]
        graph.node.extend(new_nodes)
        # Stale shapes would name tensors that are now produced elsewhere; drop them.
        del graph.value_info[:]

    return Emulation(out, fmt, saturate, tuple(rounded), tuple(weights), tuple(sorted(pinned)))


def _cast_to(node: onnx.NodeProto) -> int:
    for attr in node.attribute:
        if attr.name == "to":
            return attr.i
    return 0


def _all_consumers_unpinned(graph: onnx.GraphProto, name: str, pinned: set[str]) -> bool:
    return all(node_label(n) not in pinned for n in graph.node if name in n.input)
