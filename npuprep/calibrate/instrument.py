"""x -> [ReduceMax, ReduceMin, ReduceL1] -> If(ordinary, counts=0, exact detail): statistics inside the graph.

Every observed float tensor gets reductions appended right after its producer, so only a few
numbers per tensor leave onnxruntime and each activation dies as soon as plain inference
would free it. Per tensor and sample the graph yields:

- FX, FN: max and min (NaN ignored);
- I: int64 counts, `HEADER` below: element count, detailed elements, NaN, |x| above each
  format's max, then the exponent histogram over bins b = floor(log2|x|) + 150
  (0: zero, 1..23: subnormal, 278: Inf/NaN);
- L1: a sum over x that is NaN or infinite when x holds a NaN or an Inf (the NaN flag).

The main graph returns FX, FN and L1 one after the other in one output (FNL) and I in
another (`Instrumented.read` splits them); If/Loop/Scan bodies keep four (see below).

The detail (counts and histogram) costs ~15 ns per element in onnxruntime, several times
plain inference, so with `detail="auto"` it runs only for a tensor-sample that is not
*ordinary*. Ordinary means finite with LO <= abs-max <= HI: then no value exceeds any format's
max (all counts above are exactly 0), and values below a format's smallest normal lie below
the tensor's own precision floor (abs-max x eps) for every format npuprep knows.
`detail="fp16"` is "auto" exact for FP16 and BF16 only, with their wider ordinary range
(npuprep.calibrate.layout.Scope). `detail="all"` runs it everywhere. `detailed=` (a set of
tensor names) keeps the detail
only for those tensors; any other tensor-sample that is not ordinary is flagged (FLAGGED in
its "detailed" count) so the caller can rerun the sample on a graph that details it: the
detail branches are most of a session's creation time, and few tensors ever need them.
`lean=` (detailed tensors) gives those the lean detail, computed in every sample and picked
by the ordinary test (no If at all), without the branches for NaN, zeros/subnormals and
counts above the formats' maxima; a tensor-sample that needs one of them is flagged too
(`lean_detail_nodes`).

Cheaper routes to the same numbers: a 4-D activation that onnxruntime keeps in its NCHWc
layout is reduced through global pools (`pooled_reductions`), a monotone map of one
tensor (Relu, Neg, scalar Add/Sub/Mul) takes that tensor's max and min through the same
operation (`_derived_stats`), and a BatchNormalization of a pooled tensor takes them from
its input's per-channel pools (`_batchnorm_stats`). Rows outside Loop/Scan bodies have no gate in the graph: the
caller judges them ordinary from abs-max and the L1 output (`Instrumented.ordinary`).

`nan_checked=` (a set of tensor names) skips the NaN-propagating L1 pass on main-graph tensors
whose producer cannot make a NaN out of finite inputs (`_NAN_SAFE_OPS`) unless they are in the
set: such a tensor is NaN-free whenever every float input is finite, which the caller checks
from the inputs' rows (`Instrumented.nan_inputs`) and reruns a sample with the L1 where it
cannot tell.

If/Loop/Scan bodies are instrumented the same way; their statistics leave the body as extra
If outputs or extra Loop/Scan state (max of max, min of min, sum of counts over iterations).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.calibrate.detail import (
    CONST_FLAG_ROW,
    CONST_FLAT,
    CONST_HI,
    CONST_HI_NARROW,
    CONST_LO,
    CONST_LO_NARROW,
    CONST_NEG_CHANNELS,
    CONST_ONE_DIM,
    CONST_ONES,
    CONST_ROW,
    CONST_SIZE,
    CONST_ZERO_F,
    CONST_ZEROS_TAIL,
    NCHWC_FOLLOWERS,
    detail_nodes,
    lean_detail_nodes,
    pooled_channels,
    pooled_reductions,
    shared_constants,
)
from npuprep.calibrate.layout import (
    ELEMS,
    SCOPES,
    WIDTH,
    Scope,
    Slot,
    Wiring,
    scope_of,
)
from npuprep.graph import infer_tensors, node_label, producers, to_array
from npuprep.model_io import model_opset
from npuprep.numerics import FLOAT_ONNX_TYPES
from npuprep.ops import GATHER_OPS, LAYOUT_OPS, MAC_OPS, SCALE_WALK_BACK

# Ops whose output holds no NaN when every float input is finite: elementwise maps that can
# only overflow to +-Inf (which max and min see), sums of finite values (once Inf, a sum stays
# Inf), data movement. Not here: Div, Pow, Sqrt, Log (0/0, domain), MatMul/Gemm/Conv (products
# that overflow to both +Inf and -Inf), normalisations (Inf / Inf), ops with a NaN attribute.
_NAN_SAFE_OPS = LAYOUT_OPS | GATHER_OPS | {
    "Abs", "Add", "AveragePool", "Cast", "Ceil", "Celu", "Clip", "Concat", "Cos", "Elu", "Erf",
    "Exp", "Expand", "Floor", "Gelu", "GlobalAveragePool", "GlobalMaxPool", "HardSigmoid",
    "HardSwish", "LeakyRelu", "LogSoftmax", "Max", "MaxPool", "Min", "Mul", "Neg", "PRelu",
    "Reciprocal", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceSum", "ReduceSumSquare", "Relu",
    "Round", "Selu", "Sigmoid", "Sign", "Sin", "Slice", "Softmax", "Softplus", "Softsign",
    "Split", "Sub", "Sum", "Tanh", "Tile", "Where",
}
_WIDENING = {
    TensorProto.FLOAT: {TensorProto.DOUBLE},
    TensorProto.FLOAT16: {TensorProto.FLOAT, TensorProto.DOUBLE},
    TensorProto.BFLOAT16: {TensorProto.FLOAT, TensorProto.DOUBLE},
    TensorProto.FLOAT8E4M3FN: {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16},
    TensorProto.FLOAT8E5M2: {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16},
}


@dataclass(frozen=True)
class Instrumented:
    """The model with statistics outputs, and how to read them."""

    model: onnx.ModelProto
    outputs: tuple[str, str]  # FNL (FX, FN and L1 one after the other), I
    slots: tuple[Slot, ...]
    aliases: dict[str, Slot]  # tensor -> its own slot info, sharing the row of `alias_of`
    alias_of: dict[str, str]
    unobserved: dict[str, str]
    # Row of a tensor without the L1 pass -> rows of the float inputs that must all be finite
    # for it to be NaN-free.
    nan_inputs: dict[int, tuple[int, ...]] = field(default_factory=dict)
    scope: Scope = SCOPES["auto"]  # its ordinary range (see npuprep.calibrate.layout.Scope)

    @cached_property
    def _gated_outside(self) -> np.ndarray:
        return np.array([s.gated_outside for s in self.slots], bool)

    @cached_property
    def ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """Each row's ordinary range (lo, hi): the scope's, the "auto" one for narrow rows."""
        pairs = [self.scope.range_of(s.narrow) for s in self.slots]
        return np.array([lo for lo, _ in pairs], np.float64), np.array([hi for _, hi in pairs], np.float64)

    def read(self, values: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """FX, FN, I and L1 (see the module docstring) out of the session's `outputs`."""
        fnl, ii = (np.asarray(v) for v in values)
        fx, fn, l1 = fnl.reshape(3, -1)
        return fx, fn, ii, l1

    def ordinary(self, fx: np.ndarray, fn: np.ndarray, rows: np.ndarray, l1: np.ndarray) -> np.ndarray:
        """Per row, False where a row gated outside the graph is not ordinary (the in-graph
        gate's test: finite, lo <= abs-max <= hi, or empty); True for every other row."""
        absmax = np.fmax(fx, -fn)
        lo, hi = self.ranges
        fine = (rows[:, 0] == 0) | (np.isfinite(l1) & (absmax >= lo) & (absmax <= hi))
        return ~self._gated_outside | fine


