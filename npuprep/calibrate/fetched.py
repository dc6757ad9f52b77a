"""Tensors' statistics from their values fetched out of the runtime and binned in numpy, row
for row what `instrument` builds with detail "all".

The in-graph histogram costs ~60 ns an element (Log, Clip, Cast, GatherElements and
ScatterElements over every value): the 8-bit conversion's own calibration (every tensor, 8
samples) and the passes that fill in a few tensors (equalisation and balancing re-calibrate
the tensors they rescale, 4-8 samples each, several times) paid it on every element. Fetched,
the same numbers come from the float32 bits: the exponent field is the bin of every normal
value, Inf and NaN share the top bin, and a zero or subnormal's bin is the bit length of its
mantissa (floor(log2 |x|) + 150 = floor(log2 m) + 1 for |x| = m 2^-149). The values are those
the instrumented graph reads: the same graph at the same opset, in a session built the same
way (prepacked weights, every optimisation), each tensor an output.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from npuprep.calibrate.layout import HEADER, HIST_BINS, OVER_FORMATS, WIDTH
from npuprep.graph import infer_tensors, node_label
from npuprep.numerics import FLOAT_ONNX_TYPES, get_format

# float32 bits: the exponent field's shift and the sign bit off.
_EXPONENT_SHIFT = 23
_MAGNITUDE = np.uint32(0x7FFFFFFF)
# Bin of a normal value = its biased exponent + this (2^-126 is bin 24; Inf/NaN, 255, bin 278).
_BIN_OF_EXPONENT = HIST_BINS - 1 - 255
_COL = {name: i for i, name in enumerate(HEADER)}
_OVER_MAX = {f: np.float32(get_format(f).max) for f in OVER_FORMATS}


# The most the fetched tensors of the samples in flight may hold (a whole calibration's every
# activation of a sample is held until its run ends): past it, the in-graph statistics, which
# free each activation as plain inference does. dnsmos_p835: 351 MiB a sample, two at once.
FETCH_BYTES = 1 << 30


def fetchable(model: onnx.ModelProto, tensors: Collection[str] | None) -> dict[str, str] | None:
    """Each of `tensors` (None: every float tensor `instrument` observes) -> the label of the
    node that writes it ("" for a graph input), where every one is a float32 tensor of the
    main graph (and, for every tensor, the graph has no bodies and every tensor a known type);
    None otherwise: the in-graph statistics handle bodies, other types and what they cannot
    observe."""
    graph = model.graph
    inits = {i.name for i in graph.initializer}
    written = {o: node_label(n) for n in graph.node if n.op_type != "Constant" for o in n.output if o}
    written.update({i.name: "" for i in graph.input if i.name not in inits})
    types = infer_tensors(model).types
    if tensors is None:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for n in graph.node for a in n.attribute) or any(t not in types for t in written):
            return None
        tensors = [t for t in written if types[t] in FLOAT_ONNX_TYPES]
    wanted = set(tensors)
    if not wanted <= set(written) or any(types.get(t) != TensorProto.FLOAT for t in wanted):
        return None
    return {t: written[t] for t in sorted(wanted)}


def fits(model: onnx.ModelProto, tensors: Collection[str], feed: Mapping[str, np.ndarray],
         streams: int) -> bool:
    """Whether `tensors` of `streams` samples shaped like `feed` fit in FETCH_BYTES and the
    run's memory budget (a tensor whose size shape inference cannot tell: no). A graph output
    is not counted: plain inference returns it too, so fetching it holds nothing more
    (ppocr_rec's `softmax_11.tmp_0`, which shape inference cannot size, kept its whole
    calibration in the graph)."""
    from npuprep.flops import tensor_shapes
    from npuprep.resources import affordable

    outputs = {o.name for o in model.graph.output}
    counted = [t for t in tensors if t not in outputs]
    shapes = tensor_shapes(model, {k: np.shape(v) for k, v in feed.items()})
    if any(t not in shapes for t in counted):
        return False
    held = streams * sum(4 * math.prod(shapes[t]) for t in counted)
    return held <= FETCH_BYTES and affordable(held)


def with_outputs(model: onnx.ModelProto, tensors: Sequence[str]) -> onnx.ModelProto:
    """A copy of `model` that returns `tensors` (float32) after its own outputs."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    have = {o.name for o in out.graph.output}
    out.graph.output.extend(helper.make_tensor_value_info(t, TensorProto.FLOAT, None)
                            for t in tensors if t not in have)
    return out


def row_of(values: np.ndarray) -> tuple[float, float, np.ndarray]:
    """(max, min, the int64 row [WIDTH]) of one float32 tensor-sample, as `detail_nodes`
    gives them: max and min ignoring NaN (-Inf and Inf where nothing else is there), the
    counts of NaN and of |x| above each format's max (Inf counts, NaN does not), the
    exponent histogram (zeros in bin 0, Inf and NaN in the top bin)."""
    x = np.ascontiguousarray(values, np.float32).reshape(-1)
    row = np.zeros(WIDTH, np.int64)
    row[_COL["count"]] = row[_COL["detailed"]] = x.size
    bits = x.view(np.uint32) & _MAGNITUDE
    exponent = bits >> np.uint32(_EXPONENT_SHIFT)
    by_exponent = np.bincount(exponent, minlength=256)
    hist = row[len(HEADER):]
    hist[_BIN_OF_EXPONENT + 1:] = by_exponent[1:]
    if by_exponent[0]:
        # Zeros and subnormals: the bit length of the mantissa (0 for a zero), which frexp of
        # the integer gives exactly. Zeros are counted, not selected (after a Relu half of
        # the values: their selection cost more than the rest of the row).
        zeros = bits.size - np.count_nonzero(bits)
        hist[0] = zeros
        if by_exponent[0] > zeros:
            subnormal = bits[(exponent == 0) & (bits != 0)]
            lengths = np.frexp(subnormal.astype(np.float64))[1]
            hist[:_BIN_OF_EXPONENT + 1] += np.bincount(lengths, minlength=_BIN_OF_EXPONENT + 1)
    nan = np.isnan(x) if by_exponent[255] else None
    clean = x if nan is None or not nan.any() else x[~nan]
    row[_COL["nan"]] = 0 if nan is None else int(nan.sum())
    if clean.size == 0:
        return -np.inf, np.inf, row
    top, bottom = clean.max(), clean.min()
    if max(top, -bottom) > min(_OVER_MAX.values()):
        magnitude = np.abs(clean)
        for fmt, limit in _OVER_MAX.items():
            row[_COL[f"over_{fmt}"]] = int(np.count_nonzero(magnitude > limit))
    return float(top), float(bottom), row
