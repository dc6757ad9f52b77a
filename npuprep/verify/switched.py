"""Rounding each candidate switches on, so one session measures them all (npuprep.verify.attribution):

    x -> Where(on_c, round(x), x) -> c -> y' -> Where(on_c, round(y'), y') -> y
    (an If(on_c, round, Identity) in place of each Where on a large tensor)

A node whose switch is on computes as emulate() rounds a node that is not pinned: its float
inputs (graph inputs, weights, other nodes' outputs) enter in the target format and what it
stores is rounded; with the switch off it is FP32. Rounding twice is rounding once, so any
set of switches on gives the numbers of `emulate(pinned_nodes=every other node)`, with one
session instead of one per set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from npuprep.graph import infer_tensors, node_label, walk_graphs
from npuprep.numerics import NumberFormat
from npuprep.ops import FP32_ONLY_INPUTS
from npuprep.opsets import WORKING_OPSET, at_least, check_opset_supported
from npuprep.verify.emulate import FP8_MIN_OPSET, _ChainBuilder, stores_rounded_values

# Tensors of a static size of at least this many elements switch their rounding with an If:
# a Where computes the rounding whether on or off, which dominated the FCN stand-in's
# attribution at 512x416 (1.4x faster with If there); below it (and where the size is not
# static) a Where, cheaper than the session-creation cost of two subgraphs.
IF_FROM_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class Switched:
    """The model with switchable rounding and the boolean graph input of each candidate."""

    model: onnx.ModelProto
    switches: dict[str, str]

    def feed(self, on: set[str]) -> dict[str, np.ndarray]:
        """Switch inputs turning on the rounding of the candidates in `on`, off the rest."""
        return {switch: np.array(label in on) for label, switch in self.switches.items()}


def switched_emulation(model: onnx.ModelProto, fmt: NumberFormat, *, saturate: bool,
                       candidates: Sequence[str]) -> Switched:
    """`model` (FP32) where each of `candidates` (node labels) computes in `fmt` when its
    switch is on, overflowing as `saturate` says; every other node computes in FP32."""
    check_opset_supported(model, "emulation")
    need = FP8_MIN_OPSET if fmt.name.startswith("fp8") else WORKING_OPSET
    model, _ = at_least(model, need, why="emulating an older opset")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inferred = infer_tensors(model)
    types, shapes = inferred.types, inferred.shapes
    wanted = set(candidates)
    switches: dict[str, str] = {}
    builder = _ChainBuilder(fmt, saturate)
    for scope in walk_graphs(out.graph):
        graph = scope.graph
        builder.new_scope()
        fp32_only = {name for node in graph.node for pos, name in enumerate(node.input)
                     if pos in FP32_ONLY_INPUTS.get(node.op_type, ())}
        # Values emulate() rounds where they enter a rounded node: this graph's own (its
        # nodes' outputs, initialisers) and, in the main graph, its inputs.
        local = {o for n in graph.node for o in n.output if o} | {i.name for i in graph.initializer}
        if scope.is_main:
            local |= {vi.name for vi in graph.input}
        nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            label = node_label(node)
            if label not in wanted or node.op_type == "Constant":
                nodes.append(node)
                continue
            switch = switches.setdefault(label, f"npuprep_on__{len(switches)}")

            def gated(src: str, dst: str, switch: str = switch) -> list[onnx.NodeProto]:
                rounded = builder.fresh(dst)
                if math.prod(shapes.get(src, (0,))) < IF_FROM_ELEMENTS:
                    return [*builder.chain(src, rounded),
                            helper.make_node("Where", [switch, rounded, src], [dst],
                                             name=builder.fresh("emu_switch"))]
                # A large tensor: an If, so only a switched-on candidate pays for its rounding
                # (a Where computes every candidate's Cast pairs in every run).
                kept = builder.fresh(dst)
                return [helper.make_node(
                    "If", [switch], [dst], name=builder.fresh("emu_switch"),
                    then_branch=helper.make_graph(builder.chain(src, rounded), builder.fresh("on"), [],
                                                  [helper.make_tensor_value_info(rounded, TensorProto.FLOAT, None)]),
                    else_branch=helper.make_graph([helper.make_node("Identity", [src], [kept])], builder.fresh("off"),
                                                  [], [helper.make_tensor_value_info(kept, TensorProto.FLOAT, None)]))]

            for pos, name in enumerate(node.input):
                if name in local and types.get(name) == TensorProto.FLOAT and name not in fp32_only:
                    entering = builder.fresh(name)
                    nodes += gated(name, entering)
                    node.input[pos] = entering
            nodes.append(node)
            if not stores_rounded_values(node):
                continue
            for pos, name in enumerate(node.output):
                if name and types.get(name) == TensorProto.FLOAT and name not in fp32_only:
                    stored = builder.fresh(name)
                    node.output[pos] = stored
                    nodes += gated(stored, name)
        del graph.node[:]
        graph.node.extend(builder.constants + nodes)
        del graph.value_info[:]
    for switch in switches.values():
        out.graph.input.append(helper.make_tensor_value_info(switch, TensorProto.BOOL, []))
    return Switched(out, switches)
