"""A trial model's switched layers with their weights as constants: one layer per If branch.

    W, W8 -> Where(on, dq(W8), W) -> round -> L(x, .)   becomes   If(on, L(x, c8), L(x, c))

In the trial model of the 8-bit search (npuprep.verify.qdq_trials) a layer's weight is chosen
by its switches: the FP32 weight or its dequantised 8-bit copy (a DequantizeLinear per run
for a model whose 8-bit weights stay in a scratch file), then rounded to the board's FP16 as
it enters the layer. Computed in every run, that choice cost a quarter of a ppocr_det trial
run (onnxruntime's Where with a scalar condition: 11 ms for one 384x384 weight; a MiniLM
MatMul behind a Where took 2.1 ms against 1.4 ms). Each choice is worked out here once, by
onnxruntime on the same nodes, and the layer moves into the branches of an If on its
switches, each branch reading its choice as a constant: a ppocr_det run 0.079 -> 0.055 CPU s.
The trial sessions do not prepack (it would be 1.1 ms): a prepacked MatMul sums in another
order (MiniLM's 128x384 by 384x1536: 5e-7 relative), and MiniLM's FP8 search, its outputs
sensitive to an FP16 step in its first layer, then chose another point. Without prepacking
the runs give the switched model's numbers bit for bit (tests/test_eight_bit_mixed.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.graph import name_maker, tensor_nbytes, walk_graphs
from npuprep.ops import QUANTISED_MAC_OPS

# Every choice of every switched weight is held in memory (an FP32 constant each): up to
# this many bytes of them (MiniLM: 87 MB, 3 choices),
# above it the weights stay where they are (a large model's scratch file) and are chosen
# in every run.
FOLD_MAX_BYTES = 512 * 2**20


def fold_weight_switches(model: onnx.ModelProto, switches: Iterable[str]) -> onnx.ModelProto:
    """`model` (a trial model, emulated) with each multiply-add whose weight (input 1) is
    computed from constants and `switches` alone moved into Ifs on those switches, one
    branch per switch on and one for all off, each reading its weight as a constant. A
    layer whose switches another layer's weight also reads stays as it is."""
    from npuprep.runtime.session import make_session, run

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    chooses = _Cones(g, set(switches))
    layers: list[tuple[onnx.NodeProto, list[str]]] = []
    owner: dict[str, int] = {}
    for node in g.node:
        if node.op_type not in QUANTISED_MAC_OPS or len(node.input) < 2:
            continue
        found = chooses.switches_of(node.input[1])
        if not found:
            continue
        if any(s in owner for s in found):
            owner.update(dict.fromkeys(found, -1))  # shared: neither layer is folded
            continue
        owner.update(dict.fromkeys(found, len(layers)))
        layers.append((node, sorted(found)))
    layers = [(node, on) for k, (node, on) in enumerate(layers) if all(owner[s] == k for s in on)]
    if not layers or chooses.held_bytes([n.input[1] for n, _ in layers],
                                        1 + max(len(on) for _, on in layers)) > FOLD_MAX_BYTES:
        return model
    # One model of every chosen weight, run once with every switch off and once per k with
    # each layer's k-th switch on: the values the trial model's own nodes give.
    weights = [node.input[1] for node, _ in layers]
    cone = chooses.model(weights, [s for _, on in layers for s in on], model)
    session = make_session(cone, prepack=False, threads=1)
    every = [s for _, on in layers for s in on]
    off = dict.fromkeys(every, np.array(False))
    values = [run(session, off, weights)]
    for k in range(max(len(on) for _, on in layers)):
        on_k = {on[k]: np.array(True) for _, on in layers if k < len(on)}
        values.append(run(session, {**off, **on_k}, weights))
    del session
    fresh = name_maker(g)
    for node, on in layers:
        w = node.input[1]
        names = []
        for k in range(len(on) + 1):
            names.append(fresh(f"{w}_const{k}"))
            g.initializer.append(numpy_helper.from_array(np.asarray(values[k][w]), names[-1]))
        _into_branches(g, node, on, names, fresh)
    _drop_dead(g, chooses.nodes)
    return out


