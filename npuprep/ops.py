"""Op facts shared by analysis, planning, rewriting, emulation and lowering: one table each."""

from __future__ import annotations

# Inputs that stay FP32 whatever the target (scales, ROIs, ranges): op -> input positions.
# Rounding or lowering them changes shapes or indices rather than values.
FP32_ONLY_INPUTS: dict[str, frozenset[int]] = {
    "Resize": frozenset({1, 2}),
    "Upsample": frozenset({1}),
    "Range": frozenset({0, 1, 2}),
    "RoiAlign": frozenset({1}),
    "NonMaxSuppression": frozenset({0, 1, 3, 4}),
}

# --- layout: ops that move values without computing new ones ---------------------------

# The output holds exactly the input's values, reshaped or permuted: its statistics, errors
# and extremes are the input's (calibration shares its row, compare its numbers).
LAYOUT_OPS = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose"})
# The layout ops that keep the values in order: a compiler makes them views, no copy, no time.
VIEW_OPS = LAYOUT_OPS - {"Transpose"}
# Block moves hold exactly their input's values too (compare aliases them with LAYOUT_OPS),
# but across channels: calibration, which reads a layout op's output through its input's
# per-channel pools, measures them itself.
BLOCK_MOVE_OPS = frozenset({"DepthToSpace", "SpaceToDepth"})
# Values known from the constants and the input sizes alone: nothing computed at run time.
CONSTANT_OPS = frozenset({"Constant", "ConstantOfShape", "Shape", "Size"})
# Ops that hold or forward data without computing a value: absent from a compiler's report
# or a device's timeline, they say nothing about precision or cost.
NON_COMPUTE_OPS = VIEW_OPS | CONSTANT_OPS
GATHER_OPS = frozenset({"Gather", "GatherElements", "GatherND"})

# Ops whose float outputs carry no values worth rounding (they only move or reshape data
# already rounded upstream); rounding them again is harmless but costs a Cast pair each.
DATA_MOVEMENT_OPS = LAYOUT_OPS | BLOCK_MOVE_OPS | GATHER_OPS | {
    "Slice", "Concat", "Split", "Expand", "Tile", "Pad", "MaxPool", "ReduceMax", "ReduceMin",
    "Relu", "Max", "Min", "Where",
}

# Multiply-accumulate ops, the bulk of a network's arithmetic: op -> positions of its weight
# (input 1; a MatMul's may be an activation) and bias (input 2, where the op has one). A
# constant weight absorbs a power-of-two rescale; the ledger counts their MACs.
MAC_WEIGHT_INPUTS: dict[str, tuple[int, ...]] = {
    "Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2), "MatMul": (1,),
}
MAC_OPS = frozenset(MAC_WEIGHT_INPUTS)
# The MAC ops an 8-bit plan quantises (plan.layer_precision); a ConvTranspose's weight holds
# its output channels on axis 1 (npuprep.rewrite.qdq.weight_axis).
QUANTISED_MAC_OPS = MAC_OPS
# Recurrent layers: a gate matrix product per step (W on the input, R on the state), most of
# an LSTM speaker encoder's or GRU decoder's arithmetic. No rescale rule or 8-bit rule covers
# them (their weights feed gate nonlinearities at every step), so they stay in the wider format.
RECURRENT_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
RECURRENT_OPS = frozenset(RECURRENT_GATES)

# Ops that pass a value through unchanged in magnitude; guards and patterns look through them.
PASSTHROUGH_OPS = LAYOUT_OPS | {"Cast", "Expand"}

# --- positive scaling: f(s * x) for s = 2^-k > 0 -----------------------------------------

# f(s x) = s f(x): op -> positions of the data inputs that carry the scale.
COMMUTES_WITH_SCALING: dict[str, tuple[int, ...]] = {
    op: (0,) for op in (
        "Relu", "LeakyRelu", "PRelu", "MaxPool", "AveragePool", "GlobalAveragePool",
        "GlobalMaxPool", "LpPool", "Reshape", "Transpose", "Slice", "Flatten", "Squeeze",
        "Unsqueeze", "Identity", "Neg", "Abs", "Dropout", "Pad", "Resize", "Upsample",
        "Gather", "GatherElements", "GatherND", "Compress", "ReverseSequence", "Split",
        "Expand", "Tile", "DepthToSpace", "SpaceToDepth", "CumSum", "TopK", "ReduceMean",
        "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL1", "ReduceL2",
        # A Fourier transform is linear in its signal (the window, input 2, is not scaled).
        "STFT", "DFT",
    )
}
# Ops whose outputs (beyond output 0) carry the data too; default: output 0 only.
SCALED_ALL_OUTPUTS = frozenset({"Split"})
# f(s a, s b) = s f(a, b) when every float data input carries the same scale: op ->
# positions of those inputs (None: all).
JOINS_SCALES: dict[str, tuple[int, ...] | None] = {
    "Add": None, "Sub": None, "Sum": None, "Max": None, "Min": None, "Mean": None,
    "Concat": None, "Where": (1, 2), "Clip": None,
    "Greater": None, "Less": None, "GreaterOrEqual": None, "LessOrEqual": None, "Equal": None,
}
# Comparisons: the inputs' scales must agree; the boolean output carries none.
COMPARISONS = frozenset({"Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Equal"})
# Ops that turn a scale s into a power of it (x^2 -> s^2, sqrt -> s^(1/2), 1/x -> s^-1).
SCALE_POWERS = frozenset({"Sqrt", "Pow", "Reciprocal", "ReduceSumSquare"})
# Scale-invariant consumers: their outputs do not change when the input is scaled, so a
# scale domain ends there with nothing to compensate. Shapes, indices and signs:
SCALE_FREE_OUTPUTS = frozenset({"Shape", "Size", "ArgMax", "ArgMin", "NonZero", "Sign"})
# ... and normalisations (epsilon scaled by s^2; BatchNormalization folds mean/variance):
# op -> positions of the affine parameters an entry can scale instead.
SCALE_INVARIANT_NORMS: dict[str, tuple[int, ...]] = {
    "LayerNormalization": (1, 2), "InstanceNormalization": (1, 2),
    "GroupNormalization": (1, 2), "BatchNormalization": (1, 2), "RMSNormalization": (1,),
    "LpNormalization": (),
}

