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
`detail="all"` runs it everywhere. `detailed=` (a set of tensor names) keeps the detail
only for those tensors; any other tensor-sample that is not ordinary is flagged (FLAGGED in
its "detailed" count) so the caller can rerun the sample on a graph that details it: the
detail branches are most of a session's creation time, and few tensors ever need them.
`lean=` (detailed tensors) gives those the lean detail, computed in every sample and picked
by the ordinary test (no If at all), without the branches for NaN, zeros/subnormals and
counts above the formats' maxima; a tensor-sample that needs one of them is flagged too
(`_lean_detail`).

Cheaper routes to the same numbers: a 4-D activation that onnxruntime keeps in its NCHWc
layout is reduced through global pools (`_pooled_reductions`), a monotone map of one
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

from npuprep.graph import infer_tensors, node_label, producers
from npuprep.model_io import model_opset
from npuprep.numerics import FLOAT_ONNX_TYPES, get_format

# Element types of the FX, FN, I, L1 outputs.
_ELEMS = (TensorProto.FLOAT, TensorProto.FLOAT, TensorProto.INT64, TensorProto.FLOAT)
# Formats whose max gets an exact count of |x| above it.
OVER_FORMATS = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
HIST_OFFSET = 150  # bin = floor(log2|x|) + 150; 0 holds zeros, 278 Inf and NaN
HIST_BINS = 279
# Zeros and subnormals are binned again scaled by 2^SUBNORMAL_SHIFT, which makes every
# subnormal a normal float exactly.
SUBNORMAL_SHIFT = 64
HEADER = ("count", "detailed", "nan") + tuple(f"over_{f}" for f in OVER_FORMATS)
WIDTH = len(HEADER) + HIST_BINS
# "detailed" count of a tensor-sample that needed the detail but was built without it (< 0
# also after a Loop/Scan body sums it over iterations).
FLAGGED = -1
# Ordinary range of abs-max (see module docstring): every format's max is above HI, and
# min_normal / eps <= LO for fp16 (2^-4), fp8_e4m3 (2^-3), fp8_e5m2 (2^-12), bf16.
LO = 2.0**-3
HI = 2.0**6
# Below this abs-max no value is above any format's max (fp8_e4m3's 448).
SMALLEST_MAX = min(get_format(f).max for f in OVER_FORMATS)

# Ops whose output holds exactly the input's values, so it shares the input's statistics.
_ALIAS_OPS = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose"}
# Ops whose output holds no NaN when every float input is finite: elementwise maps that can
# only overflow to +-Inf (which max and min see), sums of finite values (once Inf, a sum stays
# Inf), data movement. Not here: Div, Pow, Sqrt, Log (0/0, domain), MatMul/Gemm/Conv (products
# that overflow to both +Inf and -Inf), normalisations (Inf / Inf), ops with a NaN attribute.
_NAN_SAFE_OPS = frozenset({
    "Abs", "Add", "AveragePool", "Cast", "Ceil", "Celu", "Clip", "Concat", "Cos", "Elu", "Erf",
    "Exp", "Expand", "Flatten", "Floor", "Gather", "GatherElements", "GatherND", "Gelu",
    "GlobalAveragePool", "GlobalMaxPool", "HardSigmoid", "HardSwish", "Identity", "LeakyRelu",
    "LogSoftmax", "Max", "MaxPool", "Min", "Mul", "Neg", "PRelu", "Reciprocal", "ReduceMax",
    "ReduceMean", "ReduceMin", "ReduceSum", "ReduceSumSquare", "Relu", "Reshape", "Round", "Selu",
    "Sigmoid", "Sign", "Sin", "Slice", "Softmax", "Softplus", "Softsign", "Split", "Squeeze",
    "Sub", "Sum", "Tanh", "Tile", "Transpose", "Unsqueeze", "Where",
})
_WIDENING = {
    TensorProto.FLOAT: {TensorProto.DOUBLE},
    TensorProto.FLOAT16: {TensorProto.FLOAT, TensorProto.DOUBLE},
    TensorProto.BFLOAT16: {TensorProto.FLOAT, TensorProto.DOUBLE},
    TensorProto.FLOAT8E4M3FN: {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16},
    TensorProto.FLOAT8E5M2: {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16},
}


