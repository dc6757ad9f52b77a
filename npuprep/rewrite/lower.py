"""Lower to the target precision: `FP32 graph -> FP16 graph` with pinned islands kept FP32 behind Cast pairs.

Every FLOAT tensor and initialiser outside pinned nodes becomes the target format; graph
inputs and outputs stay FP32 unless `io_types="target"`. BF16 is normalised to FP32 first.
The traps other converters fall into are avoided on purpose:

- Cast `to` attributes follow the precision of the Cast node; ConstantOfShape and Constant
  values are converted with their consumers;
- inputs that must stay FP32 (Resize scales, ...: npuprep.ops.FP32_ONLY_INPUTS) and the
  nodes that compute them (shape computations) are left FP32;
- If/Loop/Scan bodies are lowered too, consistently with the outer tensors they read and
  with the owner's outputs;
- an initialiser read by pinned and unpinned nodes is duplicated, never re-typed under the
  pinned one;
- weights beyond the target range are never clipped: their node stays FP32 and the
  result says so; mask constants (-inf or FP32 lowest in an additive mask) become -max,
  FP16 ones too (a model already FP16, or a mask stored FP16 and Cast up): -inf -> -65504;
- value_info is dropped (stale), nodes are sorted, names are derived from tensor names,
  so the output is byte-identical across runs; the result passes onnx.checker.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.errors import NpuprepError
from npuprep.graph import (
    constant_node_value,
    copy_fields,
    inferred_with_schema_types,
    node_label,
    to_array,
    topological_order,
    walk_graphs,
)
from npuprep.model_io import PROTOBUF_LIMIT, WeightScratch
from npuprep.numerics import MASK_SCALE, NumberFormat, get_format
from npuprep.ops import FP32_ONLY_INPUTS
from npuprep.opsets import at_least, bf16_opset
from npuprep.rewrite.graph_ops import check_model
from npuprep.rewrite.lower_masks import map_fp16_masks, mask_readers

_CHUNK = 1 << 20  # elements a weight is rounded in at a time

FLOAT = TensorProto.FLOAT
# Lowered initialisers at least this large go to the scratch file when lower() has one.
SCRATCH_MIN_BYTES = 64 * 2**10
# Ops kept FP32 whatever the plan: their output type is fixed by an attribute or tied to
# FP32-only inputs (the window and mel-matrix generators: `output_datatype`, FP32 unless
# set), or they are quantisation/random ops.
FORCED_FP32_OPS = frozenset({
    "Range", "RoiAlign", "NonMaxSuppression", "EyeLike", "RandomNormal", "RandomUniform",
    "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli", "DequantizeLinear",
    "QuantizeLinear", "DynamicQuantizeLinear", "HannWindow", "HammingWindow", "BlackmanWindow",
    "MelWeightMatrix", "TfIdfVectorizer",
})
# Outputs whose type does not follow the node's inputs (LayerNormalization statistics use
# stash_type, FP32 by default).
_FIXED_FLOAT_OUTPUTS = {("LayerNormalization", 1), ("LayerNormalization", 2)}
_CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})
# Scatters that sum or multiply into their data accumulate in their I/O format (a graph
# network's message sums), and onnxruntime (1.32) has no FP16 kernel for them: kept FP32.
_ACCUMULATING_SCATTERS = frozenset({"ScatterElements", "ScatterND"})
_ACCUMULATING_REDUCTIONS = frozenset({b"add", b"mul"})


@dataclass(frozen=True)
class Lowered:
    """The lowered model and what lowering did.

    `pinned_nodes`: every node kept FP32 (those asked for plus `forced_fp32`, which maps
    node -> why it had to stay FP32: weights beyond range, shape computation, ...).
    `cast_count`: Cast nodes inserted at precision borders (graph I/O included).
    `mapped_masks`: mask constant -> values set to -max; `flushed_weights`: initialiser ->
    non-zero values that became 0 in the target format (underflow, reported not hidden).
    `fp32_output_nodes`: If nodes whose outputs stay FP32 because a pinned node inside a
    branch writes one; they compute nothing themselves, their bodies are lowered per node.
    """

    model: onnx.ModelProto
    fmt: str
    io_types: str
    cast_count: int
    pinned_nodes: tuple[str, ...]
    forced_fp32: dict[str, str] = field(default_factory=dict)
    converted_initialisers: tuple[str, ...] = ()
    duplicated_initialisers: tuple[str, ...] = ()
    kept_fp32_initialisers: tuple[str, ...] = ()
    mapped_masks: dict[str, int] = field(default_factory=dict)
    normalised_bf16: tuple[str, ...] = ()
    flushed_weights: dict[str, int] = field(default_factory=dict)
    fp32_output_nodes: tuple[str, ...] = ()
    # Where the model's large lowered weights are kept (lower(scratch=...)): held here so
    # the file lives as long as the model that refers to it.
    scratch: WeightScratch | None = None


@dataclass
class _Weight:
    name: str
    graph: onnx.GraphProto
    init: onnx.TensorProto | None
    const_node: onnx.NodeProto | None
    const_value: np.ndarray | None = None
    uses: list[tuple[onnx.NodeProto, int, bool]] = field(default_factory=list)

    @property
    def value(self) -> np.ndarray:
        """The FP32 values, read from the initialiser on each access: a model's weights are
        never all held as arrays at once (one at a time, as each is checked or converted)."""
        if self.init is not None:
            return to_array(self.init)
        assert self.const_value is not None
        return self.const_value


def lower(
    model: onnx.ModelProto,
    fmt: NumberFormat | str,
    *,
    pinned_nodes: Iterable[str] = (),
    io_types: str = "fp32",
    scratch: WeightScratch | None = None,
) -> Lowered:
    """Lower `model` to `fmt` (fp16 or bf16), keeping `pinned_nodes` in FP32.

    `io_types="fp32"` keeps float graph inputs and outputs FP32 (Casts at the boundary);
    `"target"` gives them the target type. With `scratch`, lowered initialisers of at least
    SCRATCH_MIN_BYTES are written there and the model refers to them (it holds no weight).
    """
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    if fmt.name not in ("fp16", "bf16"):
        raise NpuprepError(f"lowering to {fmt.name} is not supported (fp16 or bf16); use "
                           "emulation to judge FP8")
    if io_types not in ("fp32", "target"):
        raise NpuprepError(f"io_types must be 'fp32' or 'target' (got '{io_types}')")
    work = onnx.ModelProto()
    work.CopyFrom(model)
    # The checker the lowered model must pass requires a graph name; some exporters leave none.
    work.graph.name = work.graph.name or "main_graph"
    if fmt.name == "bf16":
        # ONNX added BF16 op by op: a model lowered to it declares the opset its ops need.
        work, _ = at_least(work, bf16_opset(work, FORCED_FP32_OPS), why="lowering to BF16")
    normalised = _normalise_bf16(work)
    return _Lowering(work, fmt, set(pinned_nodes), io_types, normalised, scratch).run()


class _Lowering:
    def __init__(self, model: onnx.ModelProto, fmt: NumberFormat, pinned: set[str],
                 io_types: str, normalised: list[str], scratch: WeightScratch | None = None) -> None:
        self.model = model
        self.scratch = scratch
        self.fmt = fmt
        self.low_type = fmt.onnx_type
        self.pinned = pinned
        self.io_types = io_types
        self.normalised = normalised
        self.types = _infer_types(model)
        self.scopes = list(walk_graphs(model.graph))
        self.scope_index = {id(s.graph): i for i, s in enumerate(self.scopes)}
        self.low: dict[int, bool] = {}
        self.forced: dict[str, str] = {}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.body_input_owner: dict[str, onnx.NodeProto] = {}
        self.casts = 0
        self.cast_cache: dict[tuple[int, str, int], str] = {}
        self.weights: dict[str, _Weight] = {}
        self.mapped: dict[str, int] = {}
        self.mask_readers: set[int] = set()
        self.flushed: dict[str, int] = {}
        self.out_of_range: dict[str, tuple[bool, bool, float]] = {}
        self.names = {name for s in self.scopes for name in _names(s.graph)}
        self.output_casts: list[tuple[str, str, int]] = []
        self.high_labels: set[str] = set()
        self.fp32_outputs: list[str] = []
        # Message wrappers are keyed by id(); holding them keeps those ids valid.
        self._alive = [n for s in self.scopes for n in s.graph.node]
        # Each Cast's target as the model wrote it: lowering rewrites `to` in place, and a
        # reader's Cast decision must not depend on whether its producer was lowered first.
        # Keyed by id(): the node objects stay alive in _alive, so the ids stay theirs.
        self.cast_to = {id(n): _attr_int(n, "to") for n in self._alive if n.op_type == "Cast"}

    # -- decisions --------------------------------------------------------------------

    def run(self) -> Lowered:
        self._index()
        self.mapped.update(map_fp16_masks(self.scopes, constant_node_value))
        scalars = {name for name, w in self.weights.items() if (
            _numel(w.init) if w.init is not None else np.size(w.const_value)) == 1
            and float(w.value.reshape(-1)[0]) <= MASK_SCALE}
        self.mask_readers = mask_readers(self.scopes, scalars)
        self._decide()
        converted, duplicated, kept = self._convert_weights()
        self._rename_main_outputs()
        # Bodies first: lowering a graph re-adds its nodes, which copies the bodies in them.
        for scope in reversed(self.scopes):
            self._lower_scope(scope)
        self._fix_main_io()
        # The model's own bodies now: the scopes indexed above are the copies lowering replaced.
        for scope in reversed(list(walk_graphs(self.model.graph))):
            _sort(scope.graph)
            del scope.graph.value_info[:]
        check_model(self.model)
        pinned = sorted(self.high_labels & (self.pinned | set(self.forced)))
        return Lowered(self.model, self.fmt.name, self.io_types, self.casts, tuple(pinned),
                       dict(sorted(self.forced.items())), tuple(converted), tuple(duplicated),
                       tuple(kept), dict(sorted(self.mapped.items())), tuple(self.normalised),
                       dict(sorted(self.flushed.items())), tuple(sorted(self.fp32_outputs)),
                       self.scratch)

    def _index(self) -> None:
        for scope in self.scopes:
            g = scope.graph
            for node in g.node:
                for out in node.output:
                    if out:
                        self.producer[out] = node
            if scope.owner is not None and scope.owner.op_type in ("Loop", "Scan"):
                for vi in g.input:
                    self.body_input_owner[vi.name] = scope.owner
            overridable = {vi.name for vi in g.input}
            for init in g.initializer:
                # An initialiser that is also a graph input is a default the caller may
                # replace: it keeps the input's declared type.
                if init.data_type == FLOAT and init.name not in overridable:
                    self.weights[init.name] = _Weight(init.name, g, init, None)
            for node in g.node:
                if node.op_type == "Constant" and node.output:
                    value = constant_node_value(node)
                    if value is not None and value.dtype == np.float32:
                        self.weights[node.output[0]] = _Weight(node.output[0], g, None, node, value)

    def _decide(self) -> None:
        high_scopes: set[int] = set()
        for scope in self.scopes:
            g = scope.graph
            inherited = scope.owner is not None and (
                id(scope.owner) in high_scopes or not self.low.get(id(scope.owner), True))
            shape_nodes = _shape_computations(g, self.types, self.weights)
            for node in g.node:
                label = node_label(node)
                reason = None
                if inherited:
                    reason = "inside an FP32 control-flow body"
                elif label in self.pinned:
                    reason = "pinned"
                elif node.op_type in FORCED_FP32_OPS or node.domain not in ("", "ai.onnx"):
                    reason = f"{node.op_type} stays FP32 (type fixed by attribute or FP32-only inputs)"
                elif node.op_type in _ACCUMULATING_SCATTERS and _attr_bytes(
                        node, "reduction") in _ACCUMULATING_REDUCTIONS:
                    reason = f"{node.op_type} accumulates (reduction) and stays FP32"
                elif id(node) in shape_nodes:
                    reason = "computes a shape or an FP32-only input"
                elif node.op_type != "Constant" and any(
                        t and t not in self.types for t in [*node.input, *node.output]):
                    reason = "a tensor type is unknown to shape inference"
                else:
                    reason = self._range_reason(node)
                self.low[id(node)] = reason is None
                if reason is not None:
                    self.high_labels.add(label)
                if reason is not None and reason != "pinned" and label not in self.pinned:
                    self.forced[label] = reason
                if reason is not None and node.op_type in _CONTROL_FLOW:
                    high_scopes.add(id(node))
        self._keep_if_outputs()

    def _keep_if_outputs(self) -> None:
        """An If whose branch output a pinned node writes keeps FP32 outputs (the island
        closes there); its branches stay lowered node by node."""
        for scope in self.scopes:
            owner = scope.owner
            if owner is None or owner.op_type != "If" or not self.low.get(id(owner), False):
                continue
            made = {o: n for n in scope.graph.node for o in n.output if o}
            if any(vi.name in made and not self.low[id(made[vi.name])] for vi in scope.graph.output):
                self.low[id(owner)] = False
                self.fp32_outputs.append(node_label(owner))

    def _range_reason(self, node: onnx.NodeProto) -> str | None:
        """Why `node` cannot take its weights in the target format, or None."""
        limit = self.fmt.max
        for pos, name in enumerate(node.input):
            w = self.weights.get(name)
            if w is None or pos in FP32_ONLY_INPUTS.get(node.op_type, ()):
                continue
            if name not in self.out_of_range:
                self.out_of_range[name] = _beyond(w.value, limit)
            beyond, negative_only, largest = self.out_of_range[name]
            if not beyond or (id(node) in self.mask_readers and negative_only):
                continue
            return (f"weight '{name}' reaches {largest:g}, beyond "
                    f"{self.fmt.name} max {limit:g} (kept FP32, not clipped)")
        if node.op_type == "ConstantOfShape":
            value = _fill_value(node)
            if value.dtype == np.float32 and not np.all(np.abs(value) <= limit):
                if not np.all(value < 0):
                    return f"ConstantOfShape value {value.reshape(-1)[0]:g} is beyond {self.fmt.name} range"
        return None

    # -- weights ----------------------------------------------------------------------

    def _convert_weights(self) -> tuple[list[str], list[str], list[str]]:
        for scope in self.scopes:
            for node in scope.graph.node:
                low = self.low[id(node)]
                for pos, name in enumerate(node.input):
                    w = self.weights.get(name)
                    if w is None:
                        continue
                    wants_low = low and pos not in FP32_ONLY_INPUTS.get(node.op_type, ())
                    w.uses.append((node, pos, wants_low))
        for scope in self.scopes:
            for out in scope.graph.output:
                w = self.weights.get(out.name)
                if w is not None:
                    # A weight that is also a graph output keeps the output's declared FP32.
                    w.uses.append((onnx.NodeProto(), -1, False))
        converted: list[str] = []
        duplicated: list[str] = []
        kept: list[str] = []
        for name, w in self.weights.items():
            lows = [u for u in w.uses if u[2]]
            if not lows:
                if w.uses:
                    kept.append(name)
                continue
            value = self._to_low(name, w.value, [u[0] for u in lows])
            if len(lows) == len(w.uses):
                self._set_weight(w, name, value, replace=True)
                converted.append(name)
                continue
            copy = self._fresh(f"{name}__{self.fmt.name}")
            self._set_weight(w, copy, value, replace=False)
            for node, pos, _ in lows:
                node.input[pos] = copy
            duplicated.append(name)
        return converted, duplicated, kept

    def _to_low(self, name: str, value: np.ndarray, users: list[onnx.NodeProto]) -> np.ndarray:
        beyond = self.out_of_range[name][0] if name in self.out_of_range else \
            _beyond(value, self.fmt.max)[0]
        if beyond:
            over = ~(np.abs(value) <= self.fmt.max)
            # Only masks reach here (other weights beyond range pinned their node).
            assert all(id(u) in self.mask_readers for u in users) and np.all(value[over] < 0)
            value = np.where(over, np.float32(-self.fmt.max), value)
            self.mapped[name] = int(over.sum())
        low = np.empty(value.shape, self.fmt.np_dtype)
        wide, narrow = value.reshape(-1), low.reshape(-1)
        flushed = 0
        # In chunks: a weight's whole-array temporaries cost more than the rounding on a GB
        # table (each fresh page is a fault).
        for start in range(0, wide.size, _CHUNK):
            part, out = wide[start:start + _CHUNK], narrow[start:start + _CHUNK]
            out[...] = part
            # Rounding maps only zeros and values under the smallest subnormal to zero. A 16-bit
            # zero is its bits bar the sign clear (an integer test: numpy compares FP16 slowly).
            flushed += int(np.count_nonzero((out.view(np.uint16) & np.uint16(0x7FFF)) == 0))
            flushed -= int(np.count_nonzero(part == 0))
        if flushed:
            self.flushed[name] = flushed
        return low

    def _set_weight(self, w: _Weight, name: str, value: np.ndarray, *, replace: bool) -> None:
        if self.scratch is not None and w.init is not None and value.nbytes >= SCRATCH_MIN_BYTES:
            tensor = self.scratch.anchor(value, name)
        else:
            tensor = numpy_helper.from_array(value, name)
        if w.init is not None:
            if replace:
                w.init.CopyFrom(tensor)
            else:
                w.graph.initializer.append(tensor)
            return
        assert w.const_node is not None
        if replace:
            del w.const_node.attribute[:]
            w.const_node.attribute.append(helper.make_attribute("value", tensor))
            return
        node = helper.make_node("Constant", [], [name], name=f"{name}_const", value=tensor)
        w.graph.node.insert(0, node)
        self.low[id(w.graph.node[0])] = True
        self.producer[name] = w.graph.node[0]

    # -- tensors ----------------------------------------------------------------------

    def _orig_type(self, name: str) -> int | None:
        return self.types.get(name)

    def _home(self, name: str) -> int | None:
        """The element type `name` has after lowering (before any Cast we add)."""
        t = self._orig_type(name)
        if t != FLOAT:
            return t
        if name in self.weights:
            return FLOAT
        owner = self.body_input_owner.get(name)
        if owner is not None:
            return self.low_type if self.low[id(owner)] else FLOAT
        node = self.producer.get(name)
        if node is None:
            main_inputs = {i.name for i in self.model.graph.input}
            return self.low_type if name in main_inputs and self.io_types == "target" else FLOAT
        if not self.low[id(node)]:
            return FLOAT
        pos = list(node.output).index(name)
        if (node.op_type, pos) in _FIXED_FLOAT_OUTPUTS:
            return FLOAT
        if node.op_type == "Cast":
            return FLOAT if self.cast_to.get(id(node), _attr_int(node, "to")) != FLOAT else self.low_type
        return self.low_type

    def _fresh(self, base: str) -> str:
        """`base`, or `base_2`, `base_3`... if the model already uses that name."""
        name, i = base, 1
        while name in self.names:
            i += 1
            name = f"{base}_{i}"
        self.names.add(name)
        return name

    def _cast(self, scope_id: int, src: str, to: int, out: list[onnx.NodeProto],
              dst: str | None = None) -> str:
        key = (scope_id, src, to)
        if dst is None and key in self.cast_cache:
            return self.cast_cache[key]
        suffix = "" if scope_id == 0 else f"__g{scope_id}"
        name = dst or self._fresh(f"{src}__to_{_short(to)}{suffix}")
        out.append(helper.make_node("Cast", [src], [name], name=f"Cast_{name}", to=to))
        self.low[id(out[-1])] = to != FLOAT
        self.casts += 1
        if dst is None:
            self.cast_cache[key] = name
        self.types[name] = to
        return name

    def _rename_main_outputs(self) -> None:
        """A lowered node writing a graph output writes `<y>__fp16`; a Cast writes `<y>`."""
        graph = self.model.graph
        for out in graph.output:
            if self._orig_type(out.name) != FLOAT:
                continue
            want = FLOAT if self.io_types == "fp32" else self.low_type
            home = self._home(out.name)
            node = self.producer.get(out.name)
            if home == want or node is None:
                continue
            inner = self._fresh(f"{out.name}__{_short(home)}")
            for scope in self.scopes:
                for n in scope.graph.node:
                    for i, name in enumerate(n.input):
                        if name == out.name:
                            n.input[i] = inner
                    for i, name in enumerate(n.output):
                        if name == out.name:
                            n.output[i] = inner
            self.producer[inner] = node
            self.types[inner] = FLOAT
            self.output_casts.append((inner, out.name, want))

    def _lower_scope(self, scope) -> None:  # noqa: ANN001 - GraphScope
        g = scope.graph
        sid = self.scope_index[id(g)]
        new_nodes: list[onnx.NodeProto] = []
        for node in list(g.node):
            low = self.low[id(node)]
            want = self.low_type if low else FLOAT
            fp32_only = FP32_ONLY_INPUTS.get(node.op_type, ())
            for i, name in enumerate(node.input):
                if not name or name in self.weights or self._orig_type(name) != FLOAT:
                    continue
                wanted = FLOAT if i in fp32_only else want
                if self._home(name) != wanted:
                    node.input[i] = self._cast(sid, name, wanted, new_nodes)
            if low and node.op_type == "Cast" and _attr_int(node, "to") == FLOAT:
                _set_attr_int(node, "to", self.low_type)
            if low and node.op_type == "ConstantOfShape":
                value = _fill_value(node)
                if value.dtype == np.float32:
                    value = np.maximum(value, np.float32(-self.fmt.max)).astype(self.fmt.np_dtype)
                    _set_attr_tensor(node, "value", value)
            new_nodes.append(node)
            if sid == 0:
                for inner, outer, want_out in self.output_casts:
                    if inner in node.output:
                        self._cast(sid, inner, want_out, new_nodes, dst=outer)
        if scope.owner is not None:
            self._fix_body_io(scope, sid, new_nodes)
        del g.node[:]
        g.node.extend(new_nodes)

    def _fix_body_io(self, scope, sid: int, new_nodes: list[onnx.NodeProto]) -> None:  # noqa: ANN001
        owner = scope.owner
        g = scope.graph
        want = self.low_type if self.low[id(owner)] else FLOAT
        if owner.op_type in ("Loop", "Scan"):
            for vi in g.input:
                if vi.type.tensor_type.elem_type == FLOAT:
                    vi.type.tensor_type.elem_type = want
        for vi in g.output:
            if self._orig_type(vi.name) != FLOAT and vi.type.tensor_type.elem_type != FLOAT:
                continue
            if self._home(vi.name) != want:
                dst = self._fresh(f"{vi.name}__out_{_short(want)}__g{sid}")
                vi.name = self._cast(sid, vi.name, want, new_nodes, dst=dst)
            vi.type.tensor_type.elem_type = want

    def _fix_main_io(self) -> None:
        graph = self.model.graph
        want = FLOAT if self.io_types == "fp32" else self.low_type
        for vi in list(graph.input) + list(graph.output):
            if vi.type.tensor_type.elem_type == FLOAT:
                vi.type.tensor_type.elem_type = want


def _names(graph: onnx.GraphProto) -> set[str]:
    names = {vi.name for vi in list(graph.input) + list(graph.output)}
    names |= {i.name for i in graph.initializer}
    names |= {o for n in graph.node for o in n.output if o}
    return names


def _short(onnx_type: int | None) -> str:
    return {TensorProto.FLOAT: "fp32", TensorProto.FLOAT16: "fp16",
            TensorProto.BFLOAT16: "bf16"}.get(onnx_type or 0, str(onnx_type))


def _normalise_bf16(model: onnx.ModelProto) -> list[str]:
    """BF16 initialisers, Constant values, Cast-to-BF16 and BF16 I/O become FP32 (in place).

    A Cast of an initialiser to FP32 (how BF16 exports often store weights) is folded into
    an FP32 initialiser, so the weight is seen, range-checked and lowered as a weight.
    """
    changed: list[str] = []
    bf16 = TensorProto.BFLOAT16
    for scope in walk_graphs(model.graph):
        g = scope.graph
        inits = {i.name: i for i in g.initializer}
        uses: dict[str, int] = {}
        for node in g.node:
            for name in node.input:
                uses[name] = uses.get(name, 0) + 1
        for node in list(g.node):
            src = inits.get(node.input[0]) if node.op_type == "Cast" and node.input else None
            if src is None or _attr_int(node, "to") != FLOAT or src.data_type not in (FLOAT, bf16):
                continue
            value = to_array(src).astype(np.float32)
            g.initializer.append(numpy_helper.from_array(value, node.output[0]))
            g.node.remove(node)
            changed.append(node_label(node))
            if uses.get(src.name) == 1 and src.name not in {o.name for o in g.output}:
                g.initializer.remove(src)
        for init in g.initializer:
            if init.data_type == bf16:
                init.CopyFrom(numpy_helper.from_array(to_array(init).astype(np.float32), init.name))
                changed.append(init.name)
        for node in g.node:
            if node.op_type == "Cast" and _attr_int(node, "to") == bf16:
                _set_attr_int(node, "to", FLOAT)
                changed.append(node_label(node))
            for attr_name in ("value",):
                value = _attr_tensor(node, attr_name)
                if value is not None and value.dtype.name == "bfloat16":
                    _set_attr_tensor(node, attr_name, value.astype(np.float32))
                    changed.append(node_label(node))
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.tensor_type.elem_type == bf16:
                vi.type.tensor_type.elem_type = FLOAT
                changed.append(vi.name)
    return sorted(set(changed))


def _infer_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor in every scope, from shape inference on a weightless copy."""
    skeleton = onnx.ModelProto()
    copy_fields(model, skeleton, skip="graph")
    copy_fields(model.graph, skeleton.graph, skip="initializer")
    # The main graph's weights are never copied, only their names, types and dims.
    for init in model.graph.initializer:
        stub = skeleton.graph.initializer.add()
        if init.data_type == FLOAT and _numel(init) > 16:
            stub.name, stub.data_type = init.name, FLOAT
            stub.dims.extend(init.dims)
        else:
            stub.CopyFrom(init)
    for scope in walk_graphs(skeleton.graph):
        for init in scope.graph.initializer:
            if init.data_type == FLOAT and _numel(init) > 16:
                # Types need only dims; large float data would only slow inference down.
                name, dims = init.name, list(init.dims)
                init.Clear()
                init.name, init.data_type = name, FLOAT
                init.dims.extend(dims)
    _declare_ml_outputs(skeleton)
    # An output onnx leaves untyped (GroupNormalization-21) would leave every node after it FP32.
    inferred = inferred_with_schema_types(skeleton, _shape_inferred)
    types: dict[str, int] = {}
    for scope in walk_graphs(inferred.graph):
        g = scope.graph
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                types[vi.name] = vi.type.tensor_type.elem_type
        for init in g.initializer:
            types[init.name] = init.data_type
        for node in g.node:
            if node.op_type == "Constant" and node.output:
                value = constant_node_value(node)
                if value is not None:
                    types[node.output[0]] = helper.np_dtype_to_tensor_dtype(value.dtype)
    return types


