"""x -> counts above each format's max + exponent histogram (bin = floor(log2|x|) + 150), in the graph.

The detail of one tensor-sample (npuprep.calibrate.layout's row after max and min): the exact
branch (`detail_nodes`, NaN, zeros, subnormals and counts above every format's max) and the
lean one (`lean_detail_nodes`), the global-pool route for NCHWc activations
(`pooled_reductions`), and the constants every instrumented graph shares (`shared_constants`).
npuprep.calibrate.instrument decides which tensor gets which.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.calibrate.layout import (
    FLAGGED,
    HEADER,
    HIST_BINS,
    HIST_OFFSET,
    OVER_FORMATS,
    SCOPES,
    SUBNORMAL_SHIFT,
    WIDTH,
    Scope,
    Wiring,
)
from npuprep.numerics import get_format

# Ops that keep a tensor in onnxruntime's blocked NCHWc layout when their first input is in it.
NCHWC_FOLLOWERS = frozenset({
    "Add", "AveragePool", "BatchNormalization", "Clip", "Concat", "GlobalAveragePool",
    "GlobalMaxPool", "HardSigmoid", "HardSwish", "LeakyRelu", "MaxPool", "Relu", "Sigmoid", "Sum", "Tanh",
})


def pooled_channels(tensor: str, elem: int, ctx: Wiring) -> int:
    """Channel count when `tensor` is a static 4-D float32 activation that onnxruntime keeps in
    its NCHWc layout (a Conv output, or what follows one elementwise); else 0."""
    shape = ctx.shapes.get(tensor, ())
    if tensor not in ctx.nchwc or elem != TensorProto.FLOAT or len(shape) != 4 or 0 in shape:
        return 0
    return shape[1]


def pooled_reductions(src: str, channels: int, outs: tuple[str, str, str], ctx: Wiring) -> list[onnx.NodeProto]:
    """Max, min and the NaN flag of a 4-D NCHWc activation from global pools, which run on the
    blocked layout: ReduceMax and friends would first copy it back to NCHW. min = -max(-x),
    negated by a per-channel Mul that stays blocked (exact); the flag is a sum of channel
    means (NaN and Inf propagate). `outs` = (max, min, flag or ""). The per-channel pools are
    kept in ctx.channel_extremes for what follows (see instrument._batchnorm_stats)."""
    n = ctx.name
    mx, mn, flag = outs
    ctx.channels.add(channels)
    nodes: list[onnx.NodeProto] = []

    def pool_then_reduce(op: str, source: str, out: str, reduce: str = "ReduceMax") -> str:
        per_channel, vec = n("pooled"), n("pooled_vec")
        nodes.extend([
            helper.make_node(op, [source], [per_channel]),
            helper.make_node("Reshape", [per_channel, CONST_FLAT], [vec]),
            helper.make_node(reduce, [vec], [out], keepdims=1),
        ])
        return per_channel

    negated, negmax = n("negated"), n("negmax")
    channel_max = pool_then_reduce("GlobalMaxPool", src, mx)
    nodes.append(helper.make_node("Mul", [src, f"{CONST_NEG_CHANNELS}{channels}"], [negated]))
    channel_neg = pool_then_reduce("GlobalMaxPool", negated, negmax)
    nodes.append(helper.make_node("Neg", [negmax], [mn]))
    ctx.channel_extremes[src] = (channel_max, channel_neg)
    if flag:
        pool_then_reduce("GlobalAveragePool", src, flag, reduce="ReduceL1")
    return nodes


def detail_nodes(
    flat: str, size: str, ctx: Wiring, cheap: tuple[str, str, str], count: int | None
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
        helper.make_node("Mul", [sm, CONST_ZERO_F], [z]),
        helper.make_node("Equal", [z, CONST_ZERO_F], [chk]),
        helper.make_node("Squeeze", [chk], [finite]),
    ]
    fx, fn, nan_c, ac = n("dmax"), n("dmin"), n("nan_c"), n("abs_clean")
    f_fx, f_fn, f_nan, f_ac = n("f_fx"), n("f_fn"), n("f_nan"), n("f_ac")
    finite_branch = helper.make_graph(
        [
            helper.make_node("Identity", [mx], [f_fx]),
            helper.make_node("Identity", [mn], [f_fn]),
            helper.make_node("Identity", [CONST_ZERO_I64_1], [f_nan]),
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
    nf_fx, nf_fn, nf_nan, nf_isn, nan_nodes = nan_aware(flat, ctx)
    nf_abs, nf_ac = n("nf_abs"), n("nf_ac")
    nan_nodes += [
        helper.make_node("Abs", [flat], [nf_abs]),
        helper.make_node("Where", [nf_isn, CONST_POS_INF, nf_abs], [nf_ac]),
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
    # Counts above the formats' maxima are 0 unless abs-max passes the smallest of the scope's
    # (a format outside the scope may count 0 wrongly: RangeStats leaves its count out). Each
    # NaN is an Inf in |x| here, above every max: the NaN count comes off.
    big, bigs = n("big"), n("bigs")
    over_names = [n("over") for _ in OVER_FORMATS]
    over_nodes = []
    for fmt, out in zip(OVER_FORMATS, over_names, strict=True):
        gt = n("gt")
        over_nodes.append(helper.make_node("Greater", [ac, over_const(fmt)], [gt]))
        count_nodes, counted = count_true(gt, small, ctx)
        over_nodes += count_nodes + [helper.make_node("Identity", [counted], [out])]
    over_vec, with_nan, some, none = n("over_vec"), n("with_nan"), n("some"), n("none")
    over_nodes += [
        helper.make_node("Concat", over_names, [with_nan], axis=0),
        helper.make_node("Sub", [with_nan, nan_c], [some]),
    ]
    nodes += [
        helper.make_node("Greater", [top, CONST_SMALLEST_MAX], [big]),
        helper.make_node("Squeeze", [big], [bigs]),
        helper.make_node(
            "If", [bigs], [over_vec],
            then_branch=helper.make_graph(over_nodes, n("over_branch"), [], [helper.make_tensor_value_info(some, TensorProto.INT64, [len(OVER_FORMATS)])]),
            else_branch=helper.make_graph(
                [helper.make_node("Identity", [CONST_ZERO_OVER], [none])], n("no_over_branch"), [],
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
    fast_nodes, fast_idx = bin_index(ac, ctx)
    count_nodes, fast_hist = count_bins(fast_idx, shared_ones(count, ctx) or one, small, ctx)
    nodes += fast_nodes + count_nodes
    lumped, has, has_s = n("lumped"), n("has"), n("has_s")
    nodes += [
        helper.make_node("Slice", [fast_hist, CONST_LUMP_AT, CONST_LUMP_END], [lumped]),
        helper.make_node("Greater", [lumped, CONST_ZERO_I64_1], [has]),
        helper.make_node("Squeeze", [has], [has_s]),
    ]
    # Zeros or subnormals in the shared bin: pick out those values (few, as a rule), scale
    # them by 2^64 (exact; subnormals become normal) and bin them again, zeros to bin 0.
    subnormal, tiny, scaled, down, lump_idx = (n(s) for s in ("subnormal", "tiny", "scaled", "down", "lump_idx"))
    small_bins, scaled_idx = bin_index(scaled, ctx)
    small_count, small_hist = count_bins(lump_idx, one, small, ctx)
    taken, kept, lump_hist, hist = n("taken"), n("kept"), n("lump_hist"), n("hist")
    lump_nodes = [
        helper.make_node("Less", [ac, CONST_MIN_NORMAL], [subnormal]),
        helper.make_node("Compress", [ac, subnormal], [tiny], axis=0),
        helper.make_node("Mul", [tiny, CONST_SUBNORMAL_SCALE], [scaled]),
        *small_bins,
        helper.make_node("Sub", [scaled_idx, CONST_SUBNORMAL_SHIFT], [down]),
        helper.make_node("Max", [down, CONST_ZERO_I32], [lump_idx]),
        *small_count,
        helper.make_node("Mul", [lumped, CONST_LUMP_ONEHOT], [taken]),
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


def lean_detail_nodes(
    flat: str, size: str, ctx: Wiring, cheap: tuple[str, str, str], count: int | None
) -> tuple[list[onnx.NodeProto], str]:
    """The detail without If branches: the I row of a finite tensor-sample with no |x| above
    any format's max and no zero or subnormal, and FLAGGED otherwise (the caller reruns the
    sample with the full `detail_nodes`, which handles them in If branches).

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
    bin_nodes, idx = bin_index(ac, ctx, nan_safe=True)
    nodes += bin_nodes
    one = shared_ones(count, ctx)
    if one is None:
        # Any 1 from the data (see detail_nodes); wrong only in a sample that is flagged anyway.
        real, one_1, one = n("real"), n("one_1"), n("one")
        nodes += [
            helper.make_node("Equal", [mx, mx], [real]),
            helper.make_node("Cast", [real], [one_1], to=TensorProto.FLOAT if small else TensorProto.INT64),
            helper.make_node("Squeeze", [one_1], [one]),
        ]
    # In every sample: one count, fast; a bin it may have stopped at 2^24 flags the sample,
    # which the full detail then counts exactly.
    count_nodes, hist = count_bins(idx, one, small, ctx, saturates=True)
    nodes += count_nodes
    lumped, has, neg, top, big, z, sane, nonfinite, odd, flag, ii, row = (n(s) for s in (
        "lumped", "has", "neg", "absmax", "big", "z", "sane", "nonfinite", "odd", "flag", "lean_i", "lean_row"))
    nodes += [
        helper.make_node("Slice", [hist, CONST_LUMP_AT, CONST_LUMP_END], [lumped]),
        helper.make_node("Greater", [lumped, CONST_ZERO_I64_1], [has]),
    ]
    beyond = has
    if ctx.opset < 16 and not small:
        full_nodes, full = saturated(hist, ctx)
        beyond = n("beyond")
        nodes += [*full_nodes, helper.make_node("Or", [full, has], [beyond])]
    nodes += [
        helper.make_node("Neg", [mn], [neg]),
        helper.make_node("Max", [mx, neg], [top]),
        helper.make_node("Greater", [top, CONST_SMALLEST_MAX], [big]),
        # L1 x 0 is 0 exactly when L1 is finite (no NaN, no Inf in the tensor).
        helper.make_node("Mul", [sm, CONST_ZERO_F], [z]),
        helper.make_node("Equal", [z, CONST_ZERO_F], [sane]),
        helper.make_node("Not", [sane], [nonfinite]),
        helper.make_node("Or", [beyond, big], [odd]),
        helper.make_node("Or", [odd, nonfinite], [flag]),
        helper.make_node("Concat", [size, size, CONST_ZERO_I64_1, CONST_ZERO_OVER, hist], [ii], axis=0),
        helper.make_node("Where", [flag, CONST_FLAG_ROW, ii], [row]),
    ]
    return nodes, row