@dataclass(frozen=True)
class Slot:
    """One observed tensor: its row in the FX/FN/I outputs."""

    tensor: str
    scope: str
    node: str
    # True when no gate in the graph decides whether the row is ordinary: the caller checks
    # abs-max and the L1 output and flags it (see Instrumented.ordinary).
    gated_outside: bool = False


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

    @cached_property
    def _gated_outside(self) -> np.ndarray:
        return np.array([s.gated_outside for s in self.slots], bool)

    def read(self, values: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """FX, FN, I and L1 (see the module docstring) out of the session's `outputs`."""
        fnl, ii = (np.asarray(v) for v in values)
        fx, fn, l1 = fnl.reshape(3, -1)
        return fx, fn, ii, l1

    def ordinary(self, fx: np.ndarray, fn: np.ndarray, rows: np.ndarray, l1: np.ndarray) -> np.ndarray:
        """Per row, False where a row gated outside the graph is not ordinary (the in-graph
        gate's test: finite, LO <= abs-max <= HI, or empty); True for every other row."""
        absmax = np.fmax(fx, -fn)
        fine = (rows[:, 0] == 0) | (np.isfinite(l1) & (absmax >= LO) & (absmax <= HI))
        return ~self._gated_outside | fine


@dataclass
class _Ctx:
    types: dict[str, int]
    shapes: dict[str, tuple[int, ...]]
    opset: int
    detail: str
    detailed: frozenset[str] | None = None
    nan_checked: frozenset[str] | None = None
    lean: frozenset[str] = frozenset()
    loop_depth: int = 0
    nchwc: set[str] = field(default_factory=set)
    minmax: dict[str, tuple[str, str]] = field(default_factory=dict)
    scalars: dict[str, float] = field(default_factory=dict)
    channels: set[int] = field(default_factory=set)
    # Pooled tensor -> its per-channel max and per-channel max of -x ([1, C, 1, 1] each).
    channel_extremes: dict[str, tuple[str, str]] = field(default_factory=dict)
    known_finite: set[str] = field(default_factory=set)
    # Known constants whose values are all finite and >= 0.
    known_nonneg: set[str] = field(default_factory=set)
    trusting: dict[str, tuple[str, ...]] = field(default_factory=dict)
    counter: int = 0
    sizes: set[int] = field(default_factory=set)
    ones: set[int] = field(default_factory=set)
    aliases: dict[str, Slot] = field(default_factory=dict)
    alias_of: dict[str, str] = field(default_factory=dict)
    unobserved: dict[str, str] = field(default_factory=dict)

    def name(self, stem: str) -> str:
        self.counter += 1
        return f"__npuprep_{stem}_{self.counter}"


def instrument(
    model: onnx.ModelProto,
    *,
    detail: str = "auto",
    detailed: Collection[str] | None = None,
    nan_checked: Collection[str] | None = None,
    lean: Collection[str] = (),
) -> Instrumented:
    """A copy of `model` whose extra outputs carry per-tensor statistics of one sample.

    `detailed`: with detail "auto", the tensors that get the detail branch (default: all);
    `nan_checked`: the tensors that keep the L1 pass where it could be skipped (default: all);
    `lean`: of the detailed main-graph tensors, those that get the lean detail in every sample
    (see `_lean_detail`). The rows (slots) are the same whatever they hold.
    """
    if detail not in ("auto", "all"):
        raise ValueError(f"detail must be 'auto' or 'all', got {detail!r}")
    info = infer_tensors(model)
    ctx = _Ctx(types=info.types, shapes=info.shapes, opset=model_opset(model), detail=detail,
               detailed=None if detailed is None else frozenset(detailed),
               nan_checked=None if nan_checked is None or detail == "all" else frozenset(nan_checked),
               lean=frozenset(lean) if detail == "auto" and detailed is not None else frozenset())
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    graph.initializer.extend(shared_constants())
    names, slots = _instrument_graph(graph, "main", ctx)
    for size in sorted(ctx.sizes):
        row = np.zeros(WIDTH, np.int64)
        row[0] = size
        graph.initializer.extend([numpy_helper.from_array(np.array([size], np.int64), f"{_CONST_SIZE}{size}"),
                                  numpy_helper.from_array(row, f"{_CONST_ROW}{size}")])
    graph.initializer.extend(
        numpy_helper.from_array(np.full((1, c, 1, 1), -1, np.float32), f"{_CONST_NEG_CHANNELS}{c}") for c in sorted(ctx.channels)
    )
    graph.initializer.extend(numpy_helper.from_array(np.ones(c, np.float32), f"{_CONST_ONES}{c}") for c in sorted(ctx.ones))
    for name, elem, width in zip(names, (TensorProto.FLOAT, TensorProto.INT64), (3, WIDTH), strict=True):
        graph.output.append(helper.make_tensor_value_info(name, elem, [len(slots) * width]))
    row_of = {slot.tensor: i for i, slot in enumerate(slots) if slot.scope == "main"}
    nan_inputs = {row_of[t]: tuple(row_of[ctx.alias_of.get(i, i)] for i in inputs) for t, inputs in ctx.trusting.items()}
    return Instrumented(out, tuple(names), tuple(slots), ctx.aliases, ctx.alias_of, ctx.unobserved, nan_inputs)


def _instrument_graph(graph: onnx.GraphProto, scope: str, ctx: _Ctx) -> tuple[tuple[str, ...], list[Slot]]:
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
        if elem not in FLOAT_ONNX_TYPES:
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
        slots.append(Slot(tensor, scope, node_name, outside))

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
                node.op_type == "Conv" or (node.op_type in _NCHWC_FOLLOWERS and node.input and node.input[0] in ctx.nchwc)):
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
        joined_elems = _ELEMS
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
        values = numpy_helper.to_array(tensor).astype(np.float64)
        if np.isfinite(values).all():
            finite.add(name)
            if (values >= 0).all():
                nonneg.add(name)
            if values.size == 1 and tensor.data_type == TensorProto.FLOAT:
                scalars[name] = float(values.reshape(()))
    return finite, scalars, nonneg