def instrument(
    model: onnx.ModelProto,
    *,
    detail: str = "auto",
    detailed: Collection[str] | None = None,
    nan_checked: Collection[str] | None = None,
    lean: Collection[str] = (),
    only: Collection[str] | None = None,
) -> Instrumented:
    """A copy of `model` whose extra outputs carry per-tensor statistics of one sample.

    `detailed`: with detail "auto", the tensors that get the detail branch (default: all);
    `nan_checked`: the tensors that keep the L1 pass where it could be skipped (default: all);
    `lean`: of the detailed main-graph tensors, those that get the lean detail in every sample
    (see `lean_detail_nodes`). The rows (slots) are the same whatever they hold. `detail`
    "fp16" is "auto" with the FP16/BF16 scope's ordinary range (npuprep.calibrate.layout).
    `only`: the tensors observed (default: every float tensor); each measures as it does
    among all of them.
    """
    scope = scope_of(detail)
    detail = "all" if detail == "all" else "auto"
    info = infer_tensors(model)
    ctx = Wiring(types=info.types, shapes=info.shapes, opset=model_opset(model), detail=detail, scope=scope,
               narrow=log_chains(model.graph) if scope.hi > SCOPES["auto"].hi else frozenset(),
               detailed=None if detailed is None else frozenset(detailed),
               nan_checked=None if nan_checked is None or detail == "all" else frozenset(nan_checked),
               lean=frozenset(lean) if detail == "auto" and detailed is not None else frozenset(),
               only=None if only is None else frozenset(only))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    graph.initializer.extend(shared_constants(scope))
    names, slots = _instrument_graph(graph, "main", ctx)
    for size in sorted(ctx.sizes):
        row = np.zeros(WIDTH, np.int64)
        row[0] = size
        graph.initializer.extend([numpy_helper.from_array(np.array([size], np.int64), f"{CONST_SIZE}{size}"),
                                  numpy_helper.from_array(row, f"{CONST_ROW}{size}")])
    graph.initializer.extend(
        numpy_helper.from_array(np.full((1, c, 1, 1), -1, np.float32), f"{CONST_NEG_CHANNELS}{c}") for c in sorted(ctx.channels)
    )
    graph.initializer.extend(numpy_helper.from_array(np.ones(c, np.float32), f"{CONST_ONES}{c}") for c in sorted(ctx.ones))
    for name, elem, width in zip(names, (TensorProto.FLOAT, TensorProto.INT64), (3, WIDTH), strict=True):
        graph.output.append(helper.make_tensor_value_info(name, elem, [len(slots) * width]))
    row_of = {slot.tensor: i for i, slot in enumerate(slots) if slot.scope == "main"}
    nan_inputs = {row_of[t]: tuple(row_of[ctx.alias_of.get(i, i)] for i in inputs) for t, inputs in ctx.trusting.items()}
    return Instrumented(out, tuple(names), tuple(slots), ctx.aliases, ctx.alias_of, ctx.unobserved, nan_inputs,
                        scope)