def nan_aware(flat: str, ctx: Wiring) -> tuple[str, str, str, str, list[onnx.NodeProto]]:
    """Max and min ignoring NaN (onnxruntime's reductions are unreliable with NaN), NaN count."""
    n = ctx.name
    isn, fxw, fnw, fx, fn, nan_i, nan_c = (n(s) for s in ("isnan", "nz_hi", "nz_lo", "dmax", "dmin", "nan_i", "nan_c"))
    nodes = [
        helper.make_node("IsNaN", [flat], [isn]),
        helper.make_node("Where", [isn, CONST_NEG_INF, flat], [fxw]),
        helper.make_node("Where", [isn, CONST_POS_INF, flat], [fnw]),
        helper.make_node("ReduceMax", [fxw], [fx], keepdims=1),
        helper.make_node("ReduceMin", [fnw], [fn], keepdims=1),
        helper.make_node("Cast", [isn], [nan_i], to=TensorProto.INT64),
        helper.make_node("ReduceSum", [nan_i], [nan_c], keepdims=1),
    ]
    return fx, fn, nan_c, isn, nodes


def bin_index(ac: str, ctx: Wiring, nan_safe: bool = False) -> tuple[list[onnx.NodeProto], str]:
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
        helper.make_node("Mul", [lg, CONST_INV_LN2], [y]),
        helper.make_node("Add", [y, CONST_BIN_SHIFT], [shifted]),
        helper.make_node("Clip", [shifted, CONST_LUMP_BIN, CONST_TOP_BIN], [clipped]),
        # Truncation is floor here: the value is at least the lumped bin's index. int32
        # indices: ~20% faster through the lookup and the counting than int64.
        *cast_bin(clipped, guess, nan_safe, ctx),
        helper.make_node("GatherElements", [CONST_NEXT_BIN_START, guess], [start]),  # 3x faster than Gather
        helper.make_node("GreaterOrEqual", [ac, start], [ge]),
        helper.make_node("Cast", [ge], [gei], to=TensorProto.INT32),
        helper.make_node("Add", [guess, gei], [idx]),
    ], idx


