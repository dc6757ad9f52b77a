"""Op facts shared by analysis, emulation and lowering."""

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

# Ops whose float outputs carry no values worth rounding (they only move or reshape data
# already rounded upstream); rounding them again is harmless but costs a Cast pair each.
DATA_MOVEMENT_OPS = frozenset({
    "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Identity", "Slice", "Gather",
    "GatherElements", "GatherND", "Concat", "Split", "Expand", "Tile", "Pad", "DepthToSpace",
    "SpaceToDepth", "MaxPool", "ReduceMax", "ReduceMin", "Relu", "Max", "Min", "Where",
})

# Ops with learned weights that a power-of-two rescale can act on.
LINEAR_WITH_WEIGHTS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
