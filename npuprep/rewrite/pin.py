"""FP32 islands for pinning: `faulty node -> island {node, consumers...}` grown until every exit fits.

Pinning itself happens at lowering (pinned nodes stay FP32, Cast pairs at island borders);
these helpers only read the graph. The planner supplies `fits(tensor)` from the measured
statistics (max |x| within the target limit with headroom).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import onnx

from npuprep.errors import NpuprepError
from npuprep.graph import (
    GraphScope,
    consumers,
    node_label,
    producers,
    tensor_types,
    topological_order,
    walk_graphs,
)
from npuprep.numerics import FLOAT_ONNX_TYPES


@dataclass(frozen=True)
class Island:
    """Nodes kept FP32 together, and the float tensors crossing its border.

    `exit_tensors` are written inside and read outside (or are graph outputs);
    `entry_tensors` are read inside and written outside (graph inputs included, weights
    not). `unfit_exits` are exits that still do not fit (the island ran into a graph output
    or `max_nodes`). Each crossing costs one Cast at lowering.
    """

    nodes: tuple[str, ...]
    exit_tensors: tuple[str, ...]
    entry_tensors: tuple[str, ...] = ()
    unfit_exits: tuple[str, ...] = ()
    scope: str = "main"

    @property
    def cast_count(self) -> int:
        return len(self.exit_tensors) + len(self.entry_tensors)

    def __bool__(self) -> bool:
        """Truthy when every exit fits the target."""
        return not self.unfit_exits


class _View:
    """One graph's producers, consumers, order and float tensors (built once per call)."""

    def __init__(self, model: onnx.ModelProto, scope: GraphScope, types: dict[str, int]) -> None:
        self.scope = scope
        graph = scope.graph
        self.order = [node_label(n) for n in topological_order(graph)]
        self.rank = {label: i for i, label in enumerate(self.order)}
        self.nodes = {node_label(n): n for n in graph.node}
        self.consumers = {t: [node_label(n) for n in ns] for t, ns in consumers(graph).items()}
        self.producers = {t: node_label(n) for t, n in producers(graph).items()}
        self.outputs = {o.name for o in graph.output}
        self.weights = {i.name for i in graph.initializer}
        self.weights |= {n.output[0] for n in graph.node if n.op_type == "Constant"}
        self.types = types
        # Body outputs of an If in the main graph whose If output is a main graph output
        # read by no node: an island may close there when outputs stay FP32.
        self.fp32_outputs: set[str] = set()
        owner = scope.owner
        if owner is not None and owner.op_type == "If" and owner in model.graph.node:
            main_outputs = {o.name for o in model.graph.output}
            read = {i for n in model.graph.node for i in n.input}
            self.fp32_outputs = {vi.name for vi, out in zip(graph.output, owner.output, strict=False)
                                 if out in main_outputs and out not in read}

    def is_float(self, tensor: str) -> bool:
        return self.types.get(tensor, onnx.TensorProto.FLOAT) in FLOAT_ONNX_TYPES

    def borders(self, nodes: set[str]) -> tuple[list[str], list[str]]:
        exits: list[str] = []
        entries: list[str] = []
        for label in sorted(nodes, key=self.rank.__getitem__):
            node = self.nodes[label]
            for out in node.output:
                if not out or not self.is_float(out):
                    continue
                outside = [c for c in self.consumers.get(out, []) if c not in nodes]
                if outside or out in self.outputs:
                    exits.append(out)
            for inp in node.input:
                if not inp or inp in self.weights or not self.is_float(inp) or inp in entries:
                    continue
                if self.producers.get(inp) not in nodes:
                    entries.append(inp)
        return exits, entries


def _view_of(model: onnx.ModelProto, label: str, types: dict[str, int] | None) -> _View:
    types = types if types is not None else tensor_types(model)
    for scope in walk_graphs(model.graph):
        if any(node_label(n) == label for n in scope.graph.node):
            return _View(model, scope, types)
    raise NpuprepError(f"pin: node '{label}' not found in the model")


def grow_island(
    model: onnx.ModelProto,
    seed_node: str,
    fits: Callable[[str], bool],
    *,
    outputs_fp32: bool = True,
    max_nodes: int | None = None,
    types: dict[str, int] | None = None,
    joins: Callable[[str, str], bool] | None = None,
) -> Island:
    """Grow an FP32 island forward from `seed_node` until every tensor leaving it fits.

    An exit that does not fit pulls its consumers in, those for which `joins(consumer,
    tensor)` holds when it is given (the others read the exit as it is). A graph output read
    by nobody else needs no fit when outputs stay FP32 (`outputs_fp32`), nor does an If
    branch's output that is one. Growth also stops at `max_nodes`; what still does not fit
    is listed in `unfit_exits`. `types` (tensor -> ONNX type) may be passed to skip shape
    inference on repeated calls.
    """
    view = _view_of(model, seed_node, types)
    island = {seed_node}
    refused: set[str] = set()
    while True:
        exits, entries = view.borders(island)
        unfit = [t for t in exits
                 if t not in refused and not _exit_ok(view, t, island, fits, outputs_fp32)]
        if joins is not None:
            for t in unfit:
                if all(not joins(c, t) for c in view.consumers.get(t, []) if c not in island) \
                        and t not in view.outputs:
                    refused.add(t)
            unfit = [t for t in unfit if t not in refused]
        if not unfit or (max_nodes is not None and len(island) >= max_nodes):
            break
        grow = {c for t in unfit for c in view.consumers.get(t, [])
                if c not in island and (joins is None or joins(c, t))}
        if max_nodes is not None:
            grow = set(sorted(grow, key=view.rank.__getitem__)[: max_nodes - len(island)])
        if not grow:
            break
        island |= grow
    return _island(view, island, fits, outputs_fp32, accepted=refused)