# How far back from a Log the chain that feeds it is followed (a power spectrum's squares,
# sums, floors, a filter bank, layout ops; lengths measured on the extra2 front ends: 4-9).
_LOG_CHAIN_DEPTH = 16


def log_chains(graph: onnx.GraphProto) -> frozenset[str]:
    """The main graph's tensors on their way into a Log: back from each Log through the ops a
    scale walks back through (squares, sums, floors, layout; npuprep.ops.SCALE_WALK_BACK) and
    a MatMul/Gemm with a constant weight (a filter bank), to the transform that makes them (a
    Conv's output, included).

    Their small values matter whatever their abs-max: a power spectrum spans 1e-12 .. 358
    (basic_pitch), 75% of it under FP16's smallest normal, and the Log turns what FP16 loses
    there into large errors. The "ordinary" test behind a wide scope (values under abs-max x
    eps are negligible) does not hold for them, so they keep the "auto" range and its detail.
    """
    made = producers(graph)
    constant = {i.name for i in graph.initializer} | {
        o for n in graph.node if n.op_type == "Constant" for o in n.output}
    found: set[str] = set()
    frontier = [n.input[0] for n in graph.node if n.op_type == "Log" and n.input]
    for _ in range(_LOG_CHAIN_DEPTH):
        following: list[str] = []
        for tensor in frontier:
            if not tensor or tensor in found or tensor in constant:
                continue
            found.add(tensor)
            node = made.get(tensor)
            if node is None or node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type in MAC_OPS:
                bank = (node.op_type in ("MatMul", "Gemm") and len(node.input) > 1
                        and node.input[1] in constant)
                following += [node.input[0]] if bank else []
                continue
            if node.op_type not in SCALE_WALK_BACK:
                continue
            positions = SCALE_WALK_BACK[node.op_type]
            following += [i for k, i in enumerate(node.input) if positions is None or k in positions]
        frontier = following
    return frozenset(found)


