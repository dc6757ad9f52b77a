"""One graph for a layer-by-layer compare: `ref + cand' (+ iso') -> per-tensor error scalars`.

The candidate's names get a prefix and both graphs share the inputs, so one onnxruntime
run computes both models; per compared tensor the graph reduces the error to a few
scalar outputs (sums of squares, extremes of the error and of the stored values). No
activation leaves the runtime.

With `isolate`, a third copy of the candidate reads the reference's tensors (scaled and
rounded the way the candidate stores them; values beyond the format's range exactly, so
an overflow is charged only to the node that produced it) wherever the candidate reads a
compared tensor, so each node's own error is measured apart from the error that reached it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.graph import _captured_names, copy_fields, is_anchored

CAND = "cand::"
ISO = "iso::"
ISO_IN = "iso_in::"
RED = "cmp::"

# Per compared tensor, in this order: d = cand/s - ref, c = cand as stored.
BASE_COLUMNS = ("d2", "r2", "c2", "d_max", "d_min", "c_max", "c_min")
ISO_COLUMNS = ("iso_d2", "iso_d_max", "iso_d_min")
DETAIL_COLUMNS = ("cand_inf", "cand_nan", "ref_nonfinite", "saturated", "r_max", "r_min")


@dataclass(frozen=True)
class Pair:
    """A tensor both models compute: candidate = scale * reference, and times
    `channel_scale` too where a rewrite rescaled it per channel on purpose (an array that
    broadcasts against the tensor: the equalisation's and the balancing's factors)."""

    name: str
    scale: float
    ref_type: int
    cand_type: int
    elements: int | None = None  # per sample, when both shapes are static
    channel_scale: np.ndarray | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Layout:
    """Output names of the merged graph: scalars per compared tensor, row-major."""

    stats: tuple[str, ...]  # len(pairs) x (BASE_COLUMNS [+ ISO_COLUMNS])
    sizes: dict[int, tuple[str, str, str]]  # row -> Size of ref, cand, diff (dynamic shapes only)
    detail: tuple[str, ...]  # detail rows x DETAIL_COLUMNS
    candidate_outputs: dict[str, str] = field(default_factory=dict)  # output -> merged name


def merged_graph(
    ref: onnx.ModelProto,
    cand: onnx.ModelProto,
    pairs: list[Pair],
    *,
    limit: float | None,
    isolate: bool,
    detail: Iterable[str] = (),
    base: bool = True,
    keep: Iterable[str] = (),
    keep_candidate: Iterable[str] = (),
) -> tuple[onnx.ModelProto, Layout]:
    """The reference, the prefixed candidate and the error reductions in one model.

    Outputs (see Layout): the error scalars of every pair when `base`; counts of
    Inf/NaN/saturated values and the reference's extremes for the tensors in `detail`;
    the reference's own outputs named in `keep`, after them; then the candidate's outputs
    named in `keep_candidate` under their merged names (Layout.candidate_outputs; one that
    is a shared input or weight is the reference's tensor, kept under its own name).
    """
    detail = set(detail)
    out = onnx.ModelProto()
    out.CopyFrom(ref)
    g = out.graph
    kept = [o for o in g.output if o.name in set(keep)]
    del g.output[:]
    ref_inputs = {vi.name: vi for vi in g.input}
    shared: set[str] = set()
    cast_nodes: list[onnx.NodeProto] = []
    cand_inits = {i.name for i in cand.graph.initializer}
    # Weights the candidate holds byte for byte as the reference does (an emulation that
    # rounds them in the graph) are read from the reference's copy: one set in memory.
    same = _same_initializers(ref.graph, cand.graph)
    for vi in cand.graph.input:
        if vi.name in cand_inits:
            continue
        ref_vi = ref_inputs[vi.name]
        want = vi.type.tensor_type.elem_type
        if want == ref_vi.type.tensor_type.elem_type:
            shared.add(vi.name)
        else:
            cast_nodes.append(helper.make_node("Cast", [vi.name], [CAND + vi.name], to=want,
                                               name=CAND + "input_cast_" + vi.name))

    def cand_name(n: str) -> str:
        return n if not n or n in shared or n in same else CAND + n

    body = onnx.GraphProto()
    copy_fields(cand.graph, body, skip="initializer")
    body.initializer.extend(i for i in cand.graph.initializer if i.name not in same)
    _rename(body, cand_name, cand_name, CAND)
    g.initializer.extend(body.initializer)
    g.sparse_initializer.extend(body.sparse_initializer)
    _merge_opsets(out, cand)

    ref_nodes = [_copy(n) for n in g.node]
    cand_nodes = cast_nodes + list(body.node)
    red = _Reductions(g, limit)
    iso_nodes: list[onnx.NodeProto] = []
    if isolate:
        red.sink = iso_nodes
        _add_isolated_copy(g, cand, pairs, shared, red)
    per_pair: dict[int, list[onnx.NodeProto]] = {}
    iso_reductions: list[onnx.NodeProto] = []
    for row, pair in enumerate(pairs):
        if base or pair.name in detail:
            per_pair[row] = []
            red.compare(row, pair, isolate=isolate, base=base, detail=pair.name in detail,
                        sink=per_pair[row], iso_sink=iso_reductions)
    layout = red.finish()
    g.output.extend(kept)
    wanted = set(keep_candidate)
    merged_names = {o.name: cand_name(o.name) for o in cand.graph.output if o.name in wanted}
    missing = set(merged_names.values()) - {o.name for o in g.output}
    g.output.extend(vi for vi in body.output if vi.name in missing)
    layout = replace(layout, candidate_outputs=merged_names)
    ordered = _interleave(ref_nodes, cand_nodes, pairs, per_pair) + iso_nodes + iso_reductions
    del g.node[:]
    g.node.extend(ordered)
    # Node outputs stay typed only through inference; stale value_info could contradict.
    del g.value_info[:]
    return out, layout


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    return copy


def _interleave(ref_nodes: list[onnx.NodeProto], cand_nodes: list[onnx.NodeProto],
                pairs: list[Pair], per_pair: dict[int, list[onnx.NodeProto]]) -> list[onnx.NodeProto]:
    """Both models' nodes in step, each tensor's reductions right after both sides wrote it.

    Reading an activation while it is still in cache, and releasing it early, is cheaper
    than keeping every activation of both models alive until reductions at the end.
    """
    ref_at = {o: i for i, n in enumerate(ref_nodes) for o in n.output if o}
    cand_at = {o: i for i, n in enumerate(cand_nodes) for o in n.output if o}
    after_ref: dict[int, list[int]] = {}
    for row in per_pair:
        after_ref.setdefault(ref_at.get(pairs[row].name, len(ref_nodes)), []).append(row)
    ordered: list[onnx.NodeProto] = []
    emitted = 0
    for i in [*range(len(ref_nodes)), len(ref_nodes)]:
        if i < len(ref_nodes):
            ordered.append(ref_nodes[i])
        for row in after_ref.get(i, []):
            need = cand_at.get(CAND + pairs[row].name, len(cand_nodes) - 1)
            ordered += cand_nodes[emitted:need + 1]
            emitted = max(emitted, need + 1)
            ordered += per_pair[row]
    return ordered + cand_nodes[emitted:]


def _rename(graph: onnx.GraphProto, read: Callable[[str], str], write: Callable[[str], str],
            prefix: str) -> None:
    """Rename every tensor and node of a graph and its subgraphs in place."""
    for vi in list(graph.input) + list(graph.value_info):
        vi.name = write(vi.name)
    for vi in graph.output:
        vi.name = read(vi.name)
    for init in graph.initializer:
        init.name = write(init.name)
    for sparse in graph.sparse_initializer:
        sparse.values.name = write(sparse.values.name)
    for node in graph.node:
        if node.name:
            node.name = prefix + node.name
        for i, n in enumerate(node.input):
            node.input[i] = read(n)
        for i, n in enumerate(node.output):
            node.output[i] = write(n)
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subs:
                _rename(sub, read, write, prefix)


def _merge_opsets(out: onnx.ModelProto, other: onnx.ModelProto) -> None:
    versions = {e.domain: e.version for e in out.opset_import}
    for e in other.opset_import:
        versions[e.domain] = max(versions.get(e.domain, 0), e.version)
    del out.opset_import[:]
    for domain, version in sorted(versions.items()):
        out.opset_import.append(helper.make_opsetid(domain, version))
    out.ir_version = max(out.ir_version, other.ir_version)
    known = {(f.domain, f.name) for f in out.functions}
    out.functions.extend(f for f in other.functions if (f.domain, f.name) not in known)


def _rounding_of(producer: dict[str, onnx.NodeProto], name: str) -> list[onnx.NodeProto]:
    """The candidate's rounding of `name`: [Clip?, Cast(low), Cast(float)] when it has one."""
    up = producer.get(name)
    if up is None or up.op_type != "Cast" or _to(up) != TensorProto.FLOAT:
        return []
    down = producer.get(up.input[0])
    if down is None or down.op_type != "Cast" or _to(down) == TensorProto.FLOAT:
        return []
    clip = producer.get(down.input[0])
    if clip is not None and clip.op_type == "Clip" and len(clip.input) == 3 \
            and all(producer.get(b) is not None and producer[b].op_type == "Constant"
                    for b in clip.input[1:]):
        return [clip, down, up]
    return [down, up]


def _to(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "to"), 0)


