"""Number formats of deployment targets, read from ml_dtypes/numpy finfo, never typed in."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from functools import cache

import ml_dtypes
import numpy as np
from onnx import TensorProto

from npuprep.errors import NpuprepError


@dataclass(frozen=True)
class NumberFormat:
    """One floating-point format: its limits and how ONNX names it."""

    name: str
    np_dtype: np.dtype
    onnx_type: int
    max: float
    min_normal: float
    min_subnormal: float
    eps: float
    has_inf: bool

    @property
    def overflow_threshold(self) -> float:
        """Smallest magnitude that rounds past max under round-to-nearest-even.

        For FP16 that is 65520: 65505..65519 still round to 65504.
        """
        finfo = _finfo(self.np_dtype)
        mantissa_bits = int(finfo.nmant)
        return float(self.max + 2.0 ** (math.floor(math.log2(self.max)) - mantissa_bits - 1))

    @property
    def significand_bits(self) -> int:
        """Significant bits, the implicit one included: BF16 8, FP16 11, FP32 24."""
        return round(-math.log2(self.eps)) + 1

    @property
    def unit_roundoff(self) -> float:
        """Largest relative error of one rounding to nearest (half of eps): a format's
        precision, as `max` is its range. BF16 2^-8, FP16 2^-11."""
        return self.eps / 2

    @property
    def exp_limit(self) -> float:
        """Largest x for which exp(x) is still finite in this format."""
        return math.log(self.max)

    @property
    def square_limit(self) -> float:
        """Largest |x| for which x*x is still finite in this format."""
        return math.sqrt(self.max)

    def round(self, x: np.ndarray, *, saturate: bool) -> np.ndarray:
        """Round FP32 values to this format and back, as the target would store them.

        `saturate=True` clips to +-max first (a saturating engine); otherwise overflow
        gives Inf where the format has one and NaN where it has none (E4M3FN).
        """
        x = np.asarray(x, dtype=np.float32)
        if saturate:
            x = np.clip(x, -self.max, self.max)
        # ml_dtypes rounds to nearest even and gives NaN past max where there is no Inf
        # (E4M3FN: 464 ties to 448, 465 is NaN).
        with np.errstate(over="ignore", invalid="ignore"):
            return x.astype(self.np_dtype).astype(np.float32)


def _finfo(dtype: np.dtype) -> np.finfo | ml_dtypes.finfo:
    if dtype in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)):
        return np.finfo(dtype)
    return ml_dtypes.finfo(dtype)


def _make(name: str, dtype: type, onnx_type: int, has_inf: bool) -> NumberFormat:
    finfo = _finfo(np.dtype(dtype))
    return NumberFormat(
        name=name,
        np_dtype=np.dtype(dtype),
        onnx_type=onnx_type,
        max=float(finfo.max),
        min_normal=float(finfo.smallest_normal),
        min_subnormal=float(finfo.smallest_subnormal),
        eps=float(finfo.eps),
        has_inf=has_inf,
    )


@cache
def formats() -> dict[str, NumberFormat]:
    """The float formats npuprep knows, by name."""
    table = [
        _make("fp32", np.float32, TensorProto.FLOAT, True),
        _make("bf16", ml_dtypes.bfloat16, TensorProto.BFLOAT16, True),
        _make("fp16", np.float16, TensorProto.FLOAT16, True),
        _make("fp8_e4m3", ml_dtypes.float8_e4m3fn, TensorProto.FLOAT8E4M3FN, False),
        _make("fp8_e5m2", ml_dtypes.float8_e5m2, TensorProto.FLOAT8E5M2, True),
    ]
    return {f.name: f for f in table}


# Integer and other names a profile may list as supported or unsupported.
# A scalar at or below this, multiplied into an additive mask (`(1 - m) * -1e9`), is a mask
# value: exporters write -1e4, -1e5 ... -1e9 and -inf, past any scale a model multiplies data
# by. Only those beyond the format change at lowering (-1e4 fits FP16 and is kept as it is).
MASK_SCALE = -1e4

NON_FLOAT_DTYPES = ("int4", "int8", "int16", "int32", "uint8", "fp64", "tf32")
ALL_DTYPE_NAMES = tuple(formats()) + NON_FLOAT_DTYPES


def get_format(name: str) -> NumberFormat:
    """Look a float format up by name; an unknown name is a user error."""
    try:
        return formats()[name]
    except KeyError:
        known = ", ".join(formats())
        raise NpuprepError(f"unknown number format '{name}' (known: {known})") from None


# ONNX tensor element types that hold floating-point data.
FLOAT_ONNX_TYPES = {
    TensorProto.FLOAT: "fp32",
    TensorProto.FLOAT16: "fp16",
    TensorProto.BFLOAT16: "bf16",
    TensorProto.DOUBLE: "fp64",
    TensorProto.FLOAT8E4M3FN: "fp8_e4m3",
    TensorProto.FLOAT8E5M2: "fp8_e5m2",
}
# Those a model computes in (a graph's float inputs and outputs): no 8-bit storage types.
COMPUTE_FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16,
                                 TensorProto.DOUBLE})


class Int8Activations(enum.StrEnum):
    """Which INT8 activations a target's compiler takes: symmetric INT8 only (zero point 0:
    TensorRT), uint8 with a zero point too (the step narrows wherever a tensor reaches less
    far below zero than above), or unknown (a zero point only where a tensor barely goes
    negative, a GELU's -0.17, where symmetric INT8 would spend half its levels on nothing)."""

    SYMMETRIC = "symmetric"
    ASYMMETRIC = "asymmetric"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class EightBitFormat:
    """An 8-bit QDQ format: what one scale step holds and the opset its QuantizeLinear needs.

    `qmax` is the largest magnitude a scaled value may take (127 for INT8, the E4M3FN max
    for FP8); `floor` the smallest magnitude it still resolves (half an INT8 step, E4M3's
    smallest subnormal); `rel_step` the spacing relative to a value (INT8: none, FP8: eps).
    """

    name: str
    onnx_type: int
    qmax: float
    floor: float
    rel_step: float
    min_opset: int
    activations: Int8Activations = Int8Activations.UNKNOWN

    @property
    def is_float(self) -> bool:
        return self.rel_step > 0


def eight_bit_format(name: str, activations: Int8Activations = Int8Activations.UNKNOWN
                     ) -> EightBitFormat | None:
    """The 8-bit QDQ format called `name` (`int8`, `fp8_e4m3`), None for any other name;
    `activations`: the INT8 activations the target takes (the profile's `int8_activations`;
    FP8's are symmetric whatever it says)."""
    if name == "int8":
        return EightBitFormat("int8", TensorProto.INT8, 127.0, 0.5, 0.0, 13, activations)
    if name == "fp8_e4m3":
        f = formats()["fp8_e4m3"]
        return EightBitFormat("fp8_e4m3", f.onnx_type, f.max, f.min_subnormal, f.eps, 19)
    return None
