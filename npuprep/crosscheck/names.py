"""NodeIndex: ties the names a compiler prints (node, tensor, range) to ONNX node labels."""

from __future__ import annotations

from npuprep.graph import node_label, tensor_types, topological_order, walk_graphs
from npuprep.model_io import Model
from npuprep.numerics import FLOAT_ONNX_TYPES
from npuprep.ops import NON_COMPUTE_OPS


class NodeIndex:
    """Lookup tables over a model's nodes: labels, producers, topological positions."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.op_types: dict[str, str] = {}
        self.producer: dict[str, str] = {}
        self.outputs: dict[str, tuple[str, ...]] = {}
        for scope in walk_graphs(model.graph):
            for node in scope.graph.node:
                label = node_label(node)
                self.op_types.setdefault(label, node.op_type)
                self.outputs.setdefault(label, tuple(o for o in node.output if o))
                for out in node.output:
                    if out:
                        self.producer.setdefault(out, label)
        self._main = topological_order(model.graph)
        self._nodes = {node_label(n): n for n in self._main}
        self.order: list[str] = [node_label(n) for n in self._main]
        self.position = {label: i for i, label in enumerate(self.order)}
        self.graph_inputs = {i.name for i in model.graph.input}
        self.initializers = {i.name for i in model.graph.initializer}

    def node(self, label: str):
        """The main-graph NodeProto labelled `label`, or None."""
        return self._nodes.get(label)

    def resolve(self, name: str) -> str | None:
        """The node label a printed node name stands for, or None."""
        if name in self.op_types:
            return name
        # TensorRT and npuprep both call an unnamed node `node_of_<first output>`.
        if name.startswith("node_of_") and name[len("node_of_"):] in self.producer:
            return self.producer[name[len("node_of_"):]]
        return None

    def expand_range(self, first: str, last: str, exclude: set[str]) -> tuple[str, ...]:
        """Nodes from `first` to `last` in topological order, without those in `exclude`.

        A fused region (TensorRT `{ForeignNode[first...last]}`) names only its ends; nodes
        between them that another layer claims explicitly belong to that layer instead.
        """
        a, b = self.position.get(first), self.position.get(last)
        if a is None or b is None:
            return ()
        a, b = min(a, b), max(a, b)
        return tuple(
            label for label in self.order[a:b + 1]
            if label not in exclude and self.op_types[label] != "Constant"
        )

    def compute_nodes(self) -> list[str]:
        """Main-graph nodes a compiler must place: float results, not foldable to constants."""
        types = tensor_types(self.model.proto)
        constant: set[str] = set(self.initializers)
        result: list[str] = []
        for node in self._main:
            inputs = [i for i in node.input if i]
            if node.op_type == "Constant" or (inputs and all(i in constant for i in inputs)):
                constant.update(o for o in node.output if o)
                continue
            if node.op_type in NON_COMPUTE_OPS:
                continue
            if any(types.get(o) in FLOAT_ONNX_TYPES for o in node.output if o):
                result.append(node_label(node))
        return result
