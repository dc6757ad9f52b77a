"""LayerRecord: one compiler report layer as a neutral record (layer -> ONNX nodes, dtypes)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from npuprep.errors import NpuprepError

# Precisions from widest to narrowest; a node's effective precision is the narrowest one
# any of its layers reports. Non-float types (int32 indices, bool masks) are not listed:
# they say nothing about the precision a value is computed in.
PRECISION_ORDER = (
    "fp64", "fp32", "tf32", "bf16", "fp16", "int16", "fp8_e5m2", "fp8_e4m3", "int8", "uint8", "int4",
)
# Same exponent range as FP32: enough for a node that is sensitive only to range.
FP32_RANGE = frozenset({"fp64", "fp32", "tf32", "bf16"})
# Enough for any node: range and mantissa of FP32 or better.
FP32_OR_WIDER = frozenset({"fp64", "fp32", "tf32"})

# Words compilers use for a dtype, in TensorRT's long layout strings ("Row major linear
# FP16 format"), its short Myelin/kgen strings ("Half") and vendor tables ("int16", "float").
_DTYPE_WORDS = {
    "fp64": "fp64", "double": "fp64", "float64": "fp64",
    "fp32": "fp32", "float": "fp32", "float32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "half": "fp16", "float16": "fp16",
    "fp8": "fp8_e4m3", "e4m3": "fp8_e4m3", "fp8e4m3": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3",
    "e5m2": "fp8_e5m2", "fp8e5m2": "fp8_e5m2", "fp8_e5m2": "fp8_e5m2",
    "int4": "int4", "int8": "int8", "uint8": "uint8", "int16": "int16", "int32": "int32",
    "int64": "int64", "bool": "bool",
}
_WORD = re.compile(r"[A-Za-z0-9_]+")


def normalise_dtype(text: str) -> str | None:
    """npuprep's name for a compiler's dtype string, or None when it names no known type.

    "Row major linear FP16 format" -> fp16, "Half" -> fp16, "Thirty-two wide channel
    vectorized row major Int8 format" -> int8, "float" -> fp32.
    """
    for word in _WORD.findall(text):
        found = _DTYPE_WORDS.get(word.lower())
        if found:
            return found
    return None


def narrowest(dtypes: list[str] | tuple[str, ...]) -> str:
    """The narrowest precision among dtypes, or "" when none is a precision."""
    ranked = [d for d in dtypes if d in PRECISION_ORDER]
    return max(ranked, key=PRECISION_ORDER.index) if ranked else ""


@dataclass(frozen=True)
class LayerRecord:
    """One layer of a compiler's report, reduced to what crosscheck needs.

    `onnx_nodes` are the ONNX node labels the layer claims (several for a fused layer);
    names the reader could not tie to the model stay in `unresolved`. `compute_dtype` is
    "" when the report gives none (RKNN's error analysis, TensorRT with dynamic shapes).
    `in_dtypes`/`out_dtypes` line up with `in_tensors`/`out_tensors` where the report
    names tensors ("" for a tensor whose dtype it does not give).
    `compute` is False for layers that only move or re-type data (TensorRT Reformat).
    """

    layer: str
    onnx_nodes: tuple[str, ...]
    op_type: str
    device: str
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]
    compute_dtype: str
    compute: bool = True
    unresolved: tuple[str, ...] = ()
    in_tensors: tuple[str, ...] = ()
    out_tensors: tuple[str, ...] = ()
    metrics: dict[str, Any] = field(default_factory=dict)
    where: str = ""

    def precision_of(self, outputs: tuple[str, ...]) -> str:
        """The precision a node writing `outputs` runs in inside this layer.

        A node whose result leaves the layer lands in that output's dtype; a node inside
        a fused layer runs in the layer's compute precision.
        """
        for tensor, dtype in zip(self.out_tensors, self.out_dtypes, strict=False):
            if tensor in outputs and dtype in PRECISION_ORDER:
                return dtype
        return self.compute_dtype if self.compute_dtype in PRECISION_ORDER else narrowest(self.out_dtypes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "onnx_nodes": list(self.onnx_nodes),
            "op_type": self.op_type,
            "device": self.device,
            "in_dtypes": list(self.in_dtypes),
            "out_dtypes": list(self.out_dtypes),
            "compute_dtype": self.compute_dtype,
            "compute": self.compute,
            "unresolved": list(self.unresolved),
            "metrics": dict(self.metrics),
            "where": self.where,
        }


@dataclass(frozen=True)
class CompilerReport:
    """Every record a reader found in one report file, and whether the report gives dtypes."""

    path: str
    format: str
    records: tuple[LayerRecord, ...]
    dtypes_reported: bool = True
    notes: tuple[str, ...] = ()


def malformed(path: str, where: str, message: str) -> NpuprepError:
    """The one-line error for a report that does not follow its format."""
    return NpuprepError(f"{path}: {where}: {message}")
