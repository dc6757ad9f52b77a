"""Emulated target numerics: `y = Op(x)` -> `y = Cast32(Cast16(Clip?(Op(x))))` inside an FP32 graph.

Running an FP16 model on onnxruntime's CPU provider computes much of it in FP32 and hides
overflow. Explicit Cast pairs inside an FP32 graph are kept by the runtime, so they round
and overflow as the target would. Tensor names are preserved: the producer writes
`<name>__fp32` and the rounding chain writes `<name>`, so the emulated model can be compared
with the reference tensor by tensor. Nodes pinned to FP32 keep their outputs and weights;
where an FP32 value enters a non-pinned node (graph input, pinned node's output) it is
rounded once, as the Cast at the island border would on the target.

What emulation cannot show: accumulation in FP16 inside one op (a Conv or MatMul with
FP16 accumulators), vendor kernels that compute wider or narrower than their I/O format.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.errors import NpuprepError
from npuprep.graph import infer_tensors, node_label, to_array, walk_graphs
from npuprep.numerics import NumberFormat
from npuprep.ops import DATA_MOVEMENT_OPS, FP32_ONLY_INPUTS
from npuprep.opsets import WORKING_OPSET, at_least, check_opset_supported

SUFFIX = "__fp32"
FP8_MIN_OPSET = 19

LIMITS = (
    "emulation rounds every tensor a node stores, but cannot show low-precision accumulation inside "
    "one op (a Conv or MatMul that accumulates in its I/O format, not FP32) or vendor kernels "
    "that compute wider or narrower than their I/O format"
)


@dataclass(frozen=True)
class Emulation:
    """An FP32 model that rounds like the target, and what was rounded."""

    model: onnx.ModelProto
    fmt: NumberFormat
    saturate: bool
    rounded_tensors: tuple[str, ...]
    rounded_weights: tuple[str, ...]
    pinned_nodes: tuple[str, ...]
    upgraded_from_opset: int | None = None


def emulate(
    model: onnx.ModelProto,
    fmt: NumberFormat,
    *,
    saturate: bool,
    pinned_nodes: Iterable[str] = (),
    round_inputs: bool = True,
    round_weights: bool = True,
    weights_in_graph: bool = False,
) -> Emulation:
    """Build the emulation of `model` on a target computing in `fmt`.

    `saturate` says whether overflow clips to +-max (a saturating engine, or FP8 Cast with
    saturate=1) or gives Inf/NaN. It is passed explicitly: it comes from the target profile
    or from a probe, never from the format. The emulation graph needs opset 13 (19 for FP8
    Cast); an older model is emulated on a copy upgraded by onnx's version converter (tensor
    names kept), or refused with the reason. `weights_in_graph`: weights are rounded by the
    same chain of nodes as activations instead of being replaced by rounded copies, so the
    emulation keeps the model's initialisers byte for byte (a compare graph then holds one
    set of weights for both models).
    """
    if fmt.name == "fp32":
        raise NpuprepError("emulating fp32 is the reference itself; pick fp16, bf16 or fp8")
    check_opset_supported(model, "emulation")
    fp8 = fmt.name.startswith("fp8")
    if fp8:
        model, upgraded_from = at_least(model, FP8_MIN_OPSET, why="FP8 emulation needs FP8 Cast")
    else:
        model, upgraded_from = at_least(model, WORKING_OPSET, why="emulating an older opset")
    pinned = set(pinned_nodes)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    types = infer_tensors(model).types
    builder = _ChainBuilder(fmt, saturate)
    rounded: list[str] = []
    weights: list[str] = []

    # A lowered model may already hold `<y>__fp32` (the FP32 tensor a Cast turns into output y).
    taken = {n for s in walk_graphs(out.graph) for n in _defined(s.graph)}
    for scope in walk_graphs(out.graph):
        graph = scope.graph
        builder.new_scope()
        fp32_only = {name for node in graph.node for pos, name in enumerate(node.input)
                     if pos in FP32_ONLY_INPUTS.get(node.op_type, ())}
        local_producers = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
        readers = _reader_index(graph)
        inits = {i.name: i for i in graph.initializer}
        position = {id(n): i for i, n in enumerate(graph.node)}
        # A reader inside a Loop/If/Scan body runs where its top-level node runs.
        owner = _owners(graph)
        round_after: set[int] = set()  # indices of nodes whose outputs round their weight
        new_nodes: list[onnx.NodeProto] = []

        if round_weights:
            for name, init in inits.items():
                if init.data_type != TensorProto.FLOAT or name in fp32_only:
                    continue
                weight_readers = readers.get(name, [])
                unpinned = [n for n in weight_readers if node_label(n) not in pinned]
                if not unpinned:
                    continue
                if weights_in_graph and all(n.op_type in DATA_MOVEMENT_OPS and name in n.input
                                            and id(n) in position for n in unpinned):
                    # Rounding is monotone and elementwise, so an op that only moves or
                    # selects values may round its output instead: an embedding lookup then
                    # rounds the rows it reads, not its whole table on every run.
                    round_after.update(position[id(n)] for n in unpinned)
                    weights.append(name)
                    continue
                # A subgraph that captures the weight reads it by name: it gets a rounded copy.
                if weights_in_graph and all(name in n.input for n in unpinned):
                    alias = builder.fresh(name)
                    for node in unpinned:
                        _rename_input(node, name, alias)
                    # Right before its first reader: a session running nodes in this order
                    # holds one rounded weight at a time, not all of them from the start.
                    first = min(owner[id(n)] for n in unpinned)
                    builder.before.setdefault(first, []).extend(builder.chain(name, alias))
                    weights.append(name)
                    continue
                value = to_array(init)
                low = fmt.round(value, saturate=saturate)
                if np.array_equal(low, value, equal_nan=True):
                    continue
                if len(unpinned) < len(weight_readers):
                    # Shared with a pinned node: the pinned node keeps the FP32 original.
                    copy = numpy_helper.from_array(low, builder.fresh(name))
                    graph.initializer.append(copy)
                    for node in unpinned:
                        _rename_input(node, name, copy.name)
                else:
                    init.CopyFrom(numpy_helper.from_array(low, name))
                weights.append(name)

        # FP32 values entering non-pinned nodes: graph inputs and pinned nodes' outputs.
        entering: list[str] = []
        if round_inputs and scope.is_main:
            entering += [vi.name for vi in graph.input if vi.name not in inits]
        entering += [o for n in graph.node if node_label(n) in pinned for o in n.output if o]
        for name in entering:
            if types.get(name) != TensorProto.FLOAT or name in fp32_only:
                continue
            unpinned = [n for n in readers.get(name, []) if node_label(n) not in pinned]
            if not unpinned:
                continue
            alias = builder.fresh(name)
            for node in unpinned:
                _rename_input(node, name, alias)
            chain = builder.chain(name, alias)
            if name in local_producers:
                # Keep topological order: the chain goes right after the pinned producer.
                builder.after.setdefault(local_producers[name], []).extend(chain)
            else:
                new_nodes += chain
            rounded.append(name)

        for index, node in enumerate(graph.node):
            new_nodes += builder.before.pop(index, [])
            new_nodes.append(node)
            new_nodes += builder.after.pop(index, [])
            if node_label(node) in pinned or not (stores_rounded_values(node) or index in round_after):
                continue
            for i, name in enumerate(node.output):
                if not name or types.get(name) != TensorProto.FLOAT or name in fp32_only:
                    continue
                if node.op_type == "Constant" and all(node_label(n) in pinned for n in readers.get(name, [])):
                    continue  # a constant only pinned nodes read is an FP32 weight of theirs
                pre = name + SUFFIX
                if pre in taken:
                    pre = builder.fresh(pre)
                taken.add(pre)
                node.output[i] = pre
                new_nodes += builder.chain(pre, name)
                rounded.append(name)
        del graph.node[:]
        graph.node.extend(builder.constants + new_nodes)
        # Stale shapes would name tensors that are now produced elsewhere; drop them.
        del graph.value_info[:]

    return Emulation(out, fmt, saturate, tuple(rounded), tuple(weights), tuple(sorted(pinned)),
                     upgraded_from)


def _defined(graph: onnx.GraphProto) -> set[str]:
    names = {vi.name for vi in list(graph.input) + list(graph.output)}
    return names | {i.name for i in graph.initializer} | {o for n in graph.node for o in n.output if o}


class _ChainBuilder:
    """Makes rounding chains with unique names; Clip bounds are shared per graph scope."""

    def __init__(self, fmt: NumberFormat, saturate: bool) -> None:
        self.fmt = fmt
        self.saturate = saturate
        self.fp8 = fmt.name.startswith("fp8")
        self.counter = 0
        self.constants: list[onnx.NodeProto] = []
        self.after: dict[int, list[onnx.NodeProto]] = {}
        self.before: dict[int, list[onnx.NodeProto]] = {}
        self.bounds: tuple[str, str] | None = None
        self.compare_op = "Greater"

    def new_scope(self) -> None:
        self.constants = []
        self.after = {}
        self.before = {}
        self.bounds = None

    def fresh(self, base: str) -> str:
        self.counter += 1
        return f"{base}__emu{self.counter}"

    def _node(self, nodes: list[onnx.NodeProto], op: str, inputs: list[str], dst: str) -> str:
        out = self.fresh(dst)
        nodes.append(helper.make_node(op, inputs, [out], name=self.fresh("emu_" + op.lower())))
        return out

    def _clip_bounds(self) -> tuple[str, str]:
        if self.bounds is None:
            names = (self.fresh("emu_lo"), self.fresh("emu_hi"))
            for name, value in zip(names, (-self.fmt.max, self.fmt.max), strict=True):
                self.constants.append(helper.make_node(
                    "Constant", [], [name], name=name,
                    value=numpy_helper.from_array(np.array(value, np.float32))))
            self.bounds = names
        return self.bounds

    def _fp8_overflow_bounds(self) -> tuple[str, str, str]:
        """Constants for the FP8 overflow guard: threshold, Inf, and the comparison op."""
        if self.bounds is None:
            threshold = self.fmt.overflow_threshold
            # Round-to-nearest-even decides the tie at the threshold itself.
            tie_overflows = not np.isfinite(_rne_cast(self.fmt, threshold))
            names = (self.fresh("emu_threshold"), self.fresh("emu_inf"))
            for name, value in zip(names, (threshold, np.inf), strict=True):
                self.constants.append(helper.make_node(
                    "Constant", [], [name], name=name,
                    value=numpy_helper.from_array(np.array(value, np.float32))))
            self.bounds = names
            self.compare_op = "GreaterOrEqual" if tie_overflows else "Greater"
        return self.bounds[0], self.bounds[1], self.compare_op

    def chain(self, src: str, dst: str) -> list[onnx.NodeProto]:
        nodes: list[onnx.NodeProto] = []
        cur = src
        if self.saturate and not self.fp8:
            lo, hi = self._clip_bounds()
            clipped = self.fresh(dst)
            nodes.append(helper.make_node("Clip", [cur, lo, hi], [clipped], name=self.fresh("emu_clip")))
            cur = clipped
        if self.fp8 and not self.saturate:
            # onnxruntime 1.32's FP8 Cast(saturate=0) returns 448 for E4M3 values in
            # [480, 496) and NaN for E5M2 values in [61440, 65536): send everything past
            # the overflow threshold to +-Inf first, which both casts handle correctly.
            threshold, inf, op = self._fp8_overflow_bounds()
            over = self.fresh(dst)
            nodes.append(helper.make_node(op, [self._node(nodes, "Abs", [cur], dst), threshold], [over],
                                          name=self.fresh("emu_over")))
            blown = self._node(nodes, "Mul", [cur, inf], dst)
            guarded = self.fresh(dst)
            nodes.append(helper.make_node("Where", [over, blown, cur], [guarded], name=self.fresh("emu_guard")))
            cur = guarded
        low = self.fresh(dst)
        attrs = {"saturate": int(self.saturate)} if self.fp8 else {}
        nodes.append(helper.make_node("Cast", [cur], [low], to=self.fmt.onnx_type,
                                      name=self.fresh("emu_down"), **attrs))
        nodes.append(helper.make_node("Cast", [low], [dst], to=TensorProto.FLOAT, name=self.fresh("emu_up")))
        return nodes


def _rne_cast(fmt: NumberFormat, value: float) -> float:
    """`value` cast to `fmt` by round-to-nearest-even (ml_dtypes), back as a float."""
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.array([value], np.float32).astype(fmt.np_dtype).astype(np.float32)[0])


def stores_rounded_values(node: onnx.NodeProto) -> bool:
    """Whether the node's float outputs need their own rounding.

    Every float input of a non-pinned node is already in the target format, so ops that
    only move or select values produce representable values: a Cast pair there is exact.
    """
    if node.op_type == "Cast":
        return _cast_to(node) == TensorProto.FLOAT
    if node.op_type in ("Resize", "Upsample"):
        # Nearest-neighbour resizing copies input values (an FCN's decoder upsampling): no
        # rounding of its own, so attribution never ranks it as a layer to keep FP32.
        mode = next((a.s for a in node.attribute if a.name == "mode"), b"nearest")
        return mode != b"nearest"
    return node.op_type not in DATA_MOVEMENT_OPS


def _cast_to(node: onnx.NodeProto) -> int:
    for attr in node.attribute:
        if attr.name == "to":
            return attr.i
    return 0


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _owners(graph: onnx.GraphProto) -> dict[int, int]:
    """id of every node, nested ones included -> index of the top-level node it runs under."""
    owner: dict[int, int] = {}

    def add(node: onnx.NodeProto, at: int) -> None:
        owner[id(node)] = at
        for sub in _subgraphs(node):
            for inner in sub.node:
                add(inner, at)

    for i, node in enumerate(graph.node):
        add(node, i)
    return owner


def _reader_index(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Name -> nodes that read it: direct readers, and readers inside subgraphs that capture
    it from this graph (a subgraph's own names hide outer ones). Built once per graph."""
    index: dict[str, dict[int, onnx.NodeProto]] = {}

    def add(g: onnx.GraphProto, hidden: frozenset[str]) -> None:
        for node in g.node:
            for name in node.input:
                if name and name not in hidden:
                    index.setdefault(name, {})[id(node)] = node
            for sub in _subgraphs(node):
                local = {i.name for i in sub.input} | {i.name for i in sub.initializer}
                local |= {o for m in sub.node for o in m.output}
                add(sub, hidden | local)

    add(graph, frozenset())
    return {name: list(nodes.values()) for name, nodes in index.items()}


def _rename_input(node: onnx.NodeProto, old: str, new: str) -> None:
    for i, n in enumerate(node.input):
        if n == old:
            node.input[i] = new
