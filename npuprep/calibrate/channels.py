"""Per-channel abs-max of chosen tensors: `x[..., C]` over each sample -> array[samples, C].

The range statistics keep one abs-max per tensor; migrating an outlier channel of a MatMul's
input into its weight (npuprep.rewrite.smooth) needs it per channel (the last axis), read in
one extra pass of the FP32 model over the calibration samples, for those tensors only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

from npuprep.data import Feed


def channel_absmax(model: onnx.ModelProto, tensors: Sequence[str],
                   samples: Sequence[Feed]) -> dict[str, np.ndarray]:
    """tensor -> abs-max per sample and last-axis channel ([samples, channels])."""
    from npuprep.runtime.session import make_session, run

    if not tensors:
        return {}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    declared = {o.name for o in probe.graph.output}
    probe.graph.output.extend(helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None)
                              for t in tensors if t not in declared)
    session = make_session(probe)
    found: dict[str, list[np.ndarray]] = {t: [] for t in tensors}
    for feed in samples:
        for name, value in run(session, feed, list(tensors)).items():
            flat = np.abs(np.asarray(value, np.float32)).reshape(-1, value.shape[-1])
            found[name].append(flat.max(axis=0, initial=0.0))
    return {t: np.stack(v) for t, v in found.items()}