def cast_bin(clipped: str, guess: str, nan_safe: bool, ctx: Wiring) -> list[onnx.NodeProto]:
    """int32 bin from the clipped estimate; NaN, which Clip may pass, clipped again as an int."""
    if not nan_safe:
        return [helper.make_node("Cast", [clipped], [guess], to=TensorProto.INT32)]
    raw = ctx.name("raw_guess")
    return [
        helper.make_node("Cast", [clipped], [raw], to=TensorProto.INT32),
        helper.make_node("Clip", [raw, CONST_ZERO_I32_S, CONST_TOP_BIN_I32], [guess]),
    ]


def count_true(mask: str, small: bool, ctx: Wiring) -> tuple[list[onnx.NodeProto], str]:
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
SHARED_ONES = 1 << 20


def shared_ones(count: int | None, ctx: Wiring) -> str | None:
    """A shared float32 constant of `count` ones where that is worth holding, else None."""
    if count is None or count > SHARED_ONES or ctx.opset < 16:
        return None
    ctx.ones.add(count)
    return f"{CONST_ONES}{count}"


def count_bins(idx: str, one: str, small: bool, ctx: Wiring, *,
               saturates: bool = False) -> tuple[list[onnx.NodeProto], str]:
    """Counts per bin [HIST_BINS] int64 of an int32 bin index. `one`: a scalar 1, or ones shaped
    like `idx` (see shared_ones); float32 when `small` (counts below 2^24 are exact in float32, and
    summed ~20% faster). `saturates`: below opset 16, a bin may stop at 2^24 (one count, not
    rows: the caller flags such a sample; see saturated)."""
    n = ctx.name
    hist = n("hist")
    if ctx.opset >= 16:
        if one.startswith(CONST_ONES):
            nodes, ones = [], one
        else:
            shape, ones = n("shape"), n("ones")
            nodes = [helper.make_node("Shape", [idx], [shape]), helper.make_node("Expand", [one, shape], [ones])]
        if not small:
            return nodes + [helper.make_node("ScatterElements", [CONST_HIST_ZEROS, idx, ones], [hist], reduction="add")], hist
        counted = n("counted")
        return nodes + [
            helper.make_node("ScatterElements", [CONST_HIST_ZEROS_F, idx, ones], [counted], reduction="add"),
            helper.make_node("Cast", [counted], [hist], to=TensorProto.INT64),
        ], hist
    # No ScatterElements reduction before opset 16: TfIdfVectorizer counts 1-grams, in
    # float32, exact up to 2^24 a bin. Past that (or of unknown size) each row of at most
    # TF_ROW indices is counted apart and the rows summed in int64.
    tf = n("tf")
    counting = {"mode": "TF", "min_gram_length": 1, "max_gram_length": 1, "max_skip_count": 0,
                "ngram_counts": [0], "ngram_indexes": list(range(HIST_BINS)),
                "pool_int64s": list(range(HIST_BINS))}
    if small or saturates:
        return [
            helper.make_node("TfIdfVectorizer", [idx], [tf], **counting),
            helper.make_node("Cast", [tf], [hist], to=TensorProto.INT64),
        ], hist
    # Rows of at most TF_ROW indices, as few as that takes (at least one: TfIdfVectorizer
    # refuses [0, C]), made equal by padding with -1, which is in no bin.
    size, some, longer, rows, up, up_less, width, whole, pad, pads, padded, shape, counted, per_row = (
        n(s) for s in ("tf_size", "tf_some", "tf_longer", "tf_rows", "tf_up", "tf_up_less",
                       "tf_width", "tf_whole", "tf_pad", "tf_pads", "tf_padded", "tf_shape",
                       "tf_counted", "tf_per_row"))
    return [
        helper.make_node("Shape", [idx], [size]),
        helper.make_node("Max", [size, CONST_ONE_DIM], [some]),
        helper.make_node("Add", [some, CONST_TF_ROW_LESS_ONE], [longer]),
        helper.make_node("Div", [longer, CONST_TF_ROW], [rows]),
        helper.make_node("Add", [some, rows], [up]),
        helper.make_node("Sub", [up, CONST_ONE_DIM], [up_less]),
        helper.make_node("Div", [up_less, rows], [width]),
        helper.make_node("Mul", [rows, width], [whole]),
        helper.make_node("Sub", [whole, size], [pad]),
        helper.make_node("Concat", [CONST_ZERO_I64_1, pad], [pads], axis=0),
        helper.make_node("Pad", [idx, pads, CONST_NO_BIN], [padded]),
        helper.make_node("Concat", [rows, width], [shape], axis=0),
        helper.make_node("Reshape", [padded, shape], [counted]),
        helper.make_node("TfIdfVectorizer", [counted], [tf], **counting),
        helper.make_node("Cast", [tf], [per_row], to=TensorProto.INT64),
        helper.make_node("ReduceSum", [per_row, CONST_ZERO_I64_1], [hist], keepdims=0),
    ], hist