def _shape_inferred(skeleton: onnx.ModelProto) -> onnx.ModelProto:
    if skeleton.ByteSize() < PROTOBUF_LIMIT - 64 * 2**20:
        return onnx.shape_inference.infer_shapes(skeleton, strict_mode=False)
    with tempfile.TemporaryDirectory(prefix="npuprep-lower-") as tmp:
        src = os.path.join(tmp, "in.onnx")
        dst = os.path.join(tmp, "out.onnx")
        onnx.save_model(skeleton, src, save_as_external_data=True, location="in.data")
        onnx.shape_inference.infer_shapes_path(src, dst)
        return onnx.load(dst, load_external_data=False)


# ai.onnx.ml ops whose first output is tensor(float) whatever their input (the ONNX-ML
# operator specs); onnx's shape inference does not type them, which would leave every node
# after them typeless (kept FP32 as "type unknown").
_ML_FLOAT_OUTPUT = frozenset({"Scaler", "Normalizer", "LinearRegressor", "FeatureVectorizer",
                              "OneHotEncoder", "SVMRegressor", "TreeEnsembleRegressor"})


def _declare_ml_outputs(model: onnx.ModelProto) -> None:
    for scope in walk_graphs(model.graph):
        g = scope.graph
        declared = {vi.name for vi in (*g.input, *g.output, *g.value_info)}
        for node in g.node:
            if node.domain == "ai.onnx.ml" and node.op_type in _ML_FLOAT_OUTPUT and node.output \
                    and node.output[0] not in declared:
                g.value_info.append(helper.make_tensor_value_info(node.output[0], FLOAT, None))