def _add_isolated_copy(g: onnx.GraphProto, cand: onnx.ModelProto, pairs: list[Pair],
                       shared: set[str], red: _Reductions) -> None:
    """A copy of the candidate whose reads of compared tensors come from the reference.

    Only the nodes needed to produce the compared tensors are copied. Their weights are
    copied too: onnxruntime pre-packs a MatMul's constant weights per node only when the
    initialiser is not shared, and sharing it cost 40% more time per sample than the
    memory of a second copy (measured on bench/bench_compare.py's encoder).
    """
    compared = {p.name: p for p in pairs}
    # Inputs the candidate reads in another dtype come through the Casts added for it.
    cast_inputs = {vi.name for vi in cand.graph.input} - shared

    def read(n: str) -> str:
        if not n or n in shared:
            return n
        if n in compared:
            return ISO_IN + n
        if n in cast_inputs:
            return CAND + n
        return ISO + n

    def write(n: str) -> str:
        return n if not n else ISO + n

    # Nodes needed, walking back from the compared tensors and stopping at them.
    producer = {o: n for n in cand.graph.node for o in n.output if o}
    needed: set[int] = set()
    stack = [producer[p.name] for p in pairs if p.name in producer]
    while stack:
        node = stack.pop()
        if id(node) in needed:
            continue
        needed.add(id(node))
        for n in list(node.input) + sorted(_captured_names(node)):
            if n in producer and n not in compared:
                stack.append(producer[n])
    for pair in pairs:
        src = exact = red.scaled(pair.name, pair)
        rounding = _rounding_of(producer, pair.name)
        for node in rounding:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = ISO_IN + node.name
            copy.input[0] = src
            if node.op_type == "Clip":
                copy.input[1], copy.input[2] = CAND + node.input[1], CAND + node.input[2]
            src = ISO_IN + node.output[0] + "__r"
            copy.output[0] = src
            red.sink.append(copy)
        if rounding and red.limit is not None:
            # Values beyond the format's range are read exactly: an overflow is charged to
            # the node that produced it, not again to each of its consumers.
            beyond = red._node("Greater", [red._node("Abs", [exact]), RED + "limit"])
            src = red._node("Where", [beyond, exact, src])
        if not rounding and pair.cand_type != TensorProto.FLOAT:
            cast = ISO_IN + pair.name + "__cast"
            red.sink.append(helper.make_node("Cast", [src], [cast], to=pair.cand_type,
                                             name=ISO_IN + "cast_" + pair.name))
            src = cast
        red.sink.append(helper.make_node("Identity", [src], [ISO_IN + pair.name],
                                         name=ISO_IN + "feed_" + pair.name))
    body = onnx.GraphProto()
    body.node.extend(n for n in cand.graph.node if id(n) in needed)
    used = {i for n in body.node for i in list(n.input) + sorted(_captured_names(n))}
    body.initializer.extend(i for i in cand.graph.initializer if i.name in used)
    _rename(body, read, write, ISO)
    red.sink.extend(body.node)
    g.initializer.extend(body.initializer)