def island_of(
    model: onnx.ModelProto,
    nodes: Iterable[str],
    fits: Callable[[str], bool] | None = None,
    *,
    outputs_fp32: bool = True,
    types: dict[str, int] | None = None,
) -> Island:
    """The Island made of `nodes` (all in one graph): its borders, and unfit exits if `fits`."""
    nodes = set(nodes)
    if not nodes:
        raise NpuprepError("pin: an island needs at least one node")
    view = _view_of(model, sorted(nodes)[0], types)
    missing = nodes - set(view.nodes)
    if missing:
        raise NpuprepError(f"pin: node '{sorted(missing)[0]}' is not in graph {view.scope.path}")
    return _island(view, nodes, fits, outputs_fp32)


def merge_islands(
    model: onnx.ModelProto,
    islands: Iterable[Island],
    fits: Callable[[str], bool] | None = None,
    *,
    max_gap: int = 4,
    outputs_fp32: bool = True,
    types: dict[str, int] | None = None,
) -> tuple[Island, ...]:
    """Merge overlapping or touching islands, and pull in gaps of up to `max_gap` outside
    nodes that read only from the islands and feed only them (pinning those removes Casts;
    `max_gap=0` turns that off).

    Returns one Island per connected group, per graph, in topological order.
    """
    types = types if types is not None else tensor_types(model)
    by_scope: dict[str, set[str]] = {}
    for isl in islands:
        by_scope.setdefault(isl.scope, set()).update(isl.nodes)
    result: list[Island] = []
    for scope_path in sorted(by_scope):
        nodes = by_scope[scope_path]
        view = _view_of(model, sorted(nodes)[0], types)
        if max_gap > 0:
            nodes = _bridge(view, nodes, max_gap)
        for group in _components(view, nodes):
            result.append(_island(view, group, fits, outputs_fp32))
    return tuple(result)


def cast_count(model: onnx.ModelProto, pinned_nodes: Iterable[str], *,
               types: dict[str, int] | None = None) -> int:
    """Casts that pinning `pinned_nodes` costs at the island borders (graph I/O excluded)."""
    pinned = set(pinned_nodes)
    types = types if types is not None else tensor_types(model)
    total = 0
    for scope in walk_graphs(model.graph):
        view = _View(model, scope, types)
        here = pinned & set(view.nodes)
        if not here:
            continue
        exits, entries = view.borders(here)
        graph_inputs = {i.name for i in scope.graph.input}
        total += sum(1 for t in exits if [c for c in view.consumers.get(t, []) if c not in here])
        total += sum(1 for t in entries if t not in graph_inputs or not scope.is_main)
    return total


def _exit_ok(view: _View, tensor: str, island: set[str], fits: Callable[[str], bool],
             outputs_fp32: bool) -> bool:
    if fits(tensor):
        return True
    outside = [c for c in view.consumers.get(tensor, []) if c not in island]
    closes = view.scope.is_main and tensor in view.outputs or tensor in view.fp32_outputs
    return outputs_fp32 and closes and not outside


def _island(view: _View, nodes: set[str], fits: Callable[[str], bool] | None,
            outputs_fp32: bool, accepted: set[str] | None = None) -> Island:
    """The Island of `nodes`; `accepted` exits count as fitting (their readers refused to
    join and take them as they are)."""
    exits, entries = view.borders(nodes)
    accepted = accepted or set()
    unfit = [] if fits is None else [t for t in exits if t not in accepted
                                     and not _exit_ok(view, t, nodes, fits, outputs_fp32)]
    ordered = tuple(sorted(nodes, key=view.rank.__getitem__))
    return Island(ordered, tuple(exits), tuple(entries), tuple(unfit), view.scope.path)


def _bridge(view: _View, nodes: set[str], max_gap: int) -> set[str]:
    """Add gaps of up to `max_gap` outside nodes fed only by the islands and feeding only them."""
    nodes = set(nodes)
    changed = True
    while changed:
        changed = False
        for label in view.order:
            if label in nodes:
                continue
            gap = _gap_from(view, nodes, label, max_gap)
            if gap:
                nodes |= gap
                changed = True
    return nodes


def _gap_from(view: _View, nodes: set[str], start: str, max_gap: int) -> set[str]:
    gap = {start}
    todo = [start]
    while todo:
        node = view.nodes[todo.pop()]
        outs = [o for o in node.output if o and view.is_float(o)]
        if not outs or any(o in view.outputs for o in outs):
            return set()
        for out in outs:
            for c in view.consumers.get(out, []):
                if c not in nodes and c not in gap:
                    gap.add(c)
                    todo.append(c)
                    if len(gap) > max_gap:
                        return set()
    inside = nodes | gap
    for label in gap:
        ins = [i for i in view.nodes[label].input
               if i and i not in view.weights and view.is_float(i)]
        if not ins or not all(view.producers.get(i) in inside for i in ins):
            return set()
    return gap


def _components(view: _View, nodes: set[str]) -> list[set[str]]:
    parent = {n: n for n in nodes}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for label in nodes:
        for out in view.nodes[label].output:
            for c in view.consumers.get(out, []):
                if c in nodes:
                    parent[find(c)] = find(label)
    groups: dict[str, set[str]] = {}
    for label in nodes:
        groups.setdefault(find(label), set()).add(label)
    return sorted(groups.values(), key=lambda g: min(view.rank[n] for n in g))
