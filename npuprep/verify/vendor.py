"""A vendor toolchain's own run of the converted model vs FP32: outputs' error, per-layer report.

    candidate.onnx + samples -> rknn-toolkit2 (FP16 build, simulator) -> outputs x host scale
        vs reference FP32 outputs -> VendorCheck (truthy when finite and within rtol)

Outputs the converted model leaves scaled on the device (host-side output scaling) are
multiplied back by their factor first, as the user's host code does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from npuprep.data import Feed
from npuprep.detections import Decision
from npuprep.profiles import ResolvedTarget
from npuprep.vendors.rockchip import RknnRun
from npuprep.verify.output_errors import OutputErrors, output_passes

VENDORS = ("rknn", "openvino")  # openvino: verify/vendor_openvino.py


@dataclass(frozen=True)
class VendorCheck:
    """What the vendor's simulator gave; truthy when it built the model and every output is
    finite and within `rtol` of FP32."""

    vendor: str
    target_platform: str
    rtol: float
    samples: int
    built: bool
    stage: str
    refusal: str = ""
    outputs: dict[str, dict[str, float]] = field(default_factory=dict)
    host_scales: dict[str, float] = field(default_factory=dict)
    range_warnings: tuple[str, ...] = ()
    accuracy_report: str = ""
    layers: Any = None  # crosscheck.Crosscheck of the accuracy report, when one was written
    eight_bit: dict[str, Any] = field(default_factory=dict)  # verify.vendor_8bit's paths
    # When the tool refused or crashed: the nodes it breaks on (verify.vendor_bisect), and the
    # exactly rewritten model it then built, which this check is of.
    bisection: dict[str, Any] | None = None
    fixed_model: Any = field(default=None, repr=False)

    def __bool__(self) -> bool:
        return self.built and all(output_passes(o, self.rtol) for o in self.outputs.values())

    def to_dict(self) -> dict[str, Any]:
        layers = None
        if self.layers is not None:
            layers = {"passed": bool(self.layers), "counts": self.layers.counts,
                      "non_finite": [v.to_dict() for v in self.layers.of("non-finite")],
                      # Nodes the compiler ran otherwise than the plan decided.
                      "disagree": [v.node for v in self.layers.verdicts
                                   if v.verdict in ("mismatch", "pin-ignored")],
                      "notes": list(self.layers.notes)}
        return {
            "vendor": self.vendor, "target_platform": self.target_platform, "passed": bool(self),
            "built": self.built, "stage": self.stage, "refusal": self.refusal, "rtol": self.rtol,
            "samples": self.samples, "outputs": {k: dict(v) for k, v in sorted(self.outputs.items())},
            "host_scales": dict(sorted(self.host_scales.items())),
            "range_warnings": list(self.range_warnings), "layers": layers,
            "bisection": self.bisection,
        } | ({"eight_bit": self.eight_bit} if self.eight_bit else {})


def vendor_check(
    reference: onnx.ModelProto,
    candidate: onnx.ModelProto,
    samples: Sequence[Feed],
    *,
    vendor: str = "rknn",
    python: str | None = None,
    target_platform: str = "rk3588",
    rtol: float = 1e-2,
    host_scales: Mapping[str, float] | None = None,
    work_dir: str | Path | None = None,
    bisect: bool = False,
) -> VendorCheck:
    """Build `candidate` with the vendor toolchain, run its simulator on `samples`, compare the
    outputs (times `host_scales`) with `reference`'s FP32 outputs.

    With `bisect`, a refusal or crash is narrowed to its nodes; where an exact rewrite of them
    builds, the check is of the rewritten model (`fixed_model`)."""
    from npuprep.errors import NpuprepError
    from npuprep.vendors.rockchip import require_python, run_rknn

    if vendor not in VENDORS:
        raise NpuprepError(f"unknown vendor '{vendor}' (known: {', '.join(VENDORS)})")
    exe = require_python(python)
    feeds = [{k: np.asarray(v, dtype=np.float32) for k, v in s.items()} for s in samples]
    done = run_rknn(candidate, feeds, python=exe, target_platform=target_platform, accuracy=True,
                    work_dir=work_dir)
    scales = dict(host_scales or {})
    common = dict(vendor=vendor, target_platform=target_platform, rtol=rtol, samples=len(feeds),
                  stage=done.stage, host_scales=scales,
                  range_warnings=tuple(dict.fromkeys(w["tensor"] for w in done.range_warnings)),
                  accuracy_report=done.accuracy_report)
    if not done:
        if bisect:
            return _after_refusal(reference, candidate, samples, done, exe, target_platform, rtol,
                                  scales, work_dir, VendorCheck(built=False, refusal=done.refusal,
                                                                **common))
        return VendorCheck(built=False, refusal=done.refusal, **common)
    outputs = vendor_output_errors(reference, samples, done.outputs, scales, rtol)
    return VendorCheck(built=True, outputs=outputs, **common)


def vendor_output_errors(reference: onnx.ModelProto, samples: Sequence[Feed],
                   got_all: Sequence[Mapping[str, np.ndarray]], scales: Mapping[str, float],
                   rtol: float, top_k: Mapping[str, Decision] | None = None) -> dict[str, dict[str, Any]]:
    """Per output: the vendor's outputs (times `scales`) against `reference` in onnxruntime."""
    from npuprep.runtime.session import make_session, run

    ref = make_session(reference)
    errors = OutputErrors(top_k=dict(top_k or {}), tie_rtol=rtol)
    for sample, got in zip(samples, got_all, strict=False):
        # The toolkit takes float32 feeds; the reference its own input types (a bool flag).
        expected = run(ref, {k: np.asarray(v) for k, v in sample.items()})
        for name, rv in expected.items():
            if name not in got or not np.issubdtype(np.asarray(rv).dtype, np.floating):
                continue
            cv = np.asarray(got[name], dtype=np.float64) * scales.get(name, 1.0)
            errors.add(name, rv, cv.reshape(np.shape(rv)) if cv.size == np.size(rv) else cv)
    return errors.result()


