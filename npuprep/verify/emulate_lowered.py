"""Emulate an already-lowered model: `FP16 graph -> FP32 graph + Cast pairs where it stored FP16`.

A lowered (or naively converted) FP16 model run on onnxruntime's CPU provider is computed
partly in FP32 and hides overflow. Widening it to FP32 and rounding every tensor the model
declares in the low format reproduces what a target that honours those types computes.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.graph import node_label, tensor_nbytes, tensor_types, to_array, walk_graphs
from npuprep.numerics import NumberFormat
from npuprep.ops import GATHER_OPS, LAYOUT_OPS
from npuprep.verify.emulate import Emulation, emulate

# Low-format initialisers of at least this size are widened by a Cast node rather than a wide copy.
_CAST_IN_GRAPH_BYTES = 1 << 16


def emulate_lowered(model: onnx.ModelProto, fmt: NumberFormat, *, saturate: bool) -> Emulation:
    """Emulate a model whose tensors are typed in `fmt` (e.g. FP16) with explicit rounding.

    Nodes whose outputs the model keeps in FP32 are treated as pinned; every tensor it
    types in `fmt` is rounded (and overflows per `saturate`) after its producer.
    """
    types = tensor_types(model)
    low = fmt.onnx_type
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    high_nodes: set[str] = set()
    widened: list[onnx.NodeProto] = []
    widened_after: dict[str, list[onnx.NodeProto]] = {}  # reader label -> Casts of its outputs
    io_names = {vi.name for vi in list(model.graph.input) + list(model.graph.output)}
    lookups = _lookup_readers(wide.graph, types, low)
    for scope in walk_graphs(wide.graph):
        g = scope.graph
        for init in g.initializer:
            if init.data_type != low:
                continue
            big = scope.is_main and tensor_nbytes(init) >= _CAST_IN_GRAPH_BYTES and init.name not in io_names
            if big and init.name in lookups:
                # Read only by ops that move values (an embedding Gather): they read the
                # stored table and their outputs are widened, so a lookup widens its rows,
                # not the whole table on every run.
                for reader in lookups[init.name]:
                    for pos, out in enumerate(reader.output):
                        reader.output[pos] = f"{out}__stored"
                        widened_after.setdefault(node_label(reader), []).append(helper.make_node(
                            "Cast", [f"{out}__stored"], [out], to=TensorProto.FLOAT, name=f"widen_{out}"))
                continue
            if big:
                # Large weights stay stored in the low format and are widened by a Cast at
                # run time: no FP32 copy of them is ever made.
                stored = init.name + "__stored"
                widened.append(helper.make_node("Cast", [stored], [init.name], to=TensorProto.FLOAT,
                                                name=f"widen_{init.name}"))
                init.name = stored
            else:
                init.CopyFrom(numpy_helper.from_array(
                    to_array(init).astype("float32"), init.name))
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            tt = vi.type.tensor_type
            if tt.elem_type == low:
                tt.elem_type = TensorProto.FLOAT
        for node in g.node:
            outs = [o for o in node.output if o]
            if outs and all(types.get(o) != low for o in outs):
                high_nodes.add(node_label(node))
            for attr in node.attribute:
                if node.op_type == "Cast" and attr.name == "to" and attr.i == low:
                    attr.i = TensorProto.FLOAT
                if node.op_type in ("Constant", "ConstantOfShape") and attr.name == "value" \
                        and attr.t.data_type == low:
                    attr.t.CopyFrom(numpy_helper.from_array(
                        numpy_helper.to_array(attr.t).astype("float32"), attr.t.name))
    # Each Cast right before its first reader: a session running nodes in this order holds
    # one widened weight at a time.
    first_reader = {c.output[0]: 0 for c in widened}  # read only in a body: first of all
    for index, node in reversed(list(enumerate(wide.graph.node))):
        for name in node.input:
            if name in first_reader:
                first_reader[name] = index
    # (reversed: the lowest index a name is read at is the one that stays)
    nodes = list(wide.graph.node)
    for cast in sorted(widened, key=lambda c: -first_reader[c.output[0]]):
        nodes.insert(first_reader[cast.output[0]], cast)
    ordered = [m for n in nodes for m in (n, *widened_after.get(node_label(n), ()))]
    del wide.graph.node[:]
    wide.graph.node.extend(ordered)
    casts = {n.name for n in widened} | {c.name for cs in widened_after.values() for c in cs}
    # Weights rounded in the graph: a kept-FP32 table or weight is never copied to be rounded.
    return emulate(wide, fmt, saturate=saturate, pinned_nodes=high_nodes | casts,
                   weights_in_graph=True)


# Ops whose first input is the only float one and whose outputs are values of it.
_LOOKUP_OPS = GATHER_OPS | LAYOUT_OPS | {"Slice"}


def _lookup_readers(graph: onnx.GraphProto, types: dict[str, int],
                    low: int) -> dict[str, list[onnx.NodeProto]]:
    """Main-graph initialisers stored in `low` whose every reader is a _LOOKUP_OPS node
    reading it as its first input only (and no body reads it), with those readers."""
    from npuprep.graph import _captured_names

    inits = {i.name for i in graph.initializer if i.data_type == low}
    readers: dict[str, list[onnx.NodeProto]] = {}
    barred: set[str] = set()
    for node in graph.node:
        barred |= _captured_names(node) & inits
        for pos, name in enumerate(node.input):
            if name not in inits:
                continue
            if pos != 0 or node.op_type not in _LOOKUP_OPS or \
                    not all(types.get(o) == low for o in node.output if o):
                barred.add(name)
            else:
                readers.setdefault(name, []).append(node)
    return {name: nodes for name, nodes in readers.items() if name not in barred}
