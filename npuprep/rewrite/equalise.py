"""A Conv's output channels scaled into the Convs that read them (cross-layer equalisation).

    Conv(W1, B1) -> [Relu | PRelu | LeakyRelu | MaxPool]* -> x -> Conv(W2), Conv(W3) ...
    W1[c], B1[c] x s_c and W2[:, c], W3[:, c] / s_c: the same function in FP32

A grouped reader (a depthwise Conv: each output channel reads one input channel) takes 1/s_c
on the weights of the output channels that read channel c: W2[o, i] / s_(input channel of
o's group + i). Its INT8 weight scales are per output channel, so a depthwise reader loses
nothing at all: the activation's channels get per-channel levels for free (ppocr_rec's
first depthwise Conv reads channels spanning 1.0-18.2 with one scale).

An INT8 activation has one scale for every channel, set by its largest channel: a channel
that reaches 4 where another reaches 16 keeps a quarter of the levels. Scaling each channel
of x up to the largest channel's range (s_c = max / max_c, Nagel et al. 2019, with the
activation's ranges as the ones to equalise) gives every channel all 255 levels; the ops
between commute with a positive per-channel factor (PRelu's slope and LeakyRelu's alpha
alike), the producer's weights take it per output channel (their INT8 scales are per output
channel, so they lose nothing) and the readers' weights give it back per input channel.
No op is added. mtcnn_pnet's bbox head (its input's channels reach 16.2 against a median
4.65): alone in INT8 its outputs' rel L2 falls from 0.063 to 0.022.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from npuprep.graph import attribute, constant_value, consumers, name_maker, node_label, producers
from npuprep.rewrite.result import RewriteResult

# Ops between the producer and x that commute with a positive factor per channel (axis 1):
# f(s x) = s f(x) for s > 0, whatever PRelu's slope or LeakyRelu's alpha.
_PER_CHANNEL_HOMOGENEOUS = {"Relu", "PRelu", "LeakyRelu", "MaxPool"}
# A channel is scaled up by at most this (a near-silent channel would otherwise take a
# factor that its producer's FP16 output and its readers' weights pay for).
MAX_FACTOR = 16.0


@dataclass(frozen=True)
class Chain:
    """`producer` (a Conv label) writes channels that reach `tensor` through per-channel
    homogeneous ops (`between`, labels) and are read only by the Convs `readers`."""

    producer: str
    tensor: str
    readers: tuple[str, ...]
    between: tuple[str, ...] = ()


def chains(graph: onnx.GraphProto, readers: Sequence[str]) -> list[Chain]:
    """Every tensor whose readers are all Convs among `readers` (constant
    weights) and that a Conv with constant weights writes through per-channel homogeneous
    ops only, each tensor on the way read by the next op alone and no graph output."""
    made, read = producers(graph), consumers(graph)
    outputs = {o.name for o in graph.output}
    wanted = set(readers)
    found = []
    for x in dict.fromkeys(n.input[0] for n in graph.node
                           if node_label(n) in wanted and n.op_type == "Conv" and n.input):
        users = read.get(x, [])
        if not users or x in outputs or not all(_reads_as_conv(graph, u, x, wanted) for u in users):
            continue
        between: list[str] = []
        node = made.get(x)
        while node is not None and node.op_type in _PER_CHANNEL_HOMOGENEOUS and \
                len(read.get(node.input[0], [])) == 1 and node.input[0] not in outputs:
            between.append(node_label(node))
            node = made.get(node.input[0])
        if node is not None and node.op_type == "Conv" and _scalable(graph, node):
            found.append(Chain(node_label(node), x, tuple(node_label(u) for u in users),
                               tuple(reversed(between))))
    return found


def factors(channel_absmax: np.ndarray) -> np.ndarray:
    """s per channel: each channel's abs-max raised to the largest's, at most MAX_FACTOR;
    a channel that is zero throughout stays as it is."""
    top = float(channel_absmax.max(initial=0.0))
    s = np.where(channel_absmax > 0, top / np.maximum(channel_absmax, 1e-30), 1.0)
    return np.clip(s, 1.0, MAX_FACTOR).astype(np.float32)


def equalise(model: onnx.ModelProto, found: Sequence[Chain], scales: Mapping[str, np.ndarray], *,
             place: Callable[[np.ndarray, str], onnx.TensorProto] | None = None) -> RewriteResult:
    """Each chain's producer's output channels times `scales[chain.tensor]`, its readers'
    input channels divided by it (new initialisers made by `place`, inline by default)."""
    place = place or numpy_helper.from_array
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    by_label = {node_label(n): n for n in g.node}
    fresh = name_maker(g)
    done: dict[str, str] = {}

    def replace_input(node: onnx.NodeProto, i: int, value: np.ndarray) -> None:
        name = fresh(f"{node.input[i]}_equalised")
        g.initializer.append(place(value.astype(np.float32), name))
        node.input[i] = name

    for chain in found:
        s = scales.get(chain.tensor)
        if s is None or np.all(s == 1.0):
            continue
        producer = by_label[chain.producer]
        w = constant_value(g, producer.input[1])
        assert w is not None, chain.producer
        replace_input(producer, 1, w * s.reshape(-1, *[1] * (w.ndim - 1)))
        if len(producer.input) > 2 and producer.input[2]:
            b = constant_value(g, producer.input[2])
            assert b is not None, chain.producer
            replace_input(producer, 2, b * s)
        for label in chain.readers:
            reader = by_label[label]
            w = constant_value(g, reader.input[1])
            assert w is not None, label
            replace_input(reader, 1, w / per_weight(s, w.shape, attribute(reader, "group", 1)))
        done[chain.tensor] = chain.producer
    if not done:
        return RewriteResult(model, False, "no Conv input had channels to equalise")
    from npuprep.rewrite.qdq import drop_unused_weights

    drop_unused_weights(g)
    return RewriteResult(out, True, f"{len(done)} Conv input(s) equalised into their producers",
                         {"equalised": done})


def per_weight(s: np.ndarray, shape: Sequence[int], group: int) -> np.ndarray:
    """The factor of each (output, input) channel pair of a Conv weight `shape` (O, I/group,
    k...) that reads channels scaled by `s`, broadcastable over the kernel."""
    out, per_group = shape[0], shape[1]
    first = (np.arange(out) // (out // group)) * per_group  # the group's first input channel
    pairs = s[first[:, None] + np.arange(per_group)[None, :]]
    return pairs.reshape(out, per_group, *[1] * (len(shape) - 2))


def _reads_as_conv(graph: onnx.GraphProto, node: onnx.NodeProto, x: str, wanted: set[str]) -> bool:
    w = constant_value(graph, node.input[1]) if node.op_type == "Conv" and len(node.input) > 1 \
        else None
    group = attribute(node, "group", 1)
    # Grouped readers too (depthwise): each weight names its input channel (per_weight).
    return (w is not None and node_label(node) in wanted and node.input[0] == x
            and x not in node.input[1:] and w.ndim >= 3 and w.shape[0] % group == 0)


def _scalable(graph: onnx.GraphProto, node: onnx.NodeProto) -> bool:
    """A Conv whose weight (and bias, if any) are constants."""
    if len(node.input) < 2 or constant_value(graph, node.input[1]) is None:
        return False
    return len(node.input) < 3 or not node.input[2] or constant_value(graph, node.input[2]) is not None

