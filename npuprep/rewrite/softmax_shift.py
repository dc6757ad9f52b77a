"""Shift a written-out softmax: `Exp(x) / ReduceSum(Exp(x))` becomes `Exp(x - ReduceMax(x)) / ReduceSum(...)`.

exp(x - m) / sum(exp(x - m)) = exp(x) / sum(exp(x)) for any m, so subtracting the row
maximum is exact, and Exp's output then lies in (0, 1]: it no longer overflows. The
pattern must be closed: the Exp output is read only by the ReduceSum and as the Div's
numerator, and the sum only as its denominator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from npuprep.graph import attribute, constant_value, consumers, node_label, producers
from npuprep.rewrite import graph_ops as go
from npuprep.rewrite.result import RewriteResult


@dataclass(frozen=True)
class WrittenSoftmax:
    """The nodes of `Exp(x) / ReduceSum(Exp(x))` and its tensors. Truthy when found."""

    exp: str
    reduce: str = ""
    div: str = ""
    x: str = ""
    tensors: tuple[str, ...] = ()
    axes: tuple[int, ...] | None = None
    reason: str = ""

    def __bool__(self) -> bool:
        return not self.reason


def find_written_softmax(model: onnx.ModelProto, exp_node: str) -> WrittenSoftmax:
    """The written-out softmax around main-graph Exp `exp_node`, or why there is none."""
    graph = model.graph
    exp = next((n for n in graph.node if node_label(n) == exp_node), None)
    if exp is None or exp.op_type != "Exp":
        return WrittenSoftmax(exp_node, reason=f"{exp_node} is not an Exp of the main graph")
    readers = consumers(graph)
    made_by = producers(graph)
    outputs = {o.name for o in graph.output}
    e = exp.output[0]
    users = readers.get(e, [])
    sums = [n for n in users if n.op_type == "ReduceSum" and n.input[0] == e]
    divs = [n for n in users if n.op_type == "Div" and n.input[0] == e]
    if e in outputs or len(users) != 2 or len(sums) != 1 or len(divs) != 1:
        return WrittenSoftmax(exp_node, reason=(f"the output of {exp_node} is not read only by "
                                                "one ReduceSum and as one Div's numerator"))
    red, div = sums[0], divs[0]
    s = red.output[0]
    if div.input[1] != s or s in outputs or len(readers.get(s, [])) != 1:
        return WrittenSoftmax(exp_node, reason=(f"the sum {s} of {exp_node} is not only the "
                                                f"denominator of {node_label(div)}"))
    axes: tuple[int, ...] | None
    if len(red.input) > 1 and red.input[1]:
        value = constant_value(graph, red.input[1])
        if value is None:
            return WrittenSoftmax(exp_node, reason=f"{node_label(red)} has non-constant axes")
        axes = tuple(int(a) for a in np.asarray(value).reshape(-1))
    else:
        attr = attribute(red, "axes", None)
        axes = tuple(int(a) for a in attr) if attr is not None else None
    if not axes and attribute(red, "noop_with_empty_axes", 0):
        return WrittenSoftmax(exp_node, reason=f"{node_label(red)} reduces nothing")
    x = exp.input[0]
    before = made_by.get(x)
    if before is not None and before.op_type == "Sub":
        shift = made_by.get(before.input[1])
        if shift is not None and shift.op_type == "ReduceMax" and shift.input[0] == before.input[0]:
            return WrittenSoftmax(exp_node, reason=f"the input of {exp_node} is already shifted")
    return WrittenSoftmax(exp_node, node_label(red), node_label(div), x,
                          (e, s, div.output[0]), axes)


def apply_softmax_shift(model: onnx.ModelProto, exp_node: str) -> RewriteResult:
    """Subtract ReduceMax(x) from the input of the written-out softmax at `exp_node`.

    The Exp output and the sum now hold other values: they are renamed (`<name>__shifted`)
    so no comparison by name mistakes them for the reference's. details: "nodes" (the
    inserted ReduceMax and Sub), "renamed" {old: new}.
    """
    found = find_written_softmax(model, exp_node)
    if not found:
        return RewriteResult(model, False, found.reason, {"exp": exp_node})
    graph = go.import_graph(model)
    exp = go.require_node(graph, exp_node, "shift")
    x = exp.inputs[0]
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    m = gs.Variable(go.unique_name(graph, f"{x.name}__max"), dtype=x.dtype)
    shifted = gs.Variable(go.unique_name(graph, f"{x.name}__shifted"), dtype=x.dtype)
    inputs: list[gs.Tensor] = [x]
    attrs: dict[str, object] = {"keepdims": 1}
    if found.axes is not None and opset >= 18:
        inputs.append(gs.Constant(go.unique_name(graph, f"{x.name}__max_axes"),
                                  np.asarray(found.axes, np.int64)))
    elif found.axes is not None:
        attrs["axes"] = list(found.axes)
    name = go.unique_name(graph, f"softmax_shift_{exp_node}")
    graph.nodes.append(gs.Node("ReduceMax", f"{name}_max", attrs, inputs, [m]))
    graph.nodes.append(gs.Node("Sub", name, inputs=[x, m], outputs=[shifted]))
    go.replace_input(exp, 0, shifted)
    renamed: dict[str, str] = {}
    red = go.require_node(graph, found.reduce, "shift")
    for tensor in (exp.outputs[0], red.outputs[0]):
        new = go.unique_name(graph, f"{tensor.name}__shifted")
        renamed[tensor.name] = new
        tensor.name = new
    out = go.finish(graph, model)
    return RewriteResult(out, True, (
        f"{exp_node} reads {x.name} - ReduceMax({x.name}); {found.div} is unchanged, exactly"),
        {"exp": exp_node, "nodes": [f"{name}_max", name], "renamed": renamed})
