"""The second moment of each multiply-add's input rows: `X (rows x K)` -> `H = X^T X` per group.

A layer's output error from a weight error D (output channels x K) on inputs X is
||X D^T||^2 = sum over channels of d_c H d_c^T: H is all weight rounding needs to know of the
calibration activations (npuprep.rewrite.weight_rounding). The rows of a MatMul or Gemm are
its input's last axis; a Conv's are its input patches (im2col: one row per output position,
K = channels per group x kernel taps, one H per group). Conv positions are subsampled to
MAX_ROWS per sample: H is an average, and a few thousand rows of a feature map already fix it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from npuprep.calibrate.channels import probe_session
from npuprep.data import Feed
from npuprep.graph import attribute, constant_value, node_label

# Conv output positions read per sample (chosen at random, the same for every run).
MAX_ROWS = 1024
# A layer whose K (input length per output) passes this is left out: its H alone would take
# K^2 x 8 bytes (32 MB at 2048) and the rounding K^3.
MAX_K = 2048


@dataclass(frozen=True)
class InputMoments:
    """`gram[g]` = sum of x x^T over the input rows of group g ([groups, K, K], float64);
    `rows`: how many rows were summed; `kept`: the rows themselves ([groups, rows, K],
    float32) where they are fewer than K, else None. With fewer rows than K, ||X d^T||^2 costs
    rows/K of d H d^T (MiniLM's 4 samples of 32 tokens against its FFN's K of 1536)."""

    gram: np.ndarray
    rows: int
    kept: np.ndarray | None = None


def layer_geometry(node: onnx.NodeProto, weight: np.ndarray) -> tuple[int, int] | None:
    """(groups, K) of a Conv/MatMul/Gemm's weight rows, None where its input rows cannot be
    read here (a Conv of rank other than 1-2-D, a Gemm reading its input transposed)."""
    if node.op_type == "Conv" and weight.ndim in (3, 4):
        return int(attribute(node, "group", 1)), math.prod(weight.shape[1:])
    if node.op_type == "MatMul" and weight.ndim == 2:
        return 1, weight.shape[0]
    if node.op_type == "Gemm" and weight.ndim == 2 and not attribute(node, "transA", 0):
        return 1, weight.shape[1] if attribute(node, "transB", 0) else weight.shape[0]
    return None


def input_moments(model: onnx.ModelProto, layers: Sequence[str], parts: Sequence[Sequence[Feed]], *,
                  max_k: int = MAX_K,
                  offsets: Mapping[str, np.ndarray] | None = None) -> list[dict[str, InputMoments]]:
    """Per part of the samples (`parts`, one run of one session over them all): layer label
    -> the moments of its input rows over that part's samples, for the `layers` with a
    constant weight whose rows layer_geometry reads and whose K is at most `max_k`.
    `offsets`: layer -> a value per input channel taken off its rows first (the mean its bias
    corrects for: its error is the weight's on the rest)."""
    from npuprep.calibrate.run import pass_streams, session_threads
    from npuprep.runtime.session import run_in_streams

    g = model.graph
    wanted = set(layers)
    chosen: dict[str, onnx.NodeProto] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for node in g.node:
        label = node_label(node)
        if label not in wanted or len(node.input) < 2:
            continue
        w = constant_value(g, node.input[1])
        geometry = None if w is None else layer_geometry(node, w)
        if w is not None and geometry is not None and geometry[1] <= max_k:
            chosen[label], shapes[label] = node, w.shape
    if not chosen:
        return [{} for _ in parts]
    tensors = sorted({node.input[0] for node in chosen.values()})
    streams = pass_streams(max((len(p) for p in parts), default=1))
    session = probe_session(model, tensors, threads=session_threads(streams))
    rng = np.random.default_rng(0)
    found = []
    for samples in parts:
        # A MatMul's rows are its input's, whoever reads it: MiniLM's query, key and value
        # projections share one H (summed once, one array). A Conv's rows are drawn at
        # random, its own H. The sums are taken in place, sample after sample, in float64:
        # the same left fold as summing fresh copies, without a K x K array made per sample
        # and reader (MiniLM: most of this function's time, its products being 32 rows).
        sums: dict[str, np.ndarray] = {}
        # The rows, while fewer than K (InputMoments.kept).
        kept: dict[str, list[np.ndarray] | None] = {}
        source: dict[str, str] = {}
        rows: dict[str, int] = dict.fromkeys(chosen, 0)
        # Read in sample order whatever runs at once: the random rows drawn are the same.
        for values in run_in_streams(session, samples, tensors, streams):
            counted: dict[str, int] = {}
            for label, node in chosen.items():
                key = label if node.op_type == "Conv" else node.input[0]
                if key not in counted:
                    x = np.asarray(values[node.input[0]], np.float32)
                    patches = (conv_rows(node, x, shapes[label], rng) if node.op_type == "Conv"
                               else x.reshape(1, -1, x.shape[-1]))
                    if patches is None:
                        continue
                    if label in (offsets or {}):
                        patches = patches - _row_offsets(node, (offsets or {})[label],
                                                         shapes[label], patches.shape)
                    gram = np.matmul(patches.transpose(0, 2, 1), patches)
                    if key in sums:
                        np.add(sums[key], gram, out=sums[key])  # float32 widened exactly
                    else:
                        sums[key] = gram.astype(np.float64)
                    so_far = kept.setdefault(key, [])
                    if so_far is not None:
                        so_far.append(patches)
                        total = sum(p.shape[1] for p in so_far)
                        kept[key] = so_far if total < patches.shape[2] else None
                    counted[key] = patches.shape[1]
                source[label] = key
                rows[label] += counted[key]
        rows_of = {key: None if not xs else np.concatenate(xs, axis=1)
                   for key, xs in kept.items()}
        found.append({k: InputMoments(sums[key], rows[k], rows_of.get(key))
                      for k, key in source.items()})
    return found


def _row_offsets(node: onnx.NodeProto, per_channel: np.ndarray, wshape: tuple[int, ...],
                 rows: tuple[int, ...]) -> np.ndarray:
    """`per_channel` laid out as the layer's input rows ([groups, 1, K]): a MatMul's as they
    are, a Conv's each channel repeated over its kernel taps within its group."""
    if node.op_type != "Conv":
        return per_channel.astype(np.float32).reshape(1, 1, -1)
    groups, taps = rows[0], int(np.prod(wshape[2:]))
    grouped = per_channel.astype(np.float32).reshape(groups, -1)
    return np.repeat(grouped, taps, axis=1).reshape(groups, 1, -1)


def conv_rows(node: onnx.NodeProto, x: np.ndarray, wshape: tuple[int, ...],
              rng: np.random.Generator) -> np.ndarray | None:
    """A Conv's input patches at up to MAX_ROWS output positions: [groups, rows, C/group x
    taps], in the order of the weight's [O, C/group, *kernel] rows; None where the input's
    rank does not match the weight's."""
    spatial = len(wshape) - 2
    if x.ndim != spatial + 2:
        return None
    if spatial == 1:  # a 1-D Conv is a 2-D one of height 1
        x, wshape = x[:, :, None, :], (wshape[0], wshape[1], 1, wshape[2])
    groups = int(attribute(node, "group", 1))
    kernel = wshape[2:]
    strides = _pair(attribute(node, "strides", None), spatial, 1)
    dilations = _pair(attribute(node, "dilations", None), spatial, 1)
    batch, channels, height, width = x.shape
    pads = _pads(node, (height, width), kernel, strides, dilations, spatial)
    out_h = (height + pads[0] + pads[2] - dilations[0] * (kernel[0] - 1) - 1) // strides[0] + 1
    out_w = (width + pads[1] + pads[3] - dilations[1] * (kernel[1] - 1) - 1) // strides[1] + 1
    if out_h <= 0 or out_w <= 0:
        return None
    count = batch * out_h * out_w
    picked = rng.choice(count, MAX_ROWS, replace=False) if count > MAX_ROWS else np.arange(count)
    b, rest = np.divmod(picked, out_h * out_w)
    oh, ow = np.divmod(rest, out_w)
    # Input rows and columns of each tap, in the unpadded input ([n, kh], [n, kw]).
    ih = oh[:, None] * strides[0] + np.arange(kernel[0])[None, :] * dilations[0] - pads[0]
    iw = ow[:, None] * strides[1] + np.arange(kernel[1])[None, :] * dilations[1] - pads[1]
    # [n, C, kh, kw], zero in the padding, filled a tap at a time: one gather of the taps
    # inside per tap (broadcasting four index arrays over every value cost ppocr_rec's
    # rounding 4.6 of its 14 s; a padded copy of the whole input costs more where rows are few).
    patches = np.zeros((len(picked), channels, kernel[0], kernel[1]), np.float32)
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            inside = (ih[:, i] >= 0) & (ih[:, i] < height) & (iw[:, j] >= 0) & (iw[:, j] < width)
            patches[inside, :, i, j] = x[b[inside], :, ih[inside, i], iw[inside, j]]
    per_group = channels // groups
    return (patches.reshape(len(picked), groups, per_group * kernel[0] * kernel[1])
            .transpose(1, 0, 2).copy())


def _pair(value: object, spatial: int, default: int) -> tuple[int, int]:
    found = [int(v) for v in value] if value is not None else [default] * spatial  # type: ignore[attr-defined]
    return (1, found[0]) if spatial == 1 else (found[0], found[1])


def _pads(node: onnx.NodeProto, size: tuple[int, int], kernel: tuple[int, ...],
          strides: tuple[int, int], dilations: tuple[int, int], spatial: int) -> tuple[int, ...]:
    """(top, left, bottom, right) padding, from `pads` or `auto_pad`."""
    auto = attribute(node, "auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        found = []
        for n, k, s, d in zip(size, kernel, strides, dilations, strict=True):
            total = max(0, (math.ceil(n / s) - 1) * s + d * (k - 1) + 1 - n)
            small = total // 2
            found.append((small, total - small) if auto == "SAME_UPPER" else (total - small, small))
        return found[0][0], found[1][0], found[0][1], found[1][1]
    pads = [int(p) for p in attribute(node, "pads", None) or [0] * (2 * spatial)]  # type: ignore[attr-defined]
    if spatial == 1:
        return 0, pads[0], 0, pads[1]
    return pads[0], pads[1], pads[2], pads[3]
