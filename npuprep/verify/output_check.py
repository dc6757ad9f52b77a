"""Graph outputs of a lowered model, emulated on the target, against the FP32 reference.

    lowered.onnx -> widen (explicit rounding where it stores the low format) -> run beside FP32
    -> per output: Inf/NaN, max abs error, rel L2, top-K decisions (OutputCheck, truthy on a pass)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from npuprep.data import Feed
from npuprep.numerics import NumberFormat
from npuprep.verify.compare import folds_weight_casts
from npuprep.verify.output_errors import output_passes


@dataclass(frozen=True)
class OutputCheck:
    """Graph outputs of the lowered model, emulated on the target, against the FP32 reference.

    Truthy when no output holds Inf/NaN and every relative L2 error is within `rtol` (or,
    for an output judged by its top-K classes, every decision is the same).
    """

    rtol: float
    samples: int
    outputs: dict[str, dict[str, Any]]
    # Samples whose emulated outputs the compare pass gave (the same numbers, not run again).
    from_compare: int = 0

    def __bool__(self) -> bool:
        return all(output_passes(o, self.rtol) for o in self.outputs.values())

    def to_dict(self) -> dict[str, Any]:
        # The outputs that failed are stored so a report renders them without the gate's rule.
        return {"passed": bool(self), "rtol": self.rtol, "samples": self.samples,
                "failed": sorted(k for k, o in self.outputs.items() if not output_passes(o, self.rtol)),
                "samples_emulated_in_compare": self.from_compare,
                "outputs": {k: dict(v) for k, v in sorted(self.outputs.items())}}


def check_outputs(reference: onnx.ModelProto, lowered: onnx.ModelProto, fmt: NumberFormat, samples: Sequence[Feed], *,
                  saturate: bool, rtol: float, io_types: str = "fp32",
                  host_scales: dict[str, float] | None = None,
                  emulated: onnx.ModelProto | None = None,
                  top_k: Mapping[str, int] | None = None) -> OutputCheck:
    """Run the reference and the lowered model's emulation; per-output Inf/NaN and errors.

    The lowered model is judged by widening it back to FP32 with explicit rounding wherever
    it stores the low format (npuprep.verify.emulate_lowered), and it is also run as-is on
    onnxruntime, which proves it loads and runs. `emulated` replaces that widening (a target
    that cannot pin: every node rounded); outputs in `host_scales` are multiplied back first;
    outputs in `top_k` are also judged by their top-K classes (npuprep.verify.output_errors), where
    a position whose FP32 top values lie within `rtol` of each other is a tie, not a decision.
    """
    return check_output_sets(reference, lowered, fmt, [samples], saturate=saturate, rtol=rtol,
                             io_types=io_types, host_scales=host_scales, emulated=emulated,
                             top_k=top_k)[0]


def check_output_sets(reference: onnx.ModelProto, lowered: onnx.ModelProto, fmt: NumberFormat,
                      sample_sets: Sequence[Sequence[Feed]], *, saturate: bool, rtol: float,
                      io_types: str = "fp32", host_scales: dict[str, float] | None = None,
                      emulated: onnx.ModelProto | None = None,
                      top_k: Mapping[str, int] | None = None,
                      expected: Sequence[dict[str, np.ndarray]] = (),
                      emulated_outputs: Sequence[dict[str, np.ndarray]] = ()) -> list[OutputCheck]:
    """check_outputs on several sets of samples (calibration, held out) with one session per
    model: an OutputCheck per set. `expected`: the reference's outputs on the first samples,
    already run (npuprep.verify.compare.compare_models gives them). `emulated_outputs`: an
    emulation's outputs on the first samples, already run: `emulated`'s own, or, without
    `emulated`, the plan's emulation's, which stand for the lowered model's only where its
    emulation gives the first of them bit for bit (else it runs on every sample)."""
    from npuprep.verify.emulate_lowered import emulate_lowered
    from npuprep.verify.output_errors import OutputErrors

    samples = [feed for feeds in sample_sets for feed in feeds]
    # One session at a time (the outputs are small, the weights are not): the reference, the
    # emulation, then the lowered model as it is on one sample, which proves it loads and runs.
    expected = list(expected[:len(samples)])
    if len(expected) < len(samples):
        expected += _outputs(reference, samples[len(expected):])
    # Past LARGE_WEIGHTS (folds_weight_casts) without graph rewrites: onnxruntime would fold the Casts that widen
    # stored weights into a second, FP32 copy of them (the rounding pairs are kept either way).
    emulation = emulated if emulated is not None else emulate_lowered(lowered, fmt, saturate=saturate).model
    known = list(emulated_outputs[:len(samples)])
    reused = len(known)
    if emulated is None and known:
        # The lowered model's emulation must give the plan's numbers on a sample already run.
        first, *rest = _outputs(emulation, [samples[0], *samples[reused:]],
                                optimize=folds_weight_casts(emulation), produced="the emulated model")
        if not _identical(first, known[0]):
            known = [first, *_outputs(emulation, samples[1:reused], optimize=folds_weight_casts(emulation),
                                      produced="the emulated model")]
            reused = 0
        got = known + rest
    else:
        got = known + _outputs(emulation, samples[reused:], optimize=folds_weight_casts(emulation),
                               produced="the emulated model")
    del emulation
    _outputs(lowered, samples[:1], optimize=folds_weight_casts(lowered), produced="the lowered model")
    host = host_scales or {}
    checks, start = [], 0
    for feeds in sample_sets:
        errors = OutputErrors(top_k=dict(top_k or {}), tie_rtol=rtol)
        for r, c in zip(expected[start:start + len(feeds)], got[start:start + len(feeds)], strict=True):
            for name, rv in r.items():
                if np.issubdtype(np.asarray(rv).dtype, np.floating):
                    errors.add(name, rv, np.asarray(c[name], dtype=np.float64) * host.get(name, 1.0))
        checks.append(OutputCheck(rtol=rtol, samples=len(feeds), outputs=errors.result(),
                                  from_compare=max(0, min(reused - start, len(feeds)))))
        start += len(feeds)
    return checks


def _identical(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    """The same outputs, bit for bit (types and shapes too)."""
    def same(x: np.ndarray, y: np.ndarray) -> bool:
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()

    return a.keys() == b.keys() and all(same(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def _outputs(model: onnx.ModelProto, samples: Sequence[Feed], optimize: bool = True,
             produced: str | None = None) -> list[dict[str, np.ndarray]]:
    """Every output of `model` on each sample; the session is gone when this returns. Each
    model is fed its own input types (a model with FP16 inputs has FP32 ones once widened)."""
    from npuprep.calibrate.run import session_threads
    from npuprep.runtime.session import make_session, release_freed_memory
    from npuprep.verify.compare import run_in_streams, sample_streams

    if not samples:
        return []
    # No prepacked copy of the weights: each session runs few samples (the reference only
    # the held-out ones, the model as lowered one), and the copy would double its memory.
    streams = sample_streams(len(samples))
    session = make_session(model, optimize=optimize, prepack=False, produced=produced, lean=True,
                           threads=session_threads(streams))
    types = {i.name: i.type for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    feeds = [{k: _as_input(v, types.get(k, "")) for k, v in feed.items()} for feed in samples]
    outputs = list(run_in_streams(session, feeds, names, streams))
    del session
    release_freed_memory()
    return outputs


def _as_input(value: np.ndarray, ort_type: str) -> np.ndarray:
    if ort_type == "tensor(float16)":
        return value.astype(np.float16)
    if ort_type == "tensor(float)" and value.dtype == np.float16:
        return value.astype(np.float32)
    return value