def _numel(init: onnx.TensorProto) -> int:
    return int(np.prod(list(init.dims))) if init.dims else 1


_INTEGER_TYPES = frozenset({TensorProto.INT64, TensorProto.INT32, TensorProto.INT16, TensorProto.INT8,
                            TensorProto.UINT64, TensorProto.UINT32, TensorProto.UINT16, TensorProto.UINT8})


def _shape_computations(graph: onnx.GraphProto, types: dict[str, int],
                        weights: dict[str, _Weight]) -> set[int]:
    """Nodes with float outputs that compute shapes or FP32-only inputs (kept FP32)."""
    derived: set[str] = set()
    found: set[int] = set()
    # A shape is computed from Shape/Size and constants only: a node that also reads data
    # (a graph input, any activation, of whatever type) computes data, even where a
    # computed shape joins in (OneHot's depth, a Reshape of the input).
    constants = set(weights) | {i.name for i in graph.initializer} | {
        o for n in graph.node if n.op_type == "Constant" for o in n.output if o}
    # Floats computed from constants alone (a position grid's side, `1369 ** 0.5`) that a Cast
    # makes integers: a size or an index, which FP16 rounds (2049 -> 2048) and which
    # onnxruntime no longer folds in a default session once it is FP16 (vit_s_focus).
    folded: dict[str, onnx.NodeProto] = {}
    for node in topological_order(graph):
        ins = [i for i in node.input if i]
        if ins and node.op_type not in _CONTROL_FLOW and all(i in constants for i in ins):
            constants.update(o for o in node.output if o)
            folded.update((o, node) for o in node.output if o)
        if node.op_type in ("Shape", "Size"):
            derived.update(o for o in node.output if o)
            continue
        if node.op_type == "ConstantOfShape" or node.op_type in _CONTROL_FLOW:
            # Data of a computed shape; a body's values come from what it captures, whatever
            # decides which branch runs.
            continue
        if ins and any(i in derived for i in ins) and all(i in derived or i in constants for i in ins):
            derived.update(o for o in node.output if o)
            if any(types.get(t) == FLOAT for t in [*ins, *node.output]):
                found.add(id(node))
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for pos, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, pos))
    produced = {o: n for n in graph.node for o in n.output if o}
    graph_outputs = {o.name for o in graph.output}
    todo = [n for node in graph.node for pos, n in enumerate(node.input)
            if n and pos in FP32_ONLY_INPUTS.get(node.op_type, ()) and types.get(n) == FLOAT]
    casts = [n for n in graph.node if n.op_type == "Cast" and n.input and n.input[0] in folded
             and _attr_int(n, "to") in _INTEGER_TYPES and types.get(n.input[0]) == FLOAT]
    found.update(id(n) for n in casts)  # the Cast reads the FP32 value, not an FP16 copy
    sized = [n.input[0] for n in casts]
    while sized:
        node = folded.get(sized.pop())
        if node is not None and id(node) not in found:
            found.add(id(node))
            sized.extend(i for i in node.input if i in folded)
    while todo:
        name = todo.pop()
        node = produced.get(name)
        if node is None or id(node) in found:
            continue
        uses = [(r, pos) for out in node.output if out for r, pos in readers.get(out, [])]
        # A value the graph returns (or nothing reads) is data, whoever else reads it.
        returned = any(out in graph_outputs or not readers.get(out) for out in node.output if out)
        only_shape = not returned and all(
            pos in FP32_ONLY_INPUTS.get(r.op_type, ()) or id(r) in found for r, pos in uses)
        if only_shape:
            found.add(id(node))
            todo.extend(i for i in node.input if i and types.get(i) == FLOAT)
    return found


