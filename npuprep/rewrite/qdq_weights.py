"""8-bit weights made once per source weight: `W (FP32, user's file)` -> `W8 (scratch) + scale`.

The 8-bit pipeline builds many QDQ models of one graph (the rule and balancing trials, the
ranking, the widening rounds), and each quantises the same weights. A WeightStore quantises
each source weight once, reading it a block of rows at a time (the FP32 weight is never
whole in memory), and keeps the stored 8-bit tensor: in a scratch file
(npuprep.model_io.WeightScratch) when it has one, which the graphs then name by location
and sessions map, else inline. Weights the pipeline rewrites in FP32 (balanced rows) go
there too (`place`). The values are those of quantising the whole weight at once: a block's
abs-max and its division are elementwise, and max is exact in any order.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
from onnx import helper, numpy_helper

from npuprep.errors import NpuprepError
from npuprep.graph import external_info, is_anchored, to_array
from npuprep.model_io import WeightScratch
from npuprep.numerics import EightBitFormat

# Tensors of at least this many bytes go to the scratch file (lowering's threshold).
SCRATCH_MIN_BYTES = 64 * 2**10
# Rows of a weight read and quantised together: about this many bytes of FP32.
BLOCK_BYTES = 16 * 2**20


@dataclass(frozen=True)
class QuantisedWeight:
    """A weight stored in 8 bits: `stored` (its bytes inline, or anchored to the scratch
    file) and the FP32 `scale` per output channel (a scalar where `axis` is None)."""

    stored: onnx.TensorProto
    scale: np.ndarray
    axis: int | None


class WeightStore:
    """8-bit weights quantised once per (source weight, axis, format, saturation), and
    FP32 weights the pipeline makes, kept in `scratch` from SCRATCH_MIN_BYTES up (None:
    inline). One store serves every QDQ model of one conversion."""

    def __init__(self, scratch: WeightScratch | None = None) -> None:
        self.scratch = scratch
        self._done: dict[tuple[object, ...], QuantisedWeight] = {}
        # Weights rounded for their layer's output (npuprep.rewrite.weight_rounding), by key.
        self._preferred: dict[tuple[object, ...], tuple[np.ndarray, np.ndarray]] = {}

    def prefer(self, source: onnx.TensorProto | np.ndarray, axis: int | None, fmt: EightBitFormat,
               *, saturate: bool, stored: np.ndarray, scale: np.ndarray) -> None:
        """Quantise `source` to these 8-bit values and scale (a rounding chosen for the
        layer's output) rather than to nearest, in every model built from now on."""
        # An anchored weight is known by its place in its file and, where a caller read it
        # in (the trials of a model small enough to hold), by its values: both find it.
        sources = [source] + ([to_array(source)] if isinstance(source, onnx.TensorProto)
                              and is_anchored(source) else [])
        for each in sources:
            key = self._key(each, axis, fmt, saturate)
            self._preferred[key] = (stored, scale)
            self._done.pop(key, None)

    def forget(self, fmt: EightBitFormat) -> None:
        """Round every weight of `fmt` to nearest again (a rounding the outputs refused)."""
        for key in [k for k in self._preferred if k[2] == fmt.name]:
            del self._preferred[key]
            self._done.pop(key, None)

    def roundings(self) -> dict[tuple[object, ...], tuple[np.ndarray, np.ndarray]]:
        """Every rounding preferred to nearest so far, to give back later (`restore`)."""
        return dict(self._preferred)

    def restore(self, roundings: Mapping[tuple[object, ...], tuple[np.ndarray, np.ndarray]],
                but: Iterable[onnx.TensorProto | np.ndarray] = ()) -> None:
        """Prefer `roundings` (a `roundings()` of before) again, but those of the weights
        `but` (fitted to inputs that have since changed)."""
        changed = {_identity(each) for s in but for each in
                   [s] + ([to_array(s)] if isinstance(s, onnx.TensorProto) and is_anchored(s)
                          else [])}
        for key, value in roundings.items():
            if key[0] not in changed:
                self._preferred[key] = value
                self._done.pop(key, None)

    def values(self, source: onnx.TensorProto | np.ndarray, axis: int | None, fmt: EightBitFormat,
               *, saturate: bool) -> tuple[np.ndarray, np.ndarray]:
        """(the 8-bit values, the FP32 scale) the store writes for `source`, as arrays."""
        key = self._key(source, axis, fmt, saturate)
        found = self._preferred.get(key)
        return found if found is not None else quantise_weight(source, axis, fmt, saturate=saturate)

    @staticmethod
    def _key(source: onnx.TensorProto | np.ndarray, axis: int | None, fmt: EightBitFormat,
             saturate: bool) -> tuple[object, ...]:
        return (_identity(source), axis, fmt.name, saturate)

    def quantised(self, source: onnx.TensorProto | np.ndarray, axis: int | None, fmt: EightBitFormat,
                  *, saturate: bool, name: str) -> QuantisedWeight:
        """`source` (an FP32 initialiser, or the value of a constant) symmetric per output
        channel `axis` (None: one scale), stored as a tensor named `name`."""
        if isinstance(source, onnx.TensorProto) and not is_anchored(source):
            source = to_array(source)  # once, for the digest and both passes
        key = self._key(source, axis, fmt, saturate)
        found = self._done.get(key)
        if found is None:
            stored, scale = self.values(source, axis, fmt, saturate=saturate)
            found = QuantisedWeight(self._tensor(stored, name, fmt), scale, axis)
            self._done[key] = found
        if found.stored.name == name:
            return found
        renamed = onnx.TensorProto()
        renamed.CopyFrom(found.stored)
        renamed.name = name
        return QuantisedWeight(renamed, found.scale, axis)

    def place(self, value: np.ndarray, name: str) -> onnx.TensorProto:
        """`value` as an initialiser named `name`: anchored to the scratch file when it has
        one and the value is large, else inline."""
        if self.scratch is not None and value.nbytes >= SCRATCH_MIN_BYTES:
            return self.scratch.anchor(value, name)
        return numpy_helper.from_array(value, name)

    def _tensor(self, stored: np.ndarray, name: str, fmt: EightBitFormat) -> onnx.TensorProto:
        if self.scratch is not None and stored.nbytes >= SCRATCH_MIN_BYTES:
            return self.scratch.anchor(stored, name)
        if fmt.is_float:
            return helper.make_tensor(name, fmt.onnx_type, stored.shape, stored.view(np.uint8).tobytes(),
                                      raw=True)
        return numpy_helper.from_array(stored, name)


def quantise_weight(source: onnx.TensorProto | np.ndarray, axis: int | None, fmt: EightBitFormat, *,
                    saturate: bool) -> tuple[np.ndarray, np.ndarray]:
    """(the 8-bit values, the FP32 scale) of `source`: scale = abs-max / qmax per channel of
    `axis` (1 where a channel is all zero); INT8 rounds to nearest and clips, FP8 clips
    where `saturate` (the weight's own abs-max sets its scale, so nothing reaches past qmax
    but a NaN) and casts."""
    shape = tuple(source.dims) if isinstance(source, onnx.TensorProto) else source.shape
    rank = len(shape)
    other = tuple(a for a in range(rank) if a != axis)
    top: np.ndarray | None = None
    for _start, block in _row_blocks(source):
        if axis is None:
            found = np.array(np.abs(block).max(initial=0.0), np.float32)
            top = found if top is None else np.maximum(top, found)
        elif axis == 0:
            found = np.abs(block).max(axis=other, initial=0.0).astype(np.float32)
            top = found if top is None else np.concatenate([top, found])
        else:
            found = np.abs(block).max(axis=other, initial=0.0).astype(np.float32)
            top = found if top is None else np.maximum(top, found)
    if top is None:  # no rows: an empty weight
        top = np.zeros(() if axis is None else (shape[axis],), np.float32)
    scale = np.where(top > 0, top / np.float32(fmt.qmax), np.float32(1.0)).astype(np.float32)
    stored = np.empty(shape, ml_dtypes.float8_e4m3fn if fmt.is_float else np.int8)
    for start, block in _row_blocks(source):
        if axis is None:
            shaped = scale
        elif axis == 0:
            shaped = scale[start:start + len(block)].reshape([-1] + [1] * (rank - 1))
        else:
            shaped = scale.reshape([-1 if a == axis else 1 for a in range(rank)])
        scaled = block / shaped
        rows = slice(start, start + len(block)) if rank else ()
        if fmt.is_float:
            stored[rows] = (np.clip(scaled, -fmt.qmax, fmt.qmax) if saturate else scaled
                            ).astype(ml_dtypes.float8_e4m3fn)
        else:
            stored[rows] = np.clip(np.rint(scaled), -fmt.qmax, fmt.qmax).astype(np.int8)
    return stored, scale


def _row_blocks(source: onnx.TensorProto | np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, FP32 rows) of `source` along its first axis, about BLOCK_BYTES at a time;
    an anchored tensor is read from its file a block at a time into one reused buffer."""
    if isinstance(source, np.ndarray) or not _readable_in_blocks(source):
        value = source if isinstance(source, np.ndarray) else to_array(source)
        if value.ndim == 0:
            yield 0, value
            return
        step = max(1, BLOCK_BYTES // max(1, value[:1].nbytes))
        for start in range(0, len(value), step):
            yield start, value[start:start + step]
        return
    dims = tuple(source.dims)
    row = math.prod(dims[1:]) * 4
    step = max(1, BLOCK_BYTES // max(1, row))
    location, offset, _ = external_info(source)
    buffer = np.empty((min(step, dims[0]), *dims[1:]), np.float32)
    with open(location, "rb") as fh:
        fh.seek(offset)
        for start in range(0, dims[0], step):
            block = buffer[:min(step, dims[0] - start)]
            if fh.readinto(block.reshape(-1).view(np.uint8)) != block.nbytes:
                raise NpuprepError(f"{location}: tensor '{source.name}' ends before its "
                                   f"{math.prod(dims) * 4} bytes at offset {offset}")
            yield start, block


def _readable_in_blocks(tensor: onnx.TensorProto) -> bool:
    """An anchored FP32 tensor of rank >= 1 whose file holds its bytes as they are."""
    if not is_anchored(tensor) or tensor.data_type != onnx.TensorProto.FLOAT or not tensor.dims:
        return False
    _, _, length = external_info(tensor)
    return sys.byteorder == "little" and (length is None or length == math.prod(tensor.dims) * 4)


def _identity(source: onnx.TensorProto | np.ndarray) -> object:
    """What makes two sources the same weight: an anchored tensor's place in its file, or
    the digest of the values."""
    if isinstance(source, onnx.TensorProto) and is_anchored(source):
        return ("file", *external_info(source), tuple(source.dims))
    value = source if isinstance(source, np.ndarray) else to_array(source)
    return ("value", value.dtype.str, value.shape,
            hashlib.blake2b(np.ascontiguousarray(value).reshape(-1).view(np.uint8),
                            digest_size=16).hexdigest())
