"""Subtract the row max before a written-out softmax's Exp: `Exp(x)/ReduceSum(Exp(x))` -> the same of `x - max(x)`.

    x -> Exp -> e -> ReduceSum(axes, keepdims=1) -> s ; Div(e, s) -> p
    x -> ReduceMax(axes) -> m ; Sub(x, m) -> Exp -> e__shifted -> ReduceSum -> s__shifted ; Div -> p

Exact in real arithmetic (the factor exp(-max) cancels in the Div), and every Exp input
is <= 0, so no Exp can overflow in any format. The Exp and ReduceSum outputs are renamed
(their values change); the Div's output, what the model uses, keeps its name.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npuprep.graph import node_label
from npuprep.model_io import model_opset
from npuprep.rewrite.result import RewriteResult


def softmax_head(model: onnx.ModelProto, exp_node: str) -> tuple[str, str] | str:
    """(ReduceSum label, Div label) when `exp_node` heads a written-out softmax; else why not.

    Reads only: the planner asks it before choosing this rewrite over a clamp.
    """
    graph = model.graph
    exp = next((n for n in graph.node if node_label(n) == exp_node), None)
    if exp is None or exp.op_type != "Exp":
        return f"'{exp_node}' is no Exp node of the main graph"
    e = exp.output[0]
    readers = [n for n in graph.node if e in n.input]
    sums = [n for n in readers if n.op_type == "ReduceSum" and n.input[0] == e]
    divs = [n for n in readers if n.op_type == "Div" and n.input[0] == e]
    if len(sums) != 1 or len(divs) != 1 or len(readers) != 2:
        return f"'{e}' is not read by exactly one ReduceSum and one Div (a written-out softmax)"
    total, div = sums[0], divs[0]
    keep = next((a.i for a in total.attribute if a.name == "keepdims"), 1)
    if div.input[1] != total.output[0] or keep != 1:
        return f"'{node_label(div)}' does not divide by the ReduceSum's keepdims result"
    if _axes(graph, total) is None:
        return f"the axes of '{node_label(total)}' are not a constant initialiser"
    if any(total.output[0] in n.input for n in graph.node if n is not div) or \
            total.output[0] in {o.name for o in graph.output} or e in {o.name for o in graph.output}:
        return f"the sum '{total.output[0]}' or '{e}' is used beyond the softmax"
    return node_label(total), node_label(div)


def shift_softmax(model: onnx.ModelProto, exp_node: str) -> RewriteResult:
    """Insert ReduceMax + Sub before `exp_node` (see the module docstring)."""
    found = softmax_head(model, exp_node)
    if isinstance(found, str):
        return RewriteResult(model, False, found)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    labels = {node_label(n): n for n in g.node}
    exp, total = labels[exp_node], labels[found[0]]
    div = labels[found[1]]
    x, e, s = exp.input[0], exp.output[0], total.output[0]
    m, shifted = f"{x}__rowmax", f"{x}__shifted"
    axes = _axes(g, total) or []
    if model_opset(model) >= 18 and axes:
        axes_name = f"{exp_node}__shift_axes"
        g.initializer.append(numpy_helper.from_array(np.asarray(axes, np.int64), axes_name))
        reduce_max = helper.make_node("ReduceMax", [x, axes_name], [m], keepdims=1,
                                      name=f"{exp_node}__rowmax")
    elif axes:
        reduce_max = helper.make_node("ReduceMax", [x], [m], axes=axes, keepdims=1,
                                      name=f"{exp_node}__rowmax")
    else:
        reduce_max = helper.make_node("ReduceMax", [x], [m], keepdims=1, name=f"{exp_node}__rowmax")
    sub = helper.make_node("Sub", [x, m], [shifted], name=f"{exp_node}__shift")
    exp.input[0] = shifted
    exp.output[0] = f"{e}__shifted"
    total.input[0] = exp.output[0]
    total.output[0] = f"{s}__shifted"
    div.input[0], div.input[1] = exp.output[0], total.output[0]
    index = list(g.node).index(exp)
    g.node.insert(index, sub)
    g.node.insert(index, reduce_max)
    kept = [vi for vi in g.value_info if vi.name not in (e, s)]
    del g.value_info[:]
    g.value_info.extend(kept)
    return RewriteResult(out, True, f"'{exp_node}' reads '{x}' minus its max over the softmax "
                         "axes: every Exp input is <= 0", {"exp": exp_node})


def _axes(graph: onnx.GraphProto, total: onnx.NodeProto) -> list[int] | None:
    """The ReduceSum's axes ([] for all), or None when they are not a constant initialiser."""
    if len(total.input) > 1 and total.input[1]:
        init = next((i for i in graph.initializer if i.name == total.input[1]), None)
        return None if init is None else [int(a) for a in numpy_helper.to_array(init).ravel()]
    return [int(a) for a in next((a.ints for a in total.attribute if a.name == "axes"), [])]