def _instrument_graph(graph: onnx.GraphProto, scope: str, ctx: Wiring) -> tuple[tuple[str, ...], list[Slot]]:
    """Add statistics to one graph; returns the names of its statistics vectors and their rows:
    FX, FN, I, L1 in a body, FNL and I in the main graph (see `_main_order`)."""
    original = list(graph.node)
    made = producers(graph)
    inits = {i.name for i in graph.initializer}
    pieces: list[tuple[str, str, str, str]] = []
    slots: list[Slot] = []
    new_nodes: list[onnx.NodeProto] = []
    # The main graph's statistics nodes, one block per observed tensor (see _main_order).
    blocks: list[list[onnx.NodeProto]] = []

    observed: set[str] = set()

    def observe(tensor: str, node_name: str) -> None:
        elem = ctx.types.get(tensor)
        if elem not in FLOAT_ONNX_TYPES or (ctx.only is not None and tensor not in ctx.only):
            return
        observed.add(tensor)
        src = _alias_source(made.get(tensor), ctx)
        if src is not None and src in observed:
            ctx.alias_of[tensor] = ctx.alias_of.get(src, src)
            ctx.aliases[tensor] = Slot(tensor, scope, node_name)
            return
        trusted = _trusted_inputs(made.get(tensor), tensor, scope, observed, ctx)
        if trusted is not None:
            ctx.trusting[tensor] = trusted
        outside = ctx.detail == "auto" and ctx.loop_depth == 0 and ctx.detailed is not None and tensor not in ctx.detailed
        derived = _derived_stats(tensor, made.get(tensor), ctx) if trusted is not None and outside else None
        nodes, piece = derived or _tensor_stats(tensor, elem, ctx, l1=trusted is None, gate=not outside)
        if scope == "main":
            ctx.minmax[tensor] = piece[:2]
            blocks.append(nodes)
        else:
            new_nodes.extend(nodes)
        pieces.append(piece)
        slots.append(Slot(tensor, scope, node_name, outside, scope == "main" and tensor in ctx.narrow))

    for vi in graph.input:
        if vi.name not in inits:
            observe(vi.name, "")
    if scope == "main":
        finite, scalars, nonneg = _known_constants(graph)
        ctx.known_finite |= finite
        ctx.known_nonneg |= nonneg
        ctx.scalars.update(scalars)
    for node in original:
        own_outputs = list(node.output)
        if scope == "main" and node.domain in ("", "ai.onnx") and (
                node.op_type == "Conv" or (node.op_type in NCHWC_FOLLOWERS and node.input and node.input[0] in ctx.nchwc)):
            ctx.nchwc.update(o for o in node.output if o)
        sub_pieces = _instrument_subgraphs(node, scope, ctx, graph)
        new_nodes.append(node)
        for piece, sub_slots in sub_pieces:
            pieces.append(piece)
            slots.extend(sub_slots)
        if node.op_type == "Constant":
            continue
        for out in own_outputs:
            if not out:
                continue
            if out not in ctx.types:
                ctx.unobserved[out] = "element type unknown (shape inference could not type it)"
                continue
            observe(out, node_label(node))
    if scope == "main":
        names = (ctx.name("fnl"), ctx.name("i"))
        columns = [[p[k] for p in pieces] for k in (0, 1, 3)]
        new_nodes = _main_order(blocks, new_nodes, [
            helper.make_node("Concat", [p[2] for p in pieces], [names[1]], axis=0),
            helper.make_node("Concat", [n for column in columns for n in column], [names[0]], axis=0),
        ] if pieces else [])
        joined_elems = (TensorProto.FLOAT, TensorProto.INT64)
    else:
        names = tuple(ctx.name(k) for k in ("fx", "fn", "i", "l1"))
        if pieces:
            for k, name in enumerate(names):
                new_nodes.append(helper.make_node("Concat", [p[k] for p in pieces], [name], axis=0))
        joined_elems = ELEMS
    if not pieces:
        graph.initializer.extend(
            numpy_helper.from_array(np.zeros(0, helper.tensor_dtype_to_np_dtype(elem)), name)
            for name, elem in zip(names, joined_elems, strict=True)
        )
    del graph.node[:]
    graph.node.extend(new_nodes)
    return names, slots


def _main_order(
    blocks: list[list[onnx.NodeProto]], model_nodes: list[onnx.NodeProto], outputs: list[onnx.NodeProto]
) -> list[onnx.NodeProto]:
    """The main graph's nodes in the order that makes onnxruntime reduce each tensor right
    after its producer: the statistics blocks first, the last observed tensor's first, then
    the model's nodes, then the outputs' Concats, FNL's last.

    onnxruntime orders a session's nodes twice, and both orders follow node indices (the
    proto's order): priority order (see make_session_external) runs the ready node of
    lowest index next, so statistics ahead of the model run as soon as their tensor exists;
    the layout pass that moves convolutions to NCHWc (whose new nodes get new indices in the
    order it visits them) visits a depth-first walk up from the last output, FNL, which
    enters the inputs of highest index first, so the first tensor's statistics come first,
    each right after its producer. In the proto's order (statistics after their producers,
    one Concat per output) that pass left every pooled reduction of a conv net to the end:
    each activation stayed alive until then and was reduced cold. The proto is then not
    topologically sorted, which onnxruntime does not require."""
    return [n for block in reversed(blocks) for n in block] + model_nodes + outputs


# Constants up to this many elements are checked for finiteness when instrumenting; larger
# ones count as unknown (their consumers keep the L1 pass).
_CHECKED_CONSTANT = 1 << 16


def _known_constants(graph: onnx.GraphProto) -> tuple[set[str], dict[str, float], set[str]]:
    """Of the inline initialisers and Constant outputs (external ones' values are not at
    hand): those whose values are all finite, the finite one-element float32 ones by value,
    and the finite ones with no negative value."""
    finite: set[str] = set()
    scalars: dict[str, float] = {}
    nonneg: set[str] = set()
    tensors = [(t.name, t) for t in graph.initializer if t.data_location != TensorProto.EXTERNAL]
    tensors += [(node.output[0], a.t) for node in graph.node if node.op_type == "Constant" and node.output
                for a in node.attribute if a.name == "value"]
    for name, tensor in tensors:
        if tensor.data_type not in FLOAT_ONNX_TYPES:
            finite.add(name)
            continue
        if math.prod(tensor.dims) > _CHECKED_CONSTANT:
            continue
        values = to_array(tensor).astype(np.float64)
        if np.isfinite(values).all():
            finite.add(name)
            if (values >= 0).all():
                nonneg.add(name)
            if values.size == 1 and tensor.data_type == TensorProto.FLOAT:
                scalars[name] = float(values.reshape(()))
    return finite, scalars, nonneg


