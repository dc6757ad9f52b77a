"""Probes compiled and run by OpenVINO's CPU plugin with the format as its precision hint.

    probe.reference (FP32 ONNX) -> compile_model(INFERENCE_PRECISION_HINT f16 | bf16) -> outputs

OpenVINO lowers the FP32 probe itself, so what it runs in FP16 or BF16 (and what it keeps in
FP32) is its own decision, on its real kernels: the outputs are classified like any backend's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from npuprep.probe.backends import expose
from npuprep.probe.micro import ProbeModel


class OpenvinoBackend:
    """One compile per probe; tensors asked for become graph outputs (OpenVINO then stores
    them in FP32 at that point, as it does any output)."""

    def __init__(self, precision: str, device: str = "CPU") -> None:
        from npuprep.vendors.openvino import hint_for

        self.precision = precision
        self.device = device
        self.name = f"openvino({device}, hint {hint_for(precision)})"

    def run(self, probe: ProbeModel, tensors: Sequence[str] = ()) -> dict[str, np.ndarray]:
        from npuprep.vendors.openvino import run_openvino

        model = expose(probe.reference, tensors)
        feeds = {k: np.asarray(v, dtype=np.float32) for k, v in probe.feeds.items()}
        return run_openvino(model, [feeds], self.precision, device=self.device).outputs[0]
