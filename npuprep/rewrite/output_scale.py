"""Leave a graph output scaled for the host: `y = Mul(y', 2^k)` at the output -> `y = y'` (host x 2^k).

The compensating Mul a rescale puts at a graph output is removed; the tensor it read takes
the output's name. The model's output is then 2^-k times the reference, and the factor the
host multiplies by is returned in details["host_scales"].
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from npuprep.graph import node_label, to_array
from npuprep.rewrite.result import RewriteResult


def leave_output_scaled(model: onnx.ModelProto, output: str) -> RewriteResult:
    """Remove the Mul by a constant power of two that produces graph output `output`."""
    graph = model.graph
    if output not in {o.name for o in graph.output}:
        return RewriteResult(model, False, f"'{output}' is not a graph output")
    producer = next((n for n in graph.node if output in n.output), None)
    if producer is None or producer.op_type != "Mul":
        return RewriteResult(model, False, f"output '{output}' is not made by a Mul "
                             "(no rescale compensation to move to the host)")
    factor, data = _constant_factor(graph, producer)
    if factor is None or data is None:
        return RewriteResult(model, False, f"'{node_label(producer)}' does not multiply by a "
                             "constant scalar power of two")
    readers = [n for n in graph.node if data in n.input and n is not producer]
    if readers or data in {i.name for i in graph.input}:
        return RewriteResult(model, False, f"'{data}' is also read elsewhere; removing "
                             f"'{node_label(producer)}' would change it")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    index = list(graph.node).index(producer)
    del g.node[index]
    for node in g.node:
        for i, name in enumerate(node.output):
            if name == data:
                node.output[i] = output
    kept = [vi for vi in g.value_info if vi.name != data]
    del g.value_info[:]
    g.value_info.extend(kept)
    e = round(math.log2(factor))
    by, times = (f"1/{factor:g}", f"{factor:g}") if e >= 0 else (f"2^{-e}", f"2^{e}")
    return RewriteResult(out, True, f"'{output}' leaves the device scaled by {by}; "
                         f"the host multiplies it by {times}",
                         {"host_scales": {output: factor}, "removed": node_label(producer)})


def _constant_factor(graph: onnx.GraphProto, node: onnx.NodeProto) -> tuple[float | None, str | None]:
    inits = {i.name: i for i in graph.initializer}
    consts = {n.output[0]: n for n in graph.node if n.op_type == "Constant"}
    for pos, name in enumerate(node.input):
        if name in inits:
            value = to_array(inits[name])
        elif name in consts:
            attr = next((a for a in consts[name].attribute if a.name == "value"), None)
            if attr is None:
                continue
            value = to_array(attr.t)
        else:
            continue
        if value.size != 1:
            return None, None
        factor = float(np.asarray(value).reshape(()))
        if factor <= 0 or not float(math.log2(factor)).is_integer():
            return None, None
        return factor, node.input[1 - pos]
    return None, None