def saturated(hist: str, ctx: Wiring) -> tuple[list[onnx.NodeProto], str]:
    """bool [1]: some bin of `hist` (int64, counted in float32) reached 2^24, where it stops."""
    n = ctx.name
    most, full = n("most"), n("full")
    return [
        helper.make_node("ReduceMax", [hist], [most], keepdims=1),
        helper.make_node("GreaterOrEqual", [most, CONST_TF_FULL], [full]),
    ], full


# Shared constants, added once per model as initialisers of the main graph (visible in bodies).
CONST_FLAT = "__npuprep_c_flat"
CONST_SIZE = "__npuprep_c_size_"
CONST_ROW = "__npuprep_c_row_"
CONST_NEG_CHANNELS = "__npuprep_c_neg_channels_"
CONST_ONES = "__npuprep_c_ones_"
CONST_ONE_DIM = "__npuprep_c_one_dim"
CONST_ZERO_F = "__npuprep_c_zero_f"
CONST_LO = "__npuprep_c_lo"
CONST_HI = "__npuprep_c_hi"
CONST_LO_NARROW = "__npuprep_c_lo_narrow"
CONST_HI_NARROW = "__npuprep_c_hi_narrow"
CONST_ZEROS_TAIL = "__npuprep_c_zeros_tail"
CONST_NEG_INF = "__npuprep_c_neg_inf"
CONST_POS_INF = "__npuprep_c_pos_inf"
CONST_INV_LN2 = "__npuprep_c_inv_ln2"
CONST_HIST_ZEROS = "__npuprep_c_hist_zeros"
CONST_ZERO_I64_1 = "__npuprep_c_zero_i64"
CONST_ZERO_I32 = "__npuprep_c_zero_i32"
CONST_HIST_ZEROS_F = "__npuprep_c_hist_zeros_f"
CONST_BIN_SHIFT = "__npuprep_c_bin_shift"
CONST_LUMP_BIN = "__npuprep_c_lump_bin"
CONST_TOP_BIN = "__npuprep_c_top_bin"
CONST_NEXT_BIN_START = "__npuprep_c_next_bin_start"
CONST_LUMP_AT = "__npuprep_c_lump_at"
CONST_LUMP_END = "__npuprep_c_lump_end"
CONST_LUMP_ONEHOT = "__npuprep_c_lump_onehot"
CONST_MIN_NORMAL = "__npuprep_c_min_normal"
CONST_SUBNORMAL_SCALE = "__npuprep_c_subnormal_scale"
CONST_SUBNORMAL_SHIFT = "__npuprep_c_subnormal_shift"
CONST_SMALLEST_MAX = "__npuprep_c_smallest_max"
CONST_ZERO_OVER = "__npuprep_c_zero_over"
CONST_FLAG_ROW = "__npuprep_c_flag_row"
CONST_ZERO_I32_S = "__npuprep_c_zero_i32_s"
CONST_TOP_BIN_I32 = "__npuprep_c_top_bin_i32"
CONST_TF_ROW = "__npuprep_c_tf_row"
CONST_TF_ROW_LESS_ONE = "__npuprep_c_tf_row_less_one"
CONST_NO_BIN = "__npuprep_c_no_bin"
CONST_TF_FULL = "__npuprep_c_tf_full"
# The most indices a TfIdfVectorizer row counts: under 2^24, so its float32 counts are exact.
TF_ROW = 1 << 23