def _derived_stats(
    tensor: str, node: onnx.NodeProto | None, ctx: Wiring
) -> tuple[list[onnx.NodeProto], tuple[str, str, str, str]] | None:
    """Max and min of a monotone elementwise map of one observed float32 tensor, from that
    tensor's max and min through the same operation, instead of two reductions: Relu, Neg,
    and Add, Sub, Mul with a finite scalar constant. Correctly rounded arithmetic is
    monotone, so f(max x) is the largest f(x) exactly. Also inference BatchNormalization of a
    pooled tensor, monotone per channel (`_batchnorm_stats`). Only for rows proven NaN-free by
    their input (see _trusted_inputs); None where the rule does not apply."""
    if node is None or ctx.types.get(tensor) != TensorProto.FLOAT or tensor not in ctx.shapes:
        return None
    if node.op_type == "BatchNormalization":
        return _batchnorm_stats(tensor, node, ctx)
    sources = [i for i in node.input if i and i not in ctx.scalars]
    if len(sources) != 1 or ctx.types.get(sources[0]) != TensorProto.FLOAT:
        return None
    x = sources[0]
    found = ctx.minmax.get(ctx.alias_of.get(x, x))
    if found is None:
        return None
    xmax, xmin = found
    op = node.op_type
    if op in ("Relu", "Neg") and len(node.input) == 1:
        pairs = ((xmax, xmin), (xmin, xmax))[op == "Neg"]
        operands = [[pairs[0]], [pairs[1]]]
    elif op in ("Add", "Sub", "Mul") and len(node.input) == 2:
        c = next(i for i in node.input if i != x)
        falling = (op == "Sub" and node.input[1] == x) or (op == "Mul" and ctx.scalars[c] < 0)
        if op == "Mul" and ctx.scalars[c] == 0:
            return None
        hi, lo = (xmin, xmax) if falling else (xmax, xmin)
        operands = [[hi if i == x else i for i in node.input], [lo if i == x else i for i in node.input]]
    else:
        return None
    mx, mn = ctx.name("dmax"), ctx.name("dmin")
    nodes = [helper.make_node(op, operands[0], [mx]), helper.make_node(op, operands[1], [mn])]
    return nodes, (mx, mn, _ordinary_row(tensor, "", ctx)[1], CONST_ZERO_F)


def _batchnorm_stats(
    tensor: str, node: onnx.NodeProto, ctx: Wiring
) -> tuple[list[onnx.NodeProto], tuple[str, str, str, str]] | None:
    """y = BatchNormalization(x) with constant parameters is, per channel c, one monotone map
    y = f_c(x) (rising or falling with the sign of scale_c), so each channel's extremes of y are
    f_c of that channel's extremes of x, computed by the same operation on x's per-channel
    max and min from its pools. No pass over y: onnxruntime can fuse the BatchNormalization
    (and a Relu after it) into one kernel, as in plain inference. Called only for a row its
    input proves NaN-free, which makes the node an inference BatchNormalization with constant
    parameters (_nan_safe_batchnorm); None unless x was pooled."""
    x = node.input[0]
    found = ctx.channel_extremes.get(ctx.alias_of.get(x, x))
    if found is None:
        return None
    n = ctx.name
    cmax, cneg = found
    cmin, at_max, at_min, hi_c, lo_c, hi_v, lo_v, mx, mn = (n(s) for s in (
        "bn_cmin", "bn_at_max", "bn_at_min", "bn_hi_c", "bn_lo_c", "bn_hi_v", "bn_lo_v", "dmax", "dmin"))
    params = list(node.input[1:])
    channels = ctx.shapes[x][1]
    nodes = [
        # -1 per channel, not Neg: the Mul keeps the pool in onnxruntime's blocked layout, so
        # its BatchNormalization becomes the same blocked kernel as the full tensor's (a Neg
        # would bring it back to NCHW, to a kernel that rounds differently).
        helper.make_node("Mul", [cneg, f"{CONST_NEG_CHANNELS}{channels}"], [cmin]),
        helper.make_node("BatchNormalization", [cmax, *params], [at_max]),
        helper.make_node("BatchNormalization", [cmin, *params], [at_min]),
        helper.make_node("Max", [at_max, at_min], [hi_c]),
        helper.make_node("Min", [at_max, at_min], [lo_c]),
        helper.make_node("Reshape", [hi_c, CONST_FLAT], [hi_v]),
        helper.make_node("Reshape", [lo_c, CONST_FLAT], [lo_v]),
        helper.make_node("ReduceMax", [hi_v], [mx], keepdims=1),
        helper.make_node("ReduceMin", [lo_v], [mn], keepdims=1),
    ]
    nodes[1].attribute.extend(node.attribute)
    nodes[2].attribute.extend(node.attribute)
    return nodes, (mx, mn, _ordinary_row(tensor, "", ctx)[1], CONST_ZERO_F)


