"""Compensate a scaled Log input: `Log(x * 2^p)` -> `Add(Log(x * 2^p), -p ln 2)`, equal to `Log(x)`.

log(2^p x) = log(x) + p ln 2, so a scale domain that reaches a Log (a power spectrum's
`Log(Max(re^2 + im^2, floor))`, its floor scaled with it) ends there with one added
constant. The Add keeps the Log's output name, so readers and comparisons see the
reference's values; the Log itself writes a new tensor.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from npuprep.rewrite import graph_ops as go


def add_log_offset(graph: gs.Graph, log: gs.Node, p: int) -> str:
    """Insert `Add(log's output, -p ln 2)` after `log`; returns the inserted node's name."""
    out = log.outputs[0]
    inner = gs.Variable(go.unique_name(graph, f"{out.name}__log2p{p}"), dtype=out.dtype,
                        shape=out.shape)
    log.outputs[0] = inner
    name = go.unique_name(graph, f"{go.node_label(log)}__offset")
    dtype = out.dtype if out.dtype is not None else log.inputs[0].dtype
    offset = go.scalar(f"{name}_c", -p * math.log(2.0),
                       go.np_dtype(dtype) if dtype is not None else np.float32)
    graph.nodes.append(gs.Node("Add", name, inputs=[inner, offset], outputs=[out]))
    return name
