"""Probes built and run by rknn-toolkit2 (FP16 build, x86 simulator) in its own venv.

    probe.reference (FP32 ONNX) -> rknn_job.py: load_onnx, build(do_quantization=False),
    init_runtime() (simulator), inference -> outputs classified like any backend's
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from npuprep.errors import NpuprepError
from npuprep.probe.backends import expose
from npuprep.probe.micro import ProbeModel


class RknnBackend:
    """The toolkit compiles the FP32 probe itself: what it runs in FP16 is its own decision."""

    def __init__(self, python: str | Path | None = None, target_platform: str = "rk3588") -> None:
        from npuprep.vendors.rockchip import require_python

        self.python = require_python(str(python) if python else None)
        self.target_platform = target_platform
        self.name = f"rknn({target_platform} simulator)"

    def run(self, probe: ProbeModel, tensors: Sequence[str] = ()) -> dict[str, np.ndarray]:
        from npuprep.vendors.rockchip import run_rknn

        model = expose(probe.reference, tensors)
        feeds = {k: np.asarray(v, dtype=np.float32) for k, v in probe.feeds.items()}
        result = run_rknn(model, [feeds], python=self.python, target_platform=self.target_platform)
        if not result:
            raise NpuprepError(f"probe '{probe.name}': rknn-toolkit2 refused it in {result.stage}: "
                               f"{result.refusal}")
        shapes = {o.name: _shape(o) for o in model.graph.output}
        return {name: _reshaped(value, shapes.get(name)) for name, value in result.outputs[0].items()}


def _shape(info) -> tuple[int, ...] | None:
    dims = info.type.tensor_type.shape.dim if info.type.tensor_type.HasField("shape") else ()
    values = tuple(d.dim_value for d in dims)
    return values if values and all(v > 0 for v in values) else None


def _reshaped(value: np.ndarray, shape: tuple[int, ...] | None) -> np.ndarray:
    # The toolkit may hand outputs back with its own 4-D padding of the shape.
    if shape is not None and value.size == int(np.prod(shape)):
        return value.reshape(shape)
    return value