def _trusted_inputs(
    node: onnx.NodeProto | None, tensor: str, scope: str, observed: set[str], ctx: Wiring
) -> tuple[str, ...] | None:
    """The observed float inputs whose finiteness proves `tensor` NaN-free, or None when the
    tensor keeps its L1 pass (unsafe producer, a body, an input of unknown values, asked for)."""
    if (ctx.nan_checked is None or scope != "main" or tensor in ctx.nan_checked or node is None
            or not (node.op_type in _NAN_SAFE_OPS or _nan_safe_batchnorm(node, ctx))
            or node.domain not in ("", "ai.onnx") or (ctx.detailed is None or tensor in ctx.detailed)):
        return None
    trusted = []
    for name in node.input:
        if not name or ctx.types.get(name) not in FLOAT_ONNX_TYPES or name in ctx.known_finite:
            continue
        if name not in observed:
            return None
        trusted.append(name)
    return tuple(trusted)


def _nan_safe_batchnorm(node: onnx.NodeProto, ctx: Wiring) -> bool:
    """Inference BatchNormalization with finite constant parameters and a variance >= 0: an
    affine map per channel, so finite inputs give no NaN (sqrt(var + eps) is real)."""
    return (node.op_type == "BatchNormalization" and len(node.input) == 5
            and all(p in ctx.known_finite for p in node.input[1:]) and node.input[4] in ctx.known_nonneg
            and not any(a.name == "training_mode" and a.i for a in node.attribute))


def _alias_source(node: onnx.NodeProto | None, ctx: Wiring) -> str | None:
    """The tensor whose values a node's output repeats exactly, if any."""
    if node is None or not node.input:
        return None
    if node.op_type in LAYOUT_OPS or (node.op_type == "Dropout" and len(node.input) < 3):
        return node.input[0]
    if node.op_type == "Cast":
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if to in _WIDENING.get(ctx.types.get(node.input[0], -1), set()):
            return node.input[0]
    return None


def _ordinary_row(tensor: str, size: str, ctx: Wiring) -> tuple[list[onnx.NodeProto], str]:
    """The I row of an ordinary tensor-sample (its count, nothing else): a shared constant
    per static element count, else [count, 0...] built from `size`."""
    if tensor in ctx.shapes:
        count = math.prod(ctx.shapes[tensor])
        ctx.sizes.add(count)
        return [], f"{CONST_ROW}{count}"
    row = ctx.name("row")
    return [helper.make_node("Concat", [size, CONST_ZEROS_TAIL], [row], axis=0)], row