def _derived_stats(
    tensor: str, node: onnx.NodeProto | None, ctx: _Ctx
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
    return nodes, (mx, mn, _ordinary_row(tensor, "", ctx)[1], _CONST_ZERO_F)


def _batchnorm_stats(
    tensor: str, node: onnx.NodeProto, ctx: _Ctx
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
        helper.make_node("Mul", [cneg, f"{_CONST_NEG_CHANNELS}{channels}"], [cmin]),
        helper.make_node("BatchNormalization", [cmax, *params], [at_max]),
        helper.make_node("BatchNormalization", [cmin, *params], [at_min]),
        helper.make_node("Max", [at_max, at_min], [hi_c]),
        helper.make_node("Min", [at_max, at_min], [lo_c]),
        helper.make_node("Reshape", [hi_c, _CONST_FLAT], [hi_v]),
        helper.make_node("Reshape", [lo_c, _CONST_FLAT], [lo_v]),
        helper.make_node("ReduceMax", [hi_v], [mx], keepdims=1),
        helper.make_node("ReduceMin", [lo_v], [mn], keepdims=1),
    ]
    nodes[1].attribute.extend(node.attribute)
    nodes[2].attribute.extend(node.attribute)
    return nodes, (mx, mn, _ordinary_row(tensor, "", ctx)[1], _CONST_ZERO_F)


def _trusted_inputs(
    node: onnx.NodeProto | None, tensor: str, scope: str, observed: set[str], ctx: _Ctx
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


def _nan_safe_batchnorm(node: onnx.NodeProto, ctx: _Ctx) -> bool:
    """Inference BatchNormalization with finite constant parameters and a variance >= 0: an
    affine map per channel, so finite inputs give no NaN (sqrt(var + eps) is real)."""
    return (node.op_type == "BatchNormalization" and len(node.input) == 5
            and all(p in ctx.known_finite for p in node.input[1:]) and node.input[4] in ctx.known_nonneg
            and not any(a.name == "training_mode" and a.i for a in node.attribute))


def _alias_source(node: onnx.NodeProto | None, ctx: _Ctx) -> str | None:
    """The tensor whose values a node's output repeats exactly, if any."""
    if node is None or not node.input:
        return None
    if node.op_type in _ALIAS_OPS or (node.op_type == "Dropout" and len(node.input) < 3):
        return node.input[0]
    if node.op_type == "Cast":
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if to in _WIDENING.get(ctx.types.get(node.input[0], -1), set()):
            return node.input[0]
    return None


def _ordinary_row(tensor: str, size: str, ctx: _Ctx) -> tuple[list[onnx.NodeProto], str]:
    """The I row of an ordinary tensor-sample (its count, nothing else): a shared constant
    per static element count, else [count, 0...] built from `size`."""
    if tensor in ctx.shapes:
        count = math.prod(ctx.shapes[tensor])
        ctx.sizes.add(count)
        return [], f"{_CONST_ROW}{count}"
    row = ctx.name("row")
    return [helper.make_node("Concat", [size, _CONST_ZEROS_TAIL], [row], axis=0)], row


def _tensor_stats(
    tensor: str, elem: int, ctx: _Ctx, *, l1: bool, gate: bool
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
    pooled = _pooled_channels(tensor, elem, ctx)
    if not pooled or gate:
        nodes.append(helper.make_node("Reshape", [src, _CONST_FLAT], [flat]))
    count: int | None = None
    if tensor in ctx.shapes:
        # A static element count is a shared constant, not two nodes per tensor.
        count = math.prod(ctx.shapes[tensor])
        ctx.sizes.add(count)
        size = f"{_CONST_SIZE}{count}"
    else:
        size = n("size")
        nodes.append(helper.make_node("Size", [tensor], [n("size0")]))
        nodes.append(helper.make_node("Reshape", [nodes[-1].output[0], _CONST_ONE_DIM], [size]))
    mx, mn, sm = n("max"), n("min"), n("sum")
    if pooled:
        nodes += _pooled_reductions(src, pooled, (mx, mn, sm if l1 else ""), ctx)
    else:
        nodes += [
            helper.make_node("ReduceMax", [flat], [mx], keepdims=1),
            helper.make_node("ReduceMin", [flat], [mn], keepdims=1),
        ]
        if l1:
            # NaN-propagating (onnxruntime's ReduceMax/Min are not): flags NaN and Inf.
            nodes.append(helper.make_node("ReduceL1", [flat], [sm], keepdims=1))
    l1_out = sm if l1 else _CONST_ZERO_F
    if not gate:
        row_nodes, row = _ordinary_row(tensor, size, ctx)
        return nodes + row_nodes, (mx, mn, row, l1_out)
    if ctx.detail == "all":
        detail_nodes, outs = _detail(flat, size, ctx, (mx, mn, sm), count)
        return nodes + detail_nodes, (*outs, l1_out)
    # score = abs-max, or NaN when L1 is not finite (a NaN or Inf somewhere); ordinary when
    # Clip leaves it as it is (NaN never equals).
    neg, am, z, score, clipped, ok = (n(s) for s in ("neg", "am", "z", "score", "clipped", "ok"))
    nodes += [
        helper.make_node("Neg", [mn], [neg]),
        helper.make_node("Max", [mx, neg], [am if l1 else score]),
    ]
    if l1:
        nodes += [helper.make_node("Mul", [sm, _CONST_ZERO_F], [z]), helper.make_node("Add", [am, z], [score])]
    nodes += [
        helper.make_node("Clip", [score, _CONST_LO, _CONST_HI], [clipped]),
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
            helper.make_node("Mul", [badi, _CONST_FLAG_ROW], [mark]),
            helper.make_node("Add", [row, mark], [ii]),
        ]
        return nodes, (mx, mn, ii, l1_out)
    if ctx.loop_depth == 0 and tensor in ctx.lean:
        # Computed whether or not this sample needs it, the row picked by the test the If
        # would make: the same statistics, and no branch to build or to run.
        lean_nodes, lean_row = _lean_detail(flat, size, ctx, (mx, mn, sm), count)
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
    detail_nodes, (dfx, dfn, dii) = _detail(flat, size, ctx, (mx, mn, sm), count)
    else_branch = helper.make_graph(
        detail_nodes, n("detail"), [],
        [
            helper.make_tensor_value_info(dfx, TensorProto.FLOAT, [1]),
            helper.make_tensor_value_info(dfn, TensorProto.FLOAT, [1]),
            helper.make_tensor_value_info(dii, TensorProto.INT64, [WIDTH]),
        ],
    )
    nodes.append(helper.make_node("If", [ok], [fx, fn, ii], then_branch=then_branch, else_branch=else_branch))
    return nodes, (fx, fn, ii, l1_out)


# Ops that keep a tensor in onnxruntime's blocked NCHWc layout when their first input is in it.
_NCHWC_FOLLOWERS = frozenset({
    "Add", "AveragePool", "BatchNormalization", "Clip", "Concat", "GlobalAveragePool",
    "GlobalMaxPool", "HardSigmoid", "HardSwish", "LeakyRelu", "MaxPool", "Relu", "Sigmoid", "Sum", "Tanh",
})


def _pooled_channels(tensor: str, elem: int, ctx: _Ctx) -> int:
    """Channel count when `tensor` is a static 4-D float32 activation that onnxruntime keeps in
    its NCHWc layout (a Conv output, or what follows one elementwise); else 0."""
    shape = ctx.shapes.get(tensor, ())
    if tensor not in ctx.nchwc or elem != TensorProto.FLOAT or len(shape) != 4 or 0 in shape:
        return 0
    return shape[1]


def _pooled_reductions(src: str, channels: int, outs: tuple[str, str, str], ctx: _Ctx) -> list[onnx.NodeProto]:
    """Max, min and the NaN flag of a 4-D NCHWc activation from global pools, which run on the
    blocked layout: ReduceMax and friends would first copy it back to NCHW. min = -max(-x),
    negated by a per-channel Mul that stays blocked (exact); the flag is a sum of channel
    means (NaN and Inf propagate). `outs` = (max, min, flag or ""). The per-channel pools are
    kept in ctx.channel_extremes for what follows (see _batchnorm_stats)."""
    n = ctx.name
    mx, mn, flag = outs
    ctx.channels.add(channels)
    nodes: list[onnx.NodeProto] = []

    def pool_then_reduce(op: str, source: str, out: str, reduce: str = "ReduceMax") -> str:
        per_channel, vec = n("pooled"), n("pooled_vec")
        nodes.extend([
            helper.make_node(op, [source], [per_channel]),
            helper.make_node("Reshape", [per_channel, _CONST_FLAT], [vec]),
            helper.make_node(reduce, [vec], [out], keepdims=1),
        ])
        return per_channel

    negated, negmax = n("negated"), n("negmax")
    channel_max = pool_then_reduce("GlobalMaxPool", src, mx)
    nodes.append(helper.make_node("Mul", [src, f"{_CONST_NEG_CHANNELS}{channels}"], [negated]))
    channel_neg = pool_then_reduce("GlobalMaxPool", negated, negmax)
    nodes.append(helper.make_node("Neg", [negmax], [mn]))
    ctx.channel_extremes[src] = (channel_max, channel_neg)
    if flag:
        pool_then_reduce("GlobalAveragePool", src, flag, reduce="ReduceL1")
    return nodes


def _detail(
    flat: str, size: str, ctx: _Ctx, cheap: tuple[str, str, str], count: int | None
) -> tuple[list[onnx.NodeProto], tuple[str, str, str]]:
    """Exact NaN-aware min/max, NaN count, counts above each format's max, exponent histogram.

    `cheap` = (max, min, L1) of the tensor: a finite L1 skips the NaN work (no NaN, no Inf:
    the plain min and max are exact). `count`: the static element count, if known.
    """
    # Counts summed in float32 are exact below 2^24 elements; beyond, or unknown, in int64.
    small = count is not None and count < 2**24
    n = ctx.name
    nodes: list[onnx.NodeProto] = []
    mx, mn, sm = cheap
    # Finite L1: the plain min/max stand and there is no NaN; else NaN-aware reductions and
    # NaN turned into Inf, so it lands in the top bin (the NaN count tells them apart). |x|
    # is computed inside each branch: onnxruntime writes a branch's result straight into the
    # If's output, where an outer |x| would be copied (0.6 ns per value).
    finite = n("finite")
    z, chk = n("z"), n("chk")
    nodes += [
        helper.make_node("Mul", [sm, _CONST_ZERO_F], [z]),
        helper.make_node("Equal", [z, _CONST_ZERO_F], [chk]),
        helper.make_node("Squeeze", [chk], [finite]),
    ]
    fx, fn, nan_c, ac = n("dmax"), n("dmin"), n("nan_c"), n("abs_clean")
    f_fx, f_fn, f_nan, f_ac = n("f_fx"), n("f_fn"), n("f_nan"), n("f_ac")
    finite_branch = helper.make_graph(
        [
            helper.make_node("Identity", [mx], [f_fx]),
            helper.make_node("Identity", [mn], [f_fn]),
            helper.make_node("Identity", [_CONST_ZERO_I64_1], [f_nan]),
            helper.make_node("Abs", [flat], [f_ac]),
        ],
        n("finite_branch"), [],
        [
            helper.make_tensor_value_info(f_fx, TensorProto.FLOAT, [1]),
            helper.make_tensor_value_info(f_fn, TensorProto.FLOAT, [1]),
            helper.make_tensor_value_info(f_nan, TensorProto.INT64, [1]),
            helper.make_tensor_value_info(f_ac, TensorProto.FLOAT, None),
        ],
    )
    nf_fx, nf_fn, nf_nan, nf_isn, nan_nodes = _nan_aware(flat, ctx)
    nf_abs, nf_ac = n("nf_abs"), n("nf_ac")
    nan_nodes += [
        helper.make_node("Abs", [flat], [nf_abs]),
        helper.make_node("Where", [nf_isn, _CONST_POS_INF, nf_abs], [nf_ac]),
    ]
    nonfinite_branch = helper.make_graph(
        nan_nodes, n("nonfinite_branch"), [],
        [
            helper.make_tensor_value_info(nf_fx, TensorProto.FLOAT, [1]),
            helper.make_tensor_value_info(nf_fn, TensorProto.FLOAT, [1]),
            helper.make_tensor_value_info(nf_nan, TensorProto.INT64, [1]),
            helper.make_tensor_value_info(nf_ac, TensorProto.FLOAT, None),
        ],
    )
    nodes.append(helper.make_node(
        "If", [finite], [fx, fn, nan_c, ac], then_branch=finite_branch, else_branch=nonfinite_branch,
    ))
    neg, top = n("neg"), n("absmax")
    nodes += [helper.make_node("Neg", [fn], [neg]), helper.make_node("Max", [fx, neg], [top])]
    counts = [size, size, nan_c]
    # Counts above the formats' maxima are 0 unless abs-max passes the smallest of them. Each
    # NaN is an Inf in |x| here, above every max: the NaN count comes off.
    big, bigs = n("big"), n("bigs")
    over_names = [n("over") for _ in OVER_FORMATS]
    over_nodes = []
    for fmt, out in zip(OVER_FORMATS, over_names, strict=True):
        gt = n("gt")
        over_nodes.append(helper.make_node("Greater", [ac, _over_const(fmt)], [gt]))
        count_nodes, counted = _count_true(gt, small, ctx)
        over_nodes += count_nodes + [helper.make_node("Identity", [counted], [out])]
    over_vec, with_nan, some, none = n("over_vec"), n("with_nan"), n("some"), n("none")
    over_nodes += [
        helper.make_node("Concat", over_names, [with_nan], axis=0),
        helper.make_node("Sub", [with_nan, nan_c], [some]),
    ]
    nodes += [
        helper.make_node("Greater", [top, _CONST_SMALLEST_MAX], [big]),
        helper.make_node("Squeeze", [big], [bigs]),
        helper.make_node(
            "If", [bigs], [over_vec],
            then_branch=helper.make_graph(over_nodes, n("over_branch"), [], [helper.make_tensor_value_info(some, TensorProto.INT64, [len(OVER_FORMATS)])]),
            else_branch=helper.make_graph(
                [helper.make_node("Identity", [_CONST_ZERO_OVER], [none])], n("no_over_branch"), [],
                [helper.make_tensor_value_info(none, TensorProto.INT64, [len(OVER_FORMATS)])],
            ),
        ),
    ]
    counts.append(over_vec)
    # The 1 that the histogram adds per value comes from the data (max is never NaN here):
    # from a constant, onnxruntime would fold it into an int64 tensor per observed tensor.
    # A scalar, so that Expand also gives [0] for an empty tensor.
    max_nan, real, one_1, one = n("max_nan"), n("real"), n("one_1"), n("one")
    nodes += [
        helper.make_node("IsNaN", [fx], [max_nan]),
        helper.make_node("Not", [max_nan], [real]),
        helper.make_node("Cast", [real], [one_1], to=TensorProto.FLOAT if small else TensorProto.INT64),
        helper.make_node("Squeeze", [one_1], [one]),
    ]
    # Fast bins first: exact for every value except zeros and subnormals, which share bin -127.
    fast_nodes, fast_idx = _bin_index(ac, ctx)
    count_nodes, fast_hist = _count_bins(fast_idx, _ones(count, ctx) or one, small, ctx)
    nodes += fast_nodes + count_nodes
    lumped, has, has_s = n("lumped"), n("has"), n("has_s")
    nodes += [
        helper.make_node("Slice", [fast_hist, _CONST_LUMP_AT, _CONST_LUMP_END], [lumped]),
        helper.make_node("Greater", [lumped, _CONST_ZERO_I64_1], [has]),
        helper.make_node("Squeeze", [has], [has_s]),
    ]
    # Zeros or subnormals in the shared bin: pick out those values (few, as a rule), scale
    # them by 2^64 (exact; subnormals become normal) and bin them again, zeros to bin 0.
    subnormal, tiny, scaled, down, lump_idx = (n(s) for s in ("subnormal", "tiny", "scaled", "down", "lump_idx"))
    small_bins, scaled_idx = _bin_index(scaled, ctx)
    small_count, small_hist = _count_bins(lump_idx, one, small, ctx)
    taken, kept, lump_hist, hist = n("taken"), n("kept"), n("lump_hist"), n("hist")
    lump_nodes = [
        helper.make_node("Less", [ac, _CONST_MIN_NORMAL], [subnormal]),
        helper.make_node("Compress", [ac, subnormal], [tiny], axis=0),
        helper.make_node("Mul", [tiny, _CONST_SUBNORMAL_SCALE], [scaled]),
        *small_bins,
        helper.make_node("Sub", [scaled_idx, _CONST_SUBNORMAL_SHIFT], [down]),
        helper.make_node("Max", [down, _CONST_ZERO_I32], [lump_idx]),
        *small_count,
        helper.make_node("Mul", [lumped, _CONST_LUMP_ONEHOT], [taken]),
        helper.make_node("Sub", [fast_hist, taken], [kept]),
        helper.make_node("Add", [kept, small_hist], [lump_hist]),
    ]
    as_is = n("as_is")
    nodes.append(helper.make_node(
        "If", [has_s], [hist],
        then_branch=helper.make_graph(lump_nodes, n("lump_branch"), [],
                                      [helper.make_tensor_value_info(lump_hist, TensorProto.INT64, [HIST_BINS])]),
        else_branch=helper.make_graph([helper.make_node("Identity", [fast_hist], [as_is])], n("no_lump_branch"), [],
                                      [helper.make_tensor_value_info(as_is, TensorProto.INT64, [HIST_BINS])]),
    ))
    ii = n("detail_i")
    nodes.append(helper.make_node("Concat", counts + [hist], [ii], axis=0))
    return nodes, (fx, fn, ii)


def _lean_detail(
    flat: str, size: str, ctx: _Ctx, cheap: tuple[str, str, str], count: int | None
) -> tuple[list[onnx.NodeProto], str]:
    """The detail without If branches: the I row of a finite tensor-sample with no |x| above
    any format's max and no zero or subnormal, and FLAGGED otherwise (the caller reruns the
    sample with the full `_detail`, which handles them in If branches).

    Every If branch costs onnxruntime session-creation time in each optimiser pass, more the
    larger the model (~1.5 ms per branch on the benchmark transformer), and running one costs
    a subgraph frame per sample; most detailed tensors (softmax outputs, small scores,
    means) are outside the ordinary range in every sample and never need the full detail's
    branches, so the caller computes this for every sample and picks the row with Where.
    """
    n = ctx.name
    mx, mn, sm = cheap
    small = count is not None and count < 2**24
    ac = n("abs")
    nodes = [helper.make_node("Abs", [flat], [ac])]
    bin_nodes, idx = _bin_index(ac, ctx, nan_safe=True)
    nodes += bin_nodes
    one = _ones(count, ctx)
    if one is None:
        # Any 1 from the data (see _detail); wrong only in a sample that is flagged anyway.
        real, one_1, one = n("real"), n("one_1"), n("one")
        nodes += [
            helper.make_node("Equal", [mx, mx], [real]),
            helper.make_node("Cast", [real], [one_1], to=TensorProto.FLOAT if small else TensorProto.INT64),
            helper.make_node("Squeeze", [one_1], [one]),
        ]
    count_nodes, hist = _count_bins(idx, one, small, ctx)
    nodes += count_nodes
    lumped, has, neg, top, big, z, sane, nonfinite, odd, flag, ii, row = (n(s) for s in (
        "lumped", "has", "neg", "absmax", "big", "z", "sane", "nonfinite", "odd", "flag", "lean_i", "lean_row"))
    nodes += [
        helper.make_node("Slice", [hist, _CONST_LUMP_AT, _CONST_LUMP_END], [lumped]),
        helper.make_node("Greater", [lumped, _CONST_ZERO_I64_1], [has]),
        helper.make_node("Neg", [mn], [neg]),
        helper.make_node("Max", [mx, neg], [top]),
        helper.make_node("Greater", [top, _CONST_SMALLEST_MAX], [big]),
        # L1 x 0 is 0 exactly when L1 is finite (no NaN, no Inf in the tensor).
        helper.make_node("Mul", [sm, _CONST_ZERO_F], [z]),
        helper.make_node("Equal", [z, _CONST_ZERO_F], [sane]),
        helper.make_node("Not", [sane], [nonfinite]),
        helper.make_node("Or", [has, big], [odd]),
        helper.make_node("Or", [odd, nonfinite], [flag]),
        helper.make_node("Concat", [size, size, _CONST_ZERO_I64_1, _CONST_ZERO_OVER, hist], [ii], axis=0),
        helper.make_node("Where", [flag, _CONST_FLAG_ROW, ii], [row]),
    ]
    return nodes, row


def _nan_aware(flat: str, ctx: _Ctx) -> tuple[str, str, str, str, list[onnx.NodeProto]]:
    """Max and min ignoring NaN (onnxruntime's reductions are unreliable with NaN), NaN count."""
    n = ctx.name
    isn, fxw, fnw, fx, fn, nan_i, nan_c = (n(s) for s in ("isnan", "nz_hi", "nz_lo", "dmax", "dmin", "nan_i", "nan_c"))
    nodes = [
        helper.make_node("IsNaN", [flat], [isn]),
        helper.make_node("Where", [isn, _CONST_NEG_INF, flat], [fxw]),
        helper.make_node("Where", [isn, _CONST_POS_INF, flat], [fnw]),
        helper.make_node("ReduceMax", [fxw], [fx], keepdims=1),
        helper.make_node("ReduceMin", [fnw], [fn], keepdims=1),
        helper.make_node("Cast", [isn], [nan_i], to=TensorProto.INT64),
        helper.make_node("ReduceSum", [nan_i], [nan_c], keepdims=1),
    ]
    return fx, fn, nan_c, isn, nodes


def _bin_index(ac: str, ctx: _Ctx, nan_safe: bool = False) -> tuple[list[onnx.NodeProto], str]:
    """Histogram bin floor(log2|x|) + 150 of every value of `ac` (|x|, NaN already made Inf).

    Log gives the bin to well within 1/16 of a binade; biased down by 1/16 and truncated, the
    estimate is the bin or the one below, and one comparison with the exact power of two that
    starts the next bin (a table lookup) settles it. Exact from 2^-126 up; zeros and
    subnormals all land in bin -127 whatever Log does with subnormals. `nan_safe`: a NaN in
    `ac` gives some bin instead of an index out of the lookup's range (a run that fails).
    """
    n = ctx.name
    lg, y, shifted, clipped, guess, start, ge, gei, idx = (n(s) for s in (
        "log", "log2", "shifted", "clipped", "guess", "start", "ge", "gei", "idx"))
    return [
        helper.make_node("Log", [ac], [lg]),
        helper.make_node("Mul", [lg, _CONST_INV_LN2], [y]),
        helper.make_node("Add", [y, _CONST_BIN_SHIFT], [shifted]),
        helper.make_node("Clip", [shifted, _CONST_LUMP_BIN, _CONST_TOP_BIN], [clipped]),
        # Truncation is floor here: the value is at least the lumped bin's index. int32
        # indices: ~20% faster through the lookup and the counting than int64.
        *_cast_bin(clipped, guess, nan_safe, ctx),
        helper.make_node("GatherElements", [_CONST_NEXT_BIN_START, guess], [start]),  # 3x faster than Gather
        helper.make_node("GreaterOrEqual", [ac, start], [ge]),
        helper.make_node("Cast", [ge], [gei], to=TensorProto.INT32),
        helper.make_node("Add", [guess, gei], [idx]),
    ], idx


def _cast_bin(clipped: str, guess: str, nan_safe: bool, ctx: _Ctx) -> list[onnx.NodeProto]:
    """int32 bin from the clipped estimate; NaN, which Clip may pass, clipped again as an int."""
    if not nan_safe:
        return [helper.make_node("Cast", [clipped], [guess], to=TensorProto.INT32)]
    raw = ctx.name("raw_guess")
    return [
        helper.make_node("Cast", [clipped], [raw], to=TensorProto.INT32),
        helper.make_node("Clip", [raw, _CONST_ZERO_I32_S, _CONST_TOP_BIN_I32], [guess]),
    ]


def _count_true(mask: str, small: bool, ctx: _Ctx) -> tuple[list[onnx.NodeProto], str]:
    """int64 [1] count of True in a bool tensor; summed in float32 (5x faster) when exact."""
    n = ctx.name
    cast, total, out = n("mask"), n("total"), n("count")
    if not small:
        return [
            helper.make_node("Cast", [mask], [cast], to=TensorProto.INT64),
            helper.make_node("ReduceSum", [cast], [out], keepdims=1),
        ], out
    return [
        helper.make_node("Cast", [mask], [cast], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", [cast], [total], keepdims=1),
        helper.make_node("Cast", [total], [out], to=TensorProto.INT64),
    ], out


# Detailed tensors up to this many elements count their bins with a shared constant of ones
# per size (4 MiB at most) instead of expanding a 1 to their shape each run.
_SHARED_ONES = 1 << 20


def _ones(count: int | None, ctx: _Ctx) -> str | None:
    """A shared float32 constant of `count` ones where that is worth holding, else None."""
    if count is None or count > _SHARED_ONES or ctx.opset < 16:
        return None
    ctx.ones.add(count)
    return f"{_CONST_ONES}{count}"


def _count_bins(idx: str, one: str, small: bool, ctx: _Ctx) -> tuple[list[onnx.NodeProto], str]:
    """Counts per bin [HIST_BINS] int64 of an int32 bin index. `one`: a scalar 1, or ones shaped
    like `idx` (see _ones); float32 when `small` (counts below 2^24 are exact in float32, and
    summed ~20% faster)."""
    n = ctx.name
    hist = n("hist")
    if ctx.opset >= 16:
        if one.startswith(_CONST_ONES):
            nodes, ones = [], one
        else:
            shape, ones = n("shape"), n("ones")
            nodes = [helper.make_node("Shape", [idx], [shape]), helper.make_node("Expand", [one, shape], [ones])]
        if not small:
            return nodes + [helper.make_node("ScatterElements", [_CONST_HIST_ZEROS, idx, ones], [hist], reduction="add")], hist
        counted = n("counted")
        return nodes + [
            helper.make_node("ScatterElements", [_CONST_HIST_ZEROS_F, idx, ones], [counted], reduction="add"),
            helper.make_node("Cast", [counted], [hist], to=TensorProto.INT64),
        ], hist
    # No ScatterElements reduction before opset 16: TfIdfVectorizer counts 1-grams.
    tf = n("tf")
    return [
        helper.make_node(
            "TfIdfVectorizer", [idx], [tf], mode="TF", min_gram_length=1, max_gram_length=1,
            max_skip_count=0, ngram_counts=[0], ngram_indexes=list(range(HIST_BINS)),
            pool_int64s=list(range(HIST_BINS)),
        ),
        helper.make_node("Cast", [tf], [hist], to=TensorProto.INT64),
    ], hist


# Shared constants, added once per model as initialisers of the main graph (visible in bodies).
_CONST_FLAT = "__npuprep_c_flat"
_CONST_SIZE = "__npuprep_c_size_"
_CONST_ROW = "__npuprep_c_row_"
_CONST_NEG_CHANNELS = "__npuprep_c_neg_channels_"
_CONST_ONES = "__npuprep_c_ones_"
_CONST_ONE_DIM = "__npuprep_c_one_dim"
_CONST_ZERO_F = "__npuprep_c_zero_f"
_CONST_LO = "__npuprep_c_lo"
_CONST_HI = "__npuprep_c_hi"
_CONST_ZEROS_TAIL = "__npuprep_c_zeros_tail"
_CONST_NEG_INF = "__npuprep_c_neg_inf"
_CONST_POS_INF = "__npuprep_c_pos_inf"
_CONST_INV_LN2 = "__npuprep_c_inv_ln2"
_CONST_HIST_ZEROS = "__npuprep_c_hist_zeros"
_CONST_ZERO_I64_1 = "__npuprep_c_zero_i64"
_CONST_ZERO_I32 = "__npuprep_c_zero_i32"
_CONST_HIST_ZEROS_F = "__npuprep_c_hist_zeros_f"
_CONST_BIN_SHIFT = "__npuprep_c_bin_shift"
_CONST_LUMP_BIN = "__npuprep_c_lump_bin"
_CONST_TOP_BIN = "__npuprep_c_top_bin"
_CONST_NEXT_BIN_START = "__npuprep_c_next_bin_start"
_CONST_LUMP_AT = "__npuprep_c_lump_at"
_CONST_LUMP_END = "__npuprep_c_lump_end"
_CONST_LUMP_ONEHOT = "__npuprep_c_lump_onehot"
_CONST_MIN_NORMAL = "__npuprep_c_min_normal"
_CONST_SUBNORMAL_SCALE = "__npuprep_c_subnormal_scale"
_CONST_SUBNORMAL_SHIFT = "__npuprep_c_subnormal_shift"
_CONST_SMALLEST_MAX = "__npuprep_c_smallest_max"
_CONST_ZERO_OVER = "__npuprep_c_zero_over"
_CONST_FLAG_ROW = "__npuprep_c_flag_row"
_CONST_ZERO_I32_S = "__npuprep_c_zero_i32_s"
_CONST_TOP_BIN_I32 = "__npuprep_c_top_bin_i32"


def _next_bin_start() -> np.ndarray:
    """Entry i: 2^(i + 1 - 150), where bin i + 1 starts (Inf past float32's range; NaN for
    the top bin, which nothing passes)."""
    with np.errstate(over="ignore"):
        starts = np.ldexp(np.float32(1), np.arange(HIST_BINS) + 1 - HIST_OFFSET).astype(np.float32)
    starts[-1] = np.nan
    return starts


def _over_const(fmt: str) -> str:
    return f"__npuprep_c_max_{fmt}"


def shared_constants() -> list[onnx.TensorProto]:
    values = {
        _CONST_FLAT: np.array([-1], np.int64),
        _CONST_ONE_DIM: np.array([1], np.int64),
        _CONST_ZERO_F: np.array([0.0], np.float32),
        _CONST_LO: np.array(LO, np.float32),
        _CONST_HI: np.array(HI, np.float32),
        _CONST_ZEROS_TAIL: np.zeros(WIDTH - 1, np.int64),
        _CONST_NEG_INF: np.array(-np.inf, np.float32),
        _CONST_POS_INF: np.array(np.inf, np.float32),
        _CONST_INV_LN2: np.array(1.0 / math.log(2.0), np.float32),
        _CONST_HIST_ZEROS: np.zeros(HIST_BINS, np.int64),
        _CONST_ZERO_I64_1: np.zeros(1, np.int64),
        _CONST_ZERO_I32: np.zeros(1, np.int32),
        _CONST_HIST_ZEROS_F: np.zeros(HIST_BINS, np.float32),
        _CONST_BIN_SHIFT: np.array(HIST_OFFSET - 1 / 16, np.float32),
        _CONST_LUMP_BIN: np.array(HIST_OFFSET - 127, np.float32),
        _CONST_TOP_BIN: np.array(HIST_BINS - 1, np.float32),
        _CONST_NEXT_BIN_START: _next_bin_start(),
        _CONST_LUMP_AT: np.array([HIST_OFFSET - 127], np.int64),
        _CONST_LUMP_END: np.array([HIST_OFFSET - 126], np.int64),
        _CONST_LUMP_ONEHOT: np.eye(1, HIST_BINS, HIST_OFFSET - 127, np.int64)[0],
        _CONST_MIN_NORMAL: np.array(np.finfo(np.float32).tiny, np.float32),
        _CONST_SUBNORMAL_SCALE: np.array(2.0**SUBNORMAL_SHIFT, np.float32),
        _CONST_SUBNORMAL_SHIFT: np.array(SUBNORMAL_SHIFT, np.int32),
        _CONST_SMALLEST_MAX: np.array([SMALLEST_MAX], np.float32),
        _CONST_ZERO_OVER: np.zeros(len(OVER_FORMATS), np.int64),
        _CONST_FLAG_ROW: FLAGGED * np.eye(1, WIDTH, HEADER.index("detailed"), np.int64)[0],
        _CONST_ZERO_I32_S: np.array(0, np.int32),
        _CONST_TOP_BIN_I32: np.array(HIST_BINS - 1, np.int32),
    }
    for fmt in OVER_FORMATS:
        values[_over_const(fmt)] = np.array(get_format(fmt).max, np.float32)
    return [numpy_helper.from_array(v, k) for k, v in values.items()]


def _instrument_subgraphs(
    node: onnx.NodeProto, scope: str, ctx: _Ctx, outer: onnx.GraphProto
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


def _wire_if(node: onnx.NodeProto, scope: str, label: str, ctx: _Ctx) -> list[tuple[tuple[str, ...], list[Slot]]]:
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
        for own, pad, elem, width in zip(own_names, pads, _ELEMS, (1, 1, WIDTH, 1), strict=True):
            pad_name = ctx.name("pad")
            g.initializer.append(numpy_helper.from_array(pad, pad_name))
            joined = ctx.name("joined")
            parts = [pad_name, own] if pad_first else [own, pad_name]
            g.node.append(helper.make_node("Concat", parts, [joined], axis=0))
            g.output.append(helper.make_tensor_value_info(joined, elem, [(k_then + k_else) * width]))
    node.output.extend(outs)
    return [(outs, results["then_branch"][1] + results["else_branch"][1])]


def _wire_carried(
    node: onnx.NodeProto, scope: str, label: str, ctx: _Ctx, outer: onnx.GraphProto
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
    elems = _ELEMS
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