def next_bin_start() -> np.ndarray:
    """Entry i: 2^(i + 1 - 150), where bin i + 1 starts (Inf past float32's range; NaN for
    the top bin, which nothing passes)."""
    with np.errstate(over="ignore"):
        starts = np.ldexp(np.float32(1), np.arange(HIST_BINS) + 1 - HIST_OFFSET).astype(np.float32)
    starts[-1] = np.nan
    return starts


def over_const(fmt: str) -> str:
    return f"__npuprep_c_max_{fmt}"


def shared_constants(scope: Scope = SCOPES["auto"]) -> list[onnx.TensorProto]:
    """The constants every instrumented graph shares; the ordinary range and the abs-max past
    which the counts above the formats' maxima run are `scope`'s."""
    values = {
        CONST_FLAT: np.array([-1], np.int64),
        CONST_ONE_DIM: np.array([1], np.int64),
        CONST_ZERO_F: np.array([0.0], np.float32),
        CONST_LO: np.array(scope.lo, np.float32),
        CONST_HI: np.array(scope.hi, np.float32),
        CONST_LO_NARROW: np.array(scope.range_of(True)[0], np.float32),
        CONST_HI_NARROW: np.array(scope.range_of(True)[1], np.float32),
        CONST_ZEROS_TAIL: np.zeros(WIDTH - 1, np.int64),
        CONST_NEG_INF: np.array(-np.inf, np.float32),
        CONST_POS_INF: np.array(np.inf, np.float32),
        CONST_INV_LN2: np.array(1.0 / math.log(2.0), np.float32),
        CONST_HIST_ZEROS: np.zeros(HIST_BINS, np.int64),
        CONST_ZERO_I64_1: np.zeros(1, np.int64),
        CONST_ZERO_I32: np.zeros(1, np.int32),
        CONST_HIST_ZEROS_F: np.zeros(HIST_BINS, np.float32),
        CONST_BIN_SHIFT: np.array(HIST_OFFSET - 1 / 16, np.float32),
        CONST_LUMP_BIN: np.array(HIST_OFFSET - 127, np.float32),
        CONST_TOP_BIN: np.array(HIST_BINS - 1, np.float32),
        CONST_NEXT_BIN_START: next_bin_start(),
        CONST_LUMP_AT: np.array([HIST_OFFSET - 127], np.int64),
        CONST_LUMP_END: np.array([HIST_OFFSET - 126], np.int64),
        CONST_LUMP_ONEHOT: np.eye(1, HIST_BINS, HIST_OFFSET - 127, np.int64)[0],
        CONST_MIN_NORMAL: np.array(np.finfo(np.float32).tiny, np.float32),
        CONST_SUBNORMAL_SCALE: np.array(2.0**SUBNORMAL_SHIFT, np.float32),
        CONST_SUBNORMAL_SHIFT: np.array(SUBNORMAL_SHIFT, np.int32),
        CONST_SMALLEST_MAX: np.array([scope.smallest_max], np.float32),
        CONST_ZERO_OVER: np.zeros(len(OVER_FORMATS), np.int64),
        CONST_FLAG_ROW: FLAGGED * np.eye(1, WIDTH, HEADER.index("detailed"), np.int64)[0],
        CONST_ZERO_I32_S: np.array(0, np.int32),
        CONST_TOP_BIN_I32: np.array(HIST_BINS - 1, np.int32),
        CONST_TF_ROW: np.array([TF_ROW], np.int64),
        CONST_TF_ROW_LESS_ONE: np.array([TF_ROW - 1], np.int64),
        CONST_NO_BIN: np.array(-1, np.int32),
        CONST_TF_FULL: np.array([2**24], np.int64),
    }
    for fmt in OVER_FORMATS:
        values[over_const(fmt)] = np.array(get_format(fmt).max, np.float32)
    return [numpy_helper.from_array(v, k) for k, v in values.items()]