def _tensor_stats(
    tensor: str, elem: int, ctx: Wiring, *, l1: bool, gate: bool
) -> tuple[list[onnx.NodeProto], tuple[str, str, str, str]]:
    """Nodes that reduce one tensor to FX [1], FN [1], I [WIDTH], L1 [1]. `l1`: the
    NaN-propagating L1 that flags NaN (else the caller proves the tensor NaN-free, and L1 is
    0). `gate`: an If in the graph tells ordinary rows from those that need the detail (or
    FLAGs them); without, I is the ordinary row and the caller checks (Instrumented.ordinary).
    """
    n = ctx.name
    nodes: list[onnx.NodeProto] = []
    src = tensor
    if elem != TensorProto.FLOAT:
        src = n("f32")
        nodes.append(helper.make_node("Cast", [tensor], [src], to=TensorProto.FLOAT))
    flat = n("flat")
    pooled = pooled_channels(tensor, elem, ctx)
    if not pooled or gate:
        nodes.append(helper.make_node("Reshape", [src, CONST_FLAT], [flat]))
    count: int | None = None
    if tensor in ctx.shapes:
        # A static element count is a shared constant, not two nodes per tensor.
        count = math.prod(ctx.shapes[tensor])
        ctx.sizes.add(count)
        size = f"{CONST_SIZE}{count}"
    else:
        size = n("size")
        nodes.append(helper.make_node("Size", [tensor], [n("size0")]))
        nodes.append(helper.make_node("Reshape", [nodes[-1].output[0], CONST_ONE_DIM], [size]))
    mx, mn, sm = n("max"), n("min"), n("sum")
    if pooled:
        nodes += pooled_reductions(src, pooled, (mx, mn, sm if l1 else ""), ctx)
    else:
        nodes += [
            helper.make_node("ReduceMax", [flat], [mx], keepdims=1),
            helper.make_node("ReduceMin", [flat], [mn], keepdims=1),
        ]
        if l1:
            # NaN-propagating (onnxruntime's ReduceMax/Min are not): flags NaN and Inf.
            nodes.append(helper.make_node("ReduceL1", [flat], [sm], keepdims=1))
    l1_out = sm if l1 else CONST_ZERO_F
    if not gate:
        row_nodes, row = _ordinary_row(tensor, size, ctx)
        return nodes + row_nodes, (mx, mn, row, l1_out)
    if ctx.detail == "all":
        detailed, outs = detail_nodes(flat, size, ctx, (mx, mn, sm), count)
        return nodes + detailed, (*outs, l1_out)
    # score = abs-max, or NaN when L1 is not finite (a NaN or Inf somewhere); ordinary when
    # Clip leaves it as it is (NaN never equals).
    neg, am, z, score, clipped, ok = (n(s) for s in ("neg", "am", "z", "score", "clipped", "ok"))
    nodes += [
        helper.make_node("Neg", [mn], [neg]),
        helper.make_node("Max", [mx, neg], [am if l1 else score]),
    ]
    if l1:
        nodes += [helper.make_node("Mul", [sm, CONST_ZERO_F], [z]), helper.make_node("Add", [am, z], [score])]
    nodes += [
        helper.make_node("Clip", [score, *((CONST_LO_NARROW, CONST_HI_NARROW) if tensor in ctx.narrow
                                           else (CONST_LO, CONST_HI))], [clipped]),
        helper.make_node("Equal", [clipped, score], [ok]),
    ]
    if ctx.detailed is not None and tensor not in ctx.detailed:
        # No detail here: the ordinary row, FLAGGED in "detailed" when not ordinary.
        row_nodes, row = _ordinary_row(tensor, size, ctx)
        bad, badi, mark, ii = (n(s) for s in ("bad", "badi", "mark", "i"))
        nodes += [
            *row_nodes,
            helper.make_node("Not", [ok], [bad]),
            helper.make_node("Cast", [bad], [badi], to=TensorProto.INT64),
            helper.make_node("Mul", [badi, CONST_FLAG_ROW], [mark]),
            helper.make_node("Add", [row, mark], [ii]),
        ]
        return nodes, (mx, mn, ii, l1_out)
    if ctx.loop_depth == 0 and tensor in ctx.lean:
        # Computed whether or not this sample needs it, the row picked by the test the If
        # would make: the same statistics, and no branch to build or to run.
        lean_nodes, lean_row = lean_detail_nodes(flat, size, ctx, (mx, mn, sm), count)
        row_nodes, row = _ordinary_row(tensor, size, ctx)
        picked = n("picked")
        nodes += [*lean_nodes, *row_nodes, helper.make_node("Where", [ok, row, lean_row], [picked])]
        return nodes, (mx, mn, picked, l1_out)
    fx, fn, ii = n("fx"), n("fn"), n("i")
    then_fx, then_fn, then_i = n("then_fx"), n("then_fn"), n("then_i")
    row_nodes, row = _ordinary_row(tensor, size, ctx)
    then_nodes = [
        helper.make_node("Identity", [mx], [then_fx]),
        helper.make_node("Identity", [mn], [then_fn]),
        *row_nodes,
        helper.make_node("Identity", [row], [then_i]),
    ]
    then_branch = helper.make_graph(
        then_nodes, n("ordinary"), [],
        [
            helper.make_tensor_value_info(then_fx, TensorProto.FLOAT, [1]),
            helper.make_tensor_value_info(then_fn, TensorProto.FLOAT, [1]),
            helper.make_tensor_value_info(then_i, TensorProto.INT64, [WIDTH]),
        ],
    )
    exact, (dfx, dfn, dii) = detail_nodes(flat, size, ctx, (mx, mn, sm), count)
    else_branch = helper.make_graph(
        exact, n("detail"), [],
        [
            helper.make_tensor_value_info(dfx, TensorProto.FLOAT, [1]),
            helper.make_tensor_value_info(dfn, TensorProto.FLOAT, [1]),
            helper.make_tensor_value_info(dii, TensorProto.INT64, [WIDTH]),
        ],
    )
    nodes.append(helper.make_node("If", [ok], [fx, fn, ii], then_branch=then_branch, else_branch=else_branch))
    return nodes, (fx, fn, ii, l1_out)


def _instrument_subgraphs(
    node: onnx.NodeProto, scope: str, ctx: Wiring, outer: onnx.GraphProto
) -> list[tuple[tuple[str, ...], list[Slot]]]:
    """Instrument the bodies of an If/Loop/Scan node and wire their statistics out of it."""
    graph_attrs = [a for a in node.attribute if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)]
    if not graph_attrs:
        return []
    label = node_label(node)
    if node.op_type not in ("If", "Loop", "Scan"):
        for attr in graph_attrs:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subs:
                for inner in sub.node:
                    for out in inner.output:
                        if out and ctx.types.get(out) in FLOAT_ONNX_TYPES:
                            ctx.unobserved[out] = f"inside a {node.op_type} body ({label}); only If/Loop/Scan bodies are instrumented"
        return []
    if node.op_type == "If":
        return _wire_if(node, scope, label, ctx)
    return _wire_carried(node, scope, label, ctx, outer)


