"""What every static rule reads: scopes, producers, constants and inferred shapes, built once."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx

from npuprep.graph import (
    GraphScope,
    constant_value,
    consumers,
    infer_tensors,
    producers,
    to_array,
    walk_graphs,
)
from npuprep.model_io import Model
from npuprep.numerics import FLOAT_ONNX_TYPES, NumberFormat
from npuprep.ops import PASSTHROUGH_OPS
from npuprep.profiles import ResolvedTarget, TargetProfile

# Constants with more elements than this are weights, not eps / exponents / guidance weights.
_SCALAR_MAX_ELEMENTS = 4096



@dataclass
class ScopeView:
    """One graph of the model with its lookup tables."""

    scope: GraphScope
    producer: dict[str, onnx.NodeProto]
    consumer: dict[str, list[onnx.NodeProto]]
    parent: ScopeView | None = None  # the graph whose names a subgraph body may read
    _constants: dict[str, np.ndarray | None] = field(default_factory=dict)
    _sources: dict[str, onnx.TensorProto | onnx.NodeProto] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for node in self.graph.node:
            if node.op_type == "Constant" and node.output:
                self._sources[node.output[0]] = node
        for init in self.graph.initializer:
            self._sources[init.name] = init

    def _owner(self, name: str) -> ScopeView | None:
        """The view whose constant `name` is: this graph, or an enclosing one a body reads from."""
        view: ScopeView | None = self
        while view is not None:
            if name in view._sources:
                return view
            if name in view.producer or any(i.name == name for i in view.graph.input):
                return None  # a computed tensor of this graph shadows outer names
            view = view.parent
        return None

    def is_constant(self, name: str) -> bool:
        """Whether `name` is an initialiser or Constant output visible here (no data read)."""
        return self._owner(name) is not None

    @property
    def path(self) -> str:
        return self.scope.path

    @property
    def graph(self) -> onnx.GraphProto:
        return self.scope.graph

    def constant(self, name: str) -> np.ndarray | None:
        """Value of an initialiser or Constant output of this graph (cached), else None."""
        owner = self._owner(name)
        if owner is None:
            return None
        if owner is not self:
            return owner.constant(name)
        if name not in self._constants:
            source = self._sources[name]
            if isinstance(source, onnx.TensorProto):
                self._constants[name] = to_array(source)
            else:
                # constant_value reads every Constant form (value, value_float, ...) from a graph.
                self._constants[name] = constant_value(
                    onnx.helper.make_graph([source], "constant", [], []), name)
        return self._constants[name]

    def scalar(self, name: str) -> float | None:
        """The single value of a small constant (see `scalar`); large weights are never read."""
        owner = self._owner(name)
        source = owner._sources.get(name) if owner is not None else None
        if isinstance(source, onnx.TensorProto) and np.prod(source.dims) > _SCALAR_MAX_ELEMENTS:
            return None
        return scalar(self.constant(name))

    def source(self, name: str) -> onnx.NodeProto | None:
        """The producer of `name`, looking through pass-through ops (Cast, Reshape, ...)."""
        node = self.producer.get(name)
        while node is not None and node.op_type in PASSTHROUGH_OPS and node.input:
            upstream = self.producer.get(node.input[0])
            if upstream is None:
                return node
            node = upstream
        return node


@dataclass
class Context:
    """The model, the target and the lookups the rules share."""

    model: Model
    target: ResolvedTarget
    scopes: list[ScopeView]
    shapes: dict[str, tuple[int | None, ...]]
    types: dict[str, int]

    @property
    def profile(self) -> TargetProfile:
        return self.target.profile

    @property
    def fmt(self) -> NumberFormat:
        """The format the run computes in, as resolved (`--precision`), never the default."""
        return self.target.fmt

    def is_float(self, name: str) -> bool:
        """Whether a tensor holds floats (or its type is unknown): integer shape math is no hazard."""
        elem = self.types.get(name)
        return elem is None or elem in FLOAT_ONNX_TYPES

    def float_nodes(self) -> Iterator[tuple[ScopeView, onnx.NodeProto]]:
        """Nodes whose first output is a float tensor (or of unknown type)."""
        for view, node in self.nodes():
            if node.output and self.is_float(node.output[0]):
                yield view, node

    def views(self) -> Iterator[ScopeView]:
        return iter(self.scopes)

    def nodes(self) -> Iterator[tuple[ScopeView, onnx.NodeProto]]:
        for view in self.scopes:
            for node in view.graph.node:
                yield view, node


def build_context(model: Model, target: ResolvedTarget) -> Context:
    scopes: list[ScopeView] = []
    by_path: dict[str, ScopeView] = {}
    for s in walk_graphs(model.graph):
        # A body's path extends its enclosing graph's path ("main/If_3.then_branch"); node names
        # may hold slashes themselves, so take the longest enclosing path, not the last segment.
        enclosing = [p for p in by_path if s.path.startswith(p + "/")]
        parent = by_path[max(enclosing, key=len)] if enclosing else None
        view = ScopeView(s, producers(s.graph), consumers(s.graph), parent)
        by_path[s.path] = view
        scopes.append(view)
    info = infer_tensors(model.proto)
    return Context(model, target, scopes, info.dims, info.types)


def scalar(value: np.ndarray | None) -> float | None:
    """The single value of a constant (size 1, or every entry equal), else None."""
    if value is None or value.size == 0:
        return None
    try:
        flat = np.asarray(value, dtype=np.float64).ravel()
    except (TypeError, ValueError):
        return None
    if np.all(flat == flat[0]):
        return float(flat[0])
    return None