# Walking back from a tensor to where a scale could enter: op -> data input positions to
# follow (None: all). Products and quotients of activations carry a scale too.
SCALE_WALK_BACK: dict[str, tuple[int, ...] | None] = {
    **COMMUTES_WITH_SCALING,
    **{op: None for op in JOINS_SCALES if op not in COMPARISONS and op != "Where"},
    "Where": (1, 2), "Mul": None, "Div": (0,), "Pow": (0,), "Sqrt": (0,),
}

# --- static bounds: planning without measured ranges --------------------------------------

# Ops whose output range is known whatever their input: op -> (lo, hi).
BOUNDED_OUTPUTS: dict[str, tuple[float, float]] = {
    "Sigmoid": (0.0, 1.0), "HardSigmoid": (0.0, 1.0), "Softmax": (0.0, 1.0), "Tanh": (-1.0, 1.0),
}

# Ops that pass a large magnitude on: sums, products, reductions, data movement. Linear
# layers with unknown weights, roots, divisions and normalisations end it.
CARRIES_MAGNITUDE = LAYOUT_OPS | {
    "Add", "Sub", "Mul", "Sum", "Mean", "Max", "Min", "Neg", "Abs", "Relu", "Pow",
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceL1",
    "Concat", "Slice", "Split", "Gather", "Expand", "Tile", "Where", "Exp",
}
# Ops whose output a static pin finding marks as large.
MAKES_MAGNITUDE = CARRIES_MAGNITUDE | MAC_OPS
# Ops whose output carries their inputs' absolute rounding errors unchanged.
ADDITIVE = LAYOUT_OPS | {"Add", "Sub", "Neg", "Sum", "Concat", "Slice", "Gather"}

# --- launch classes: what a runtime dispatches per node, for the ledger's launch cost -------

# Each class carries its own per-node launch (or dispatch) cost in a target profile
# (`throughput.launch_us_by_class`). `view`: what moves nothing (the views and aliases above,
# Shape and constants); it launches nothing unless a profile says so. (The ledger folds shape
# arithmetic on integer tensors whatever its class: no float output, no kernel.) `layout`: layout ops that
# copy (Transpose, block moves), unless the profile names them views (`throughput.view_ops`).
LAUNCH_CLASS_OPS: dict[str, frozenset[str]] = {
    "view": NON_COMPUTE_OPS,
    "layout": (LAYOUT_OPS - VIEW_OPS) | BLOCK_MOVE_OPS,
    "mac": MAC_OPS | RECURRENT_OPS,
    "normalisation": frozenset(SCALE_INVARIANT_NORMS) | {"Softmax", "LogSoftmax"},
    "reduction": frozenset({
        "ReduceMax", "ReduceMin", "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL1",
        "ReduceL2", "ReduceProd", "ReduceLogSum", "ReduceLogSumExp", "GlobalAveragePool",
        "GlobalMaxPool", "AveragePool", "MaxPool", "LpPool", "ArgMax", "ArgMin", "TopK", "CumSum"}),
    "cast": frozenset({"Cast", "QuantizeLinear", "DequantizeLinear"}),
    "elementwise": frozenset({
        "Add", "Sub", "Mul", "Div", "Pow", "Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal",
        "Relu", "LeakyRelu", "PRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Gelu", "Erf",
        "Elu", "Selu", "Softplus", "Mish", "Clip", "Max", "Min", "Sum", "Mean", "Where", "Sin",
        "Cos", "Floor", "Ceil", "Round", "Sign", "Not", "And", "Or", "Xor", *COMPARISONS}),
}
# Every other op (gathers, slices, resizes, control flow...): its own class.
OTHER_LAUNCH_CLASS = "other"
LAUNCH_CLASSES = (*LAUNCH_CLASS_OPS, OTHER_LAUNCH_CLASS)


def launch_class(op_type: str) -> str:
    """The launch class of an op (LAUNCH_CLASS_OPS), `other` where none lists it."""
    return next((c for c, ops in LAUNCH_CLASS_OPS.items() if op_type in ops), OTHER_LAUNCH_CLASS)


# Ops whose small integer results (shapes, sizes, indices) npuprep.flops evaluates itself where
# ONNX shape inference's data propagation stops (it knows no Where, Equal, Range, Expand...).
SHAPE_ARITHMETIC_OPS = VIEW_OPS | CONSTANT_OPS | COMPARISONS | {
    "Shape", "Where", "Not", "And", "Or", "Range", "Gather", "Concat", "Slice", "Cast", "Add",
    "Sub", "Mul", "Div", "Mod", "Max", "Min", "Abs", "Neg", "ReduceProd", "Expand", "Floor",
    "Ceil", "Sqrt"}