def _wire_if(node: onnx.NodeProto, scope: str, label: str, ctx: Wiring) -> list[tuple[tuple[str, ...], list[Slot]]]:
    """If: each branch's statistics, padded with the other branch's empty rows (count 0)."""
    branches = {a.name: a.g for a in node.attribute}
    results = {}
    for key in ("then_branch", "else_branch"):
        results[key] = _instrument_graph(branches[key], f"{scope}/{label}.{key}", ctx)
    k_then, k_else = len(results["then_branch"][1]), len(results["else_branch"][1])
    if k_then + k_else == 0:
        return []
    outs = tuple(ctx.name(s) for s in ("if_fx", "if_fn", "if_i", "if_l1"))
    for key, pad_first in (("then_branch", False), ("else_branch", True)):
        g = branches[key]
        own_names = results[key][0]
        k_other = k_else if key == "then_branch" else k_then
        pads = (
            np.full(k_other, -np.inf, np.float32),
            np.full(k_other, np.inf, np.float32),
            np.zeros(k_other * WIDTH, np.int64),
            np.zeros(k_other, np.float32),
        )
        for own, pad, elem, width in zip(own_names, pads, ELEMS, (1, 1, WIDTH, 1), strict=True):
            pad_name = ctx.name("pad")
            g.initializer.append(numpy_helper.from_array(pad, pad_name))
            joined = ctx.name("joined")
            parts = [pad_name, own] if pad_first else [own, pad_name]
            g.node.append(helper.make_node("Concat", parts, [joined], axis=0))
            g.output.append(helper.make_tensor_value_info(joined, elem, [(k_then + k_else) * width]))
    node.output.extend(outs)
    return [(outs, results["then_branch"][1] + results["else_branch"][1])]


def _wire_carried(
    node: onnx.NodeProto, scope: str, label: str, ctx: Wiring, outer: onnx.GraphProto
) -> list[tuple[tuple[str, ...], list[Slot]]]:
    """Loop/Scan: statistics become extra state, merged over iterations inside the body
    (whose rows keep their gates in the graph: each iteration is judged on its own)."""
    body = next(a.g for a in node.attribute if a.name == "body")
    ctx.loop_depth += 1
    (fx, fn, ii, l1), slots = _instrument_graph(body, f"{scope}/{label}.body", ctx)
    ctx.loop_depth -= 1
    k = len(slots)
    if k == 0:
        return []
    prev = [ctx.name(s) for s in ("prev_fx", "prev_fn", "prev_i", "prev_l1")]
    merged = [ctx.name(s) for s in ("acc_fx", "acc_fn", "acc_i", "acc_l1")]
    body.node.extend([
        helper.make_node("Max", [prev[0], fx], [merged[0]]),
        helper.make_node("Min", [prev[1], fn], [merged[1]]),
        helper.make_node("Add", [prev[2], ii], [merged[2]]),
        helper.make_node("Add", [prev[3], l1], [merged[3]]),
    ])
    elems = ELEMS
    dims = (k, k, k * WIDTH, k)
    inits = (np.full(k, -np.inf, np.float32), np.full(k, np.inf, np.float32), np.zeros(k * WIDTH, np.int64),
             np.zeros(k, np.float32))
    init_names = [ctx.name("init") for _ in inits]
    outer.initializer.extend(numpy_helper.from_array(v, nm) for v, nm in zip(inits, init_names, strict=True))
    outs = [ctx.name(s) for s in ("carried_fx", "carried_fn", "carried_i", "carried_l1")]
    if node.op_type == "Loop":
        n_state = len(node.input) - 2
        in_at, out_at, body_in_at, body_out_at = 2 + n_state, n_state, 2 + n_state, 1 + n_state
    else:
        n_scan = next(a.i for a in node.attribute if a.name == "num_scan_inputs")
        n_state = len(node.input) - n_scan
        in_at, out_at, body_in_at, body_out_at = n_state, n_state, n_state, n_state
    _insert(node.input, in_at, init_names)
    _insert(node.output, out_at, outs)
    new_in = [helper.make_tensor_value_info(nm, el, [d]) for nm, el, d in zip(prev, elems, dims, strict=True)]
    new_out = [helper.make_tensor_value_info(nm, el, [d]) for nm, el, d in zip(merged, elems, dims, strict=True)]
    _insert(body.input, body_in_at, new_in)
    _insert(body.output, body_out_at, new_out)
    return [(tuple(outs), slots)]


def _insert(repeated, at: int, items: list) -> None:  # noqa: ANN001 - protobuf repeated field
    tail = list(repeated)[at:]
    del repeated[at:]
    repeated.extend(items)
    repeated.extend(tail)
