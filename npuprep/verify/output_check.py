"""Graph outputs of a lowered model, emulated on the target, against the FP32 reference.

    lowered.onnx -> widen (explicit rounding where it stores the low format) -> run beside FP32
    -> per output: Inf/NaN, max abs error, rel L2, top-K decisions (OutputCheck, truthy on a pass)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from npuprep.data import Feed
from npuprep.numerics import NumberFormat
from npuprep.report.output_verdicts import output_passes


@dataclass(frozen=True)
class OutputCheck:
    """Graph outputs of the lowered model, emulated on the target, against the FP32 reference.

    Truthy when no output holds Inf/NaN and every relative L2 error is within `rtol` (or,
    for an output judged by its top-K classes, every decision is the same).
    """

    rtol: float
    samples: int
    outputs: dict[str, dict[str, Any]]

    def __bool__(self) -> bool:
        return all(output_passes(o, self.rtol) for o in self.outputs.values())

    def to_dict(self) -> dict[str, Any]:
        return {"passed": bool(self), "rtol": self.rtol, "samples": self.samples,
                "outputs": {k: dict(v) for k, v in sorted(self.outputs.items())}}


def check_outputs(reference: Any, lowered: Any, fmt: NumberFormat, samples: Sequence[Feed], *,
                  saturate: bool, rtol: float, io_types: str = "fp32",
                  host_scales: dict[str, float] | None = None,
                  emulated: Any = None, top_k: Mapping[str, int] | None = None) -> OutputCheck:
    """Run the reference and the lowered model's emulation; per-output Inf/NaN and errors.

    The lowered model is judged by widening it back to FP32 with explicit rounding wherever
    it stores the low format (npuprep.verify.widen), and it is also run as-is on
    onnxruntime, which proves it loads and runs. `emulated` replaces that widening (a target
    that cannot pin: every node rounded); outputs in `host_scales` are multiplied back first;
    outputs in `top_k` are also judged by their top-K classes (npuprep.verify.output_errors), where
    a position whose FP32 top values lie within `rtol` of each other is a tie, not a decision.
    """
    from npuprep.runtime.session import make_session, run
    from npuprep.verify.output_errors import OutputErrors
    from npuprep.verify.widen import emulate_lowered

    ref = make_session(reference)
    emu = make_session(emulated if emulated is not None
                       else emulate_lowered(lowered, fmt, saturate=saturate).model,
                       produced="the emulated model")
    host = host_scales or {}
    real = make_session(lowered, produced="the lowered model")
    # Each session is fed its own input types (a model with FP16 inputs has FP32 ones once widened).
    typed = [(s, {i.name: i.type for i in s.get_inputs()}) for s in (ref, emu, real)]
    errors = OutputErrors(top_k=dict(top_k or {}), tie_rtol=rtol)
    n = 0
    for feed in samples:
        n += 1
        r, c, _ = (run(sess, {k: _as_input(v, types.get(k, "")) for k, v in feed.items()})
                   for sess, types in typed)
        for name, rv in r.items():
            if np.issubdtype(np.asarray(rv).dtype, np.floating):
                errors.add(name, rv, np.asarray(c[name], dtype=np.float64) * host.get(name, 1.0))
    outputs = errors.result()
    return OutputCheck(rtol=rtol, samples=n, outputs=outputs)


def _as_input(value: np.ndarray, ort_type: str) -> np.ndarray:
    if ort_type == "tensor(float16)":
        return value.astype(np.float16)
    if ort_type == "tensor(float)" and value.dtype == np.float16:
        return value.astype(np.float32)
    return value