def _sort(graph: onnx.GraphProto) -> None:
    ordered = [_copy(n) for n in topological_order(graph)]
    del graph.node[:]
    graph.node.extend(ordered)


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    out = onnx.NodeProto()
    out.CopyFrom(node)
    return out


def _attr_tensor(node: onnx.NodeProto, name: str) -> np.ndarray | None:
    for attr in node.attribute:
        if attr.name == name and attr.type == onnx.AttributeProto.TENSOR:
            return to_array(attr.t)
    if node.op_type == "Constant" and name == "value":
        return constant_node_value(node)
    return None


def _fill_value(node: onnx.NodeProto) -> np.ndarray:
    """A ConstantOfShape's value; without the attribute the spec fills FP32 zeros, which
    must be lowered too or its readers (ScatterElements' data, Where) see mixed types."""
    value = _attr_tensor(node, "value")
    return np.zeros(1, np.float32) if value is None else value


def _set_attr_tensor(node: onnx.NodeProto, name: str, value: np.ndarray) -> None:
    for attr in node.attribute:
        if attr.name == name:
            attr.t.CopyFrom(numpy_helper.from_array(value, attr.t.name))
            return
    node.attribute.append(helper.make_attribute(name, numpy_helper.from_array(value)))


def _attr_bytes(node: onnx.NodeProto, name: str) -> bytes | None:
    return next((a.s for a in node.attribute if a.name == name), None)


def _attr_int(node: onnx.NodeProto, name: str) -> int | None:
    for attr in node.attribute:
        if attr.name == name:
            return attr.i
    return None


def _set_attr_int(node: onnx.NodeProto, name: str, value: int) -> None:
    for attr in node.attribute:
        if attr.name == name:
            attr.i = value


def _beyond(value: np.ndarray, limit: float) -> tuple[bool, bool, float]:
    """(any value beyond +-limit or NaN, all of those negative, largest magnitude) of a weight,
    in passes that allocate nothing where none is beyond (the common case)."""
    if value.size == 0:
        return False, True, 0.0
    top, bottom = float(value.max()), float(value.min())
    if top <= limit and -bottom <= limit:
        return False, True, max(top, -bottom)
    over = ~(np.abs(value) <= limit)
    return True, bool(np.all(value[over] < 0)), float(np.nanmax(np.abs(value), initial=0.0))