class _Reductions:
    """Appends per-tensor error reductions to a graph; each result is one scalar output.

    Scalars are fetched as separate outputs rather than concatenated: a Concat needs a
    Reshape per input, and every node costs dispatch time on a model with many tensors.
    Max |x| is max(ReduceMax, -ReduceMin), which reads x twice but writes nothing.
    """

    def __init__(self, graph: onnx.GraphProto, limit: float | None) -> None:
        self.g = graph
        self.limit = limit
        self.stats: list[str] = []
        self.sizes: dict[int, tuple[str, str, str]] = {}
        self.detail: list[str] = []
        self.counter = 0
        self.sink: list[onnx.NodeProto] = []
        self._const("zero", np.array(0.0, np.float32))
        if limit is not None:
            self._const("limit", np.array(limit, np.float32))

    def _const(self, name: str, value: np.ndarray) -> str:
        self.g.initializer.append(numpy_helper.from_array(value, RED + name))
        return RED + name

    def _node(self, op: str, inputs: list[str], **attrs: object) -> str:
        self.counter += 1
        out = f"{RED}{op.lower()}{self.counter}"
        self.sink.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def as_float(self, name: str, elem_type: int) -> str:
        return name if elem_type == TensorProto.FLOAT else self._node("Cast", [name], to=TensorProto.FLOAT)

    def scaled(self, name: str, pair: Pair, *, inverse: bool = False) -> str:
        """x in the candidate's scale (`pair`'s scale times its channel scale), or with
        `inverse` a candidate's x in the reference's; exact for powers of two; `x` itself
        when there is nothing to scale."""
        if pair.channel_scale is None and pair.scale == 1.0:
            return name
        factor = np.float64(pair.scale) * (1.0 if pair.channel_scale is None
                                           else pair.channel_scale.astype(np.float64))
        if inverse:
            factor = 1.0 / factor
        self.counter += 1
        const = self._const(f"scale{self.counter}", np.asarray(factor, np.float32))
        return self._node("Mul", [name, const])

    def _reduce(self, op: str, x: str) -> str:
        return self._node(op, [x], keepdims=0)

    def _extremes(self, x: str) -> list[str]:
        return [self._reduce("ReduceMax", x), self._reduce("ReduceMin", x)]

    def compare(self, row: int, pair: Pair, *, isolate: bool, base: bool, detail: bool,
                sink: list[onnx.NodeProto], iso_sink: list[onnx.NodeProto]) -> None:
        """Reductions of one pair into `sink`; those reading the isolated copy into `iso_sink`."""
        self.sink = sink
        r = self.as_float(pair.name, pair.ref_type)
        c_stored = self.as_float(CAND + pair.name, pair.cand_type)
        c = self.scaled(c_stored, pair, inverse=True)
        if base:
            d = self._node("Sub", [c, r])
            self.stats += [self._reduce("ReduceSumSquare", d), self._reduce("ReduceSumSquare", r),
                           self._reduce("ReduceSumSquare", c), *self._extremes(d),
                           *self._extremes(c_stored)]
            if pair.elements is None:
                self.sizes[row] = (self._node("Size", [pair.name]), self._node("Size", [CAND + pair.name]),
                                   self._node("Size", [d]))
            if isolate:
                self.sink = iso_sink
                i = self.scaled(self.as_float(ISO + pair.name, pair.cand_type), pair,
                                inverse=True)
                di = self._node("Sub", [i, r])
                self.stats += [self._reduce("ReduceSumSquare", di), *self._extremes(di)]
                self.sink = sink
        if detail:
            self.detail += [
                self._count(self._node("IsInf", [c_stored])),
                self._count(self._node("IsNaN", [c_stored])),
                self._count(self._node("IsNaN", [self._node("Mul", [r, RED + "zero"])])),
            ]
            if self.limit is None:
                self.detail.append(self._node("Identity", [RED + "zero"]))
            else:
                at_max = self._node("Equal", [self._node("Abs", [c_stored]), RED + "limit"])
                ref_scaled = self.scaled(r, pair)
                # A reference -inf/inf is no value to saturate: lowering stores a mask's -inf as -max.
                beyond = self._node("And", [
                    self._node("Greater", [self._node("Abs", [ref_scaled]), RED + "limit"]),
                    self._node("Not", [self._node("IsInf", [ref_scaled])])])
                self.detail.append(self._count(self._node("And", [at_max, beyond])))
            self.detail += self._extremes(r)

    def _count(self, mask: str) -> str:
        return self._reduce("ReduceSum", self._node("Cast", [mask], to=TensorProto.FLOAT))

    def finish(self) -> Layout:
        for name in self.stats + self.detail:
            self.g.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, []))
        for names in self.sizes.values():
            for name in names:
                self.g.output.append(helper.make_tensor_value_info(name, TensorProto.INT64, []))
        return Layout(tuple(self.stats), dict(self.sizes), tuple(self.detail))


def _same_initializers(ref: onnx.GraphProto, cand: onnx.GraphProto) -> set[str]:
    """Names of the candidate's initialisers equal to the reference's of that name (type,
    shape and bytes, or the same range of the same file), compared one tensor at a time."""
    mine = {i.name: i for i in ref.initializer}
    same = set()
    for init in cand.initializer:
        other = mine.get(init.name)
        if (other is not None and other.data_type == init.data_type and other.dims == init.dims
                and (other.data_location == init.data_location == onnx.TensorProto.DEFAULT
                     or is_anchored(other) and is_anchored(init))
                and other.SerializeToString() == init.SerializeToString()):
            same.add(init.name)
    return same