class _Cones:
    """Which tensors of a graph are computed from constants and given switches alone, and
    the nodes that compute them."""

    def __init__(self, g: onnx.GraphProto, switches: set[str]) -> None:
        self.g, self.switches = g, switches
        self.constants = {i.name for i in g.initializer}
        self.producer = {o: n for n in g.node for o in n.output if o}
        self.memo: dict[str, frozenset[str] | None] = {}
        self.nodes: list[onnx.NodeProto] = []

    def switches_of(self, name: str) -> frozenset[str]:
        """The switches `name` is chosen by (empty: not chosen by switches alone)."""
        return self._walk(name) or frozenset()

    def _walk(self, name: str) -> frozenset[str] | None:
        if name in self.memo:
            return self.memo[name]
        found: frozenset[str] | None
        if name in self.switches:
            found = frozenset((name,))
        elif name in self.constants or not name:
            found = frozenset()
        else:
            node = self.producer.get(name)
            if node is None or any(a.type in (a.GRAPH, a.GRAPHS) for a in node.attribute):
                found = None
            else:
                parts = [self._walk(i) for i in node.input]
                found = None if any(p is None for p in parts) else frozenset().union(*parts)
                if found is not None and all(node is not n for n in self.nodes):
                    self.nodes.append(node)
        self.memo[name] = found
        return found

    def held_bytes(self, outputs: list[str], choices: int) -> int:
        """Bytes of `choices` FP32 copies of the largest FP32 constant behind each output."""
        sizes = {i.name: tensor_nbytes(i) for i in self.g.initializer
                 if i.data_type == TensorProto.FLOAT}
        total = 0
        for name in outputs:
            todo, seen, largest = [name], set(), 0
            while todo:
                t = todo.pop()
                if t in seen:
                    continue
                seen.add(t)
                largest = max(largest, sizes.get(t, 0))
                if t in self.producer:
                    todo += list(self.producer[t].input)
            total += largest * choices
        return total

    def model(self, outputs: list[str], inputs: list[str], source: onnx.ModelProto) -> onnx.ModelProto:
        """The nodes computing `outputs` from the constants and `inputs` (boolean switches)."""
        wanted: list[onnx.NodeProto] = []
        todo, seen = list(outputs), set()
        while todo:
            name = todo.pop()
            if name in seen or name not in self.producer:
                continue
            seen.add(name)
            node = self.producer[name]
            wanted.append(node)
            todo += list(node.input)
        order = {id(n): i for i, n in enumerate(self.g.node)}
        nodes = sorted({id(n): n for n in wanted}.values(), key=lambda n: order[id(n)])
        used = {i for n in nodes for i in n.input}
        graph = helper.make_graph(
            nodes, "weight_choices",
            [helper.make_tensor_value_info(s, TensorProto.BOOL, []) for s in inputs],
            [helper.make_tensor_value_info(w, TensorProto.FLOAT, None) for w in outputs],
            initializer=[i for i in self.g.initializer if i.name in used])
        made = helper.make_model(graph, opset_imports=source.opset_import,
                                 ir_version=source.ir_version)
        return made


def _into_branches(g: onnx.GraphProto, node: onnx.NodeProto, switches: list[str],
                   weights: list[str], fresh: Callable[[str], str]) -> None:
    """Replace `node` by Ifs on `switches`: with switch k on it reads `weights[k + 1]`, with
    every switch off `weights[0]`."""
    label = node.name or node.output[0]

    def layer(weight: str, outputs: list[str]) -> onnx.NodeProto:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.input[1] = weight
        del copy.output[:]
        copy.output.extend(outputs)
        return copy

    def branch(inner: onnx.NodeProto) -> onnx.GraphProto:
        return helper.make_graph([inner], fresh(f"{label}_branch"), [], [
            helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in inner.output])

    def choice(k: int, outputs: list[str]) -> onnx.NodeProto:
        if k == len(switches):
            return layer(weights[0], outputs)
        then = layer(weights[k + 1], [fresh(f"{o}_on{k}") for o in outputs])
        rest = choice(k + 1, [fresh(f"{o}_off{k}") for o in outputs])
        return helper.make_node("If", [switches[k]], outputs, name=fresh(f"{label}_WeightSel"),
                                then_branch=branch(then), else_branch=branch(rest))

    node.CopyFrom(choice(0, list(node.output)))


def _drop_dead(g: onnx.GraphProto, candidates: list[onnx.NodeProto]) -> None:
    """The nodes among `candidates` nothing reads any more, and then the initialisers no
    node reads, removed."""
    outputs = {o for n in candidates for o in n.output if o}
    read: dict[str, int] = {}
    for scope in walk_graphs(g):
        for n in scope.graph.node:
            for i in n.input:
                read[i] = read.get(i, 0) + 1
    for o in g.output:
        read[o.name] = read.get(o.name, 0) + 1
    producer = {o: n for n in candidates for o in n.output if o}
    dead: set[str] = set()
    todo = [o for o in outputs if not read.get(o)]
    while todo:
        name = todo.pop()
        node = producer[name]
        if any(read.get(o) for o in node.output if o) or node.output[0] in dead:
            continue
        dead.update(o for o in node.output if o)
        for i in node.input:
            read[i] -= 1
            if not read[i] and i in producer:
                todo.append(i)
    kept = [n for n in g.node if not (n.output and n.output[0] in dead)]
    del g.node[:]
    g.node.extend(kept)
    kept_inits = [i for i in g.initializer if read.get(i.name)]
    del g.initializer[:]
    g.initializer.extend(kept_inits)
