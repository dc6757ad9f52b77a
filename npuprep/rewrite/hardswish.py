"""A written-out hard-swish is one op: `x * Clip(x + 3, 0, 6) / 6` -> `HardSwish(x)`.

Exporters (paddle2onnx, TF, torch before opset 14) write hard-swish as four nodes, each of
which stores its output: in FP16 that is three roundings more than the one op a compiler
runs (TensorRT and rknn-toolkit2 fuse the pattern), and `x * Clip(...)` reaches 6|x| before
the division brings it back. The pattern becomes `HardSwish(x)` from opset 14 on and
`x * HardSigmoid(x, alpha=1/6, beta=1/2)` before. Exact up to FP32 rounding; the last node's
name and output tensor are kept, so plans and statistics still find them.

Recognised: `Div(Mul(x, C), 6)`, `Mul(Mul(x, C), 1/6)`, `Mul(x, Div(C, 6))` and
`Mul(x, Mul(C, 1/6))` with `C = Clip(Add(x, 3), 0, 6)` (bounds as inputs or attributes).
"""

from __future__ import annotations

import math

import onnx
import onnx_graphsurgeon as gs

from npuprep.rewrite import graph_ops as go
from npuprep.rewrite.result import RewriteResult, sites_result

HARDSWISH_OPSET = 14
# The constants 3, 6 and 1/6 as stored in FP32 match to this relative tolerance.
CONSTANT_RTOL = 1e-6


def fuse_hardswish(model: onnx.ModelProto) -> RewriteResult:
    """Replace every main-graph written-out hard-swish whose inner tensors feed nothing else.

    details: "replaced" {last node: what}, "declined" {last node: why}.
    """
    if not any(n.op_type == "Clip" for n in model.graph.node):
        return RewriteResult(model, False, "no Clip", {"replaced": {}, "declined": {}})
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    graph = go.import_graph(model)
    replaced: dict[str, str] = {}
    declined: dict[str, str] = {}
    for clip in [n for n in graph.nodes if n.op == "Clip"]:
        found = _pattern(graph, clip)
        if found is None:
            continue
        x, inner, last = found
        label = go.node_label(last)
        why = _why_not(graph, inner, last)
        if why:
            declined[label] = why
            continue
        out = last.outputs[0]
        for node in (*inner, last):
            node.outputs.clear()
        if opset >= HARDSWISH_OPSET:
            graph.nodes.append(gs.Node("HardSwish", label, inputs=[x], outputs=[out]))
            how = "HardSwish"
        else:
            gate = gs.Variable(go.unique_name(graph, f"{out.name}.hardsigmoid"), dtype=out.dtype,
                               shape=out.shape)
            graph.nodes.append(gs.Node("HardSigmoid", go.unique_name(graph, f"{label}.hardsigmoid"),
                                       attrs={"alpha": 1.0 / 6.0, "beta": 0.5}, inputs=[x],
                                       outputs=[gate]))
            graph.nodes.append(gs.Node("Mul", label, inputs=[x, gate], outputs=[out]))
            how = "x * HardSigmoid(x)"
        replaced[label] = f"{len(inner) + 1} nodes computing hard-swish of {x.name}: {how}"
    form = "HardSwish" if opset >= HARDSWISH_OPSET else f"x * HardSigmoid(x) (opset {opset} has no HardSwish)"
    return sites_result(model, lambda: go.finish(graph, model), replaced, declined,
                        nothing="no written-out hard-swish",
                        done=f"{len(replaced)} written-out hard-swish(es) as {form}")


def _pattern(graph: gs.Graph, clip: gs.Node) -> tuple[gs.Tensor, tuple[gs.Node, ...], gs.Node] | None:
    """(x, inner nodes, last node) of the hard-swish around `clip`, or None when it is not one."""
    add = go.producer(clip.inputs[0])
    if add is None or add.op != "Add" or not _bounds_are(clip, 0.0, 6.0):
        return None
    three = [i for i, t in enumerate(add.inputs) if _is(t, 3.0)]
    if len(three) != 1:
        return None
    x = add.inputs[1 - three[0]]
    after = _only_reader(graph, clip.outputs[0])
    if after is None:
        return None
    if after.op == "Mul" and _other(after, clip.outputs[0]) is x:
        scale = _only_reader(graph, after.outputs[0])  # (x * C) / 6
        if scale is not None and _divides_by_six(scale, after.outputs[0]):
            return x, (add, clip, after), scale
        return None
    if _divides_by_six(after, clip.outputs[0]):
        mul = _only_reader(graph, after.outputs[0])  # x * (C / 6)
        if mul is not None and mul.op == "Mul" and _other(mul, after.outputs[0]) is x:
            return x, (add, clip, after), mul
    return None


def _why_not(graph: gs.Graph, inner: tuple[gs.Node, ...], last: gs.Node) -> str:
    for node in inner:
        out = node.outputs[0]
        if go.sole_reader(graph, out) is None:
            return f"{out.name} (of {go.node_label(node)}) is read elsewhere too"
    return ""


def _only_reader(graph: gs.Graph, tensor: gs.Tensor) -> gs.Node | None:
    readers, in_body = go.main_consumers(graph, tensor)
    return readers[0] if len(readers) == 1 and not in_body else None


def _other(node: gs.Node, tensor: gs.Tensor) -> gs.Tensor | None:
    if len(node.inputs) != 2:
        return None
    return node.inputs[1] if node.inputs[0] is tensor else node.inputs[0]


def _divides_by_six(node: gs.Node, tensor: gs.Tensor) -> bool:
    """`node` is `tensor / 6` or `tensor * (1/6)`."""
    if node.op == "Div":
        return len(node.inputs) == 2 and node.inputs[0] is tensor and _is(node.inputs[1], 6.0)
    return node.op == "Mul" and _is(_other(node, tensor), 1.0 / 6.0)


def _is(tensor: gs.Tensor | None, value: float) -> bool:
    """`tensor` is a constant scalar (any rank, one element) equal to `value`."""
    found = go.const_value(tensor) if tensor is not None else None
    if found is None or found.size != 1 or not go.is_float_array(found):
        return False
    return math.isclose(float(found.reshape(())), value, rel_tol=CONSTANT_RTOL)


def _bounds_are(clip: gs.Node, low: float, high: float) -> bool:
    """Clip's bounds, given as inputs (opset 11+) or attributes (before), are [low, high]."""
    lo, hi = go.scalar_operand(clip, 1, "min"), go.scalar_operand(clip, 2, "max")
    return lo is not None and hi is not None and math.isclose(lo, low) and math.isclose(hi, high)
