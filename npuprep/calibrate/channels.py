"""Per-channel statistics of chosen tensors: abs-max (or min and max) per sample and channel
-> array[samples, C], and means per channel of any axis.

The range statistics keep one abs-max per tensor; migrating an outlier channel of a MatMul's
input into its weight (npuprep.rewrite.smooth) needs it per channel (the last axis), read in
one extra pass of the FP32 model over the calibration samples, for those tensors only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper

from npuprep.data import Feed
from npuprep.graph import infer_tensors
from npuprep.numerics import COMPUTE_FLOAT_TYPES


def channel_absmax(model: onnx.ModelProto, tensors: Sequence[str], samples: Sequence[Feed], *,
                   axis: int = -1) -> dict[str, np.ndarray]:
    """tensor -> abs-max per sample and channel of `axis` (the last: a MatMul's input; 1: a
    Conv's) as [samples, channels]."""
    return {t: v[0] for t, v in _per_channel(
        model, tensors, samples, axis,
        lambda flat: (np.abs(flat).max(axis=0, initial=0.0),)).items()}


def channel_extremes(model: onnx.ModelProto, tensors: Sequence[str], samples: Sequence[Feed], *,
                     axis: int = -1) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """tensor -> (min, max, share of values exactly zero) per sample and channel of `axis`,
    each [samples, channels]."""
    return {t: (v[0], v[1], v[2]) for t, v in _per_channel(
        model, tensors, samples, axis,
        lambda flat: (flat.min(axis=0, initial=np.inf), flat.max(axis=0, initial=-np.inf),
                      (flat == 0).mean(axis=0) if len(flat) else np.zeros(flat.shape[1]))
    ).items()}


def _per_channel(model: onnx.ModelProto, tensors: Sequence[str], samples: Sequence[Feed],
                 axis: int, reduce: Callable[[np.ndarray], tuple[np.ndarray, ...]]
                 ) -> dict[str, tuple[np.ndarray, ...]]:
    """tensor -> `reduce` of each sample's values as [values, channels of `axis`], stacked
    over the samples: one pass of the FP32 model for these tensors."""
    from npuprep.calibrate.run import pass_streams, session_threads
    from npuprep.runtime.session import run_in_streams

    if not tensors:
        return {}
    streams = pass_streams(len(samples))
    session = probe_session(model, tensors, threads=session_threads(streams))
    found: dict[str, list[tuple[np.ndarray, ...]]] = {t: [] for t in tensors}
    for values in run_in_streams(session, samples, list(tensors), streams):
        for name, value in values.items():
            moved = np.moveaxis(np.asarray(value, np.float32), axis, -1)
            found[name].append(reduce(moved.reshape(-1, moved.shape[-1])))
    return {t: tuple(np.stack(parts) for parts in zip(*v, strict=True))
            for t, v in found.items()}


def leave_one_out_raise(per_sample: np.ndarray,
                        multiplier: Callable[[np.ndarray], np.ndarray]) -> float:
    """How far an unseen sample passes the clip of a tensor rescaled per channel: each sample
    of `per_sample` ([samples, channels] abs-max) left out in turn, the channels multiplied by
    `multiplier` of the others' abs-max per channel (the factors a conversion would have fitted
    without it) and its peak over the others' peak; the largest of these, at least 1.

    Equalisation and balancing raise each quiet channel to the loud ones' range, so every
    sample reaches the top through some channel and the per-sample abs-maxima stop spreading:
    face_landmark's depthwise inputs balanced, their clips kept 1.00x headroom by that spread
    where a sample left out passed them by 1.3-4.2x and the held-out crops by 1.1-2.9x."""
    if per_sample.shape[0] < 3:
        # Fewer samples give no spread worth extrapolating from (scales.MIN_SPREAD_SAMPLES).
        return 1.0
    worst = 1.0
    for k in range(per_sample.shape[0]):
        others = np.delete(per_sample, k, axis=0)
        m = multiplier(others.max(axis=0))
        peak = float((others * m).max())
        if peak > 0:
            worst = max(worst, float((per_sample[k] * m).max()) / peak)
    return worst


def channel_means(model: onnx.ModelProto, tensors: Mapping[str, int],
                  samples: Sequence[Feed]) -> dict[str, np.ndarray]:
    """tensor -> its mean per channel of axis `tensors[tensor]`, over every other axis and
    every sample (the input means bias correction reads, npuprep.rewrite.bias_correction)."""
    from npuprep.calibrate.run import pass_streams, session_threads
    from npuprep.runtime.session import run_in_streams

    if not tensors:
        return {}
    streams = pass_streams(len(samples))
    session = probe_session(model, tensors, threads=session_threads(streams))
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = dict.fromkeys(tensors, 0)
    # In sample order whatever runs at once: the float64 sums are the same left fold.
    for values in run_in_streams(session, samples, list(tensors), streams):
        for name, value in values.items():
            moved = np.moveaxis(np.asarray(value, np.float64), tensors[name], -1)
            flat = moved.reshape(-1, moved.shape[-1])
            sums[name] = sums.get(name, 0.0) + flat.sum(axis=0)
            counts[name] += flat.shape[0]
    return {t: (sums[t] / max(counts[t], 1)).astype(np.float32) for t in sums}


def probe_session(model: onnx.ModelProto, tensors: Iterable[str], *,
                  threads: int | None = None) -> Any:
    """A session of `model` that also returns `tensors` as outputs (on `threads` intra-op
    threads, default onnxruntime's)."""
    from npuprep.runtime.session import make_session

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    declared = {o.name for o in probe.graph.output}
    g = model.graph
    # An FP16 or BF16 model's tensors are declared as they are: as FLOAT, onnxruntime refuses it.
    wide = all(t == onnx.TensorProto.FLOAT for t in
               [*(i.type.tensor_type.elem_type for i in g.input), *(i.data_type for i in g.initializer)]
               if t in COMPUTE_FLOAT_TYPES)
    types = {} if wide else infer_tensors(model).types
    probe.graph.output.extend(
        helper.make_tensor_value_info(t, types.get(t, onnx.TensorProto.FLOAT), None)
        for t in tensors if t not in declared)
    return make_session(probe, threads=threads,
                        produced="the model with its layers' inputs as outputs")