def _after_refusal(reference: onnx.ModelProto, candidate: onnx.ModelProto,
                   samples: Sequence[Feed], done: RknnRun, exe: Path, target_platform: str,
                   rtol: float, scales: dict[str, float], work_dir: str | Path | None,
                   refused: VendorCheck) -> VendorCheck:
    """`refused` with the nodes the tool breaks on; the check of the exact rewrite that builds."""
    from dataclasses import replace

    from npuprep.vendors.bisection import Attempt
    from npuprep.verify.vendor_bisect import bisect_vendor, rknn_build

    found = bisect_vendor(candidate, samples[0], Attempt(False, done.stage, done.refusal),
                          rknn_build(exe, target_platform), reference=reference)
    if not found:
        return replace(refused, bisection=found.to_dict())
    again = vendor_check(reference, found.fixed, samples, python=str(exe),
                         target_platform=target_platform, rtol=rtol, host_scales=scales,
                         work_dir=work_dir)
    return replace(again, bisection=found.to_dict(), fixed_model=found.fixed)


def with_layers(check: VendorCheck, candidate: Any, target: ResolvedTarget,
                report_path: str) -> VendorCheck:
    """`check` with its accuracy_analysis report read back through crosscheck (against the
    model the vendor built: its tensor names are the report's layer names)."""
    from dataclasses import replace

    from npuprep.crosscheck.check import crosscheck
    from npuprep.crosscheck.names import NodeIndex
    from npuprep.crosscheck.rknn import read_rknn

    if not check.accuracy_report:
        return check
    index = NodeIndex(candidate)
    report = read_rknn(report_path, check.accuracy_report, index)
    return replace(check, layers=crosscheck(candidate, report, target, index=index))
