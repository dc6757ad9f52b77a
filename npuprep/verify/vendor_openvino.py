"""OpenVINO's own run of a conversion vs FP32: outputs' error, and what it ran in which precision.

    rewritten FP32 model (or the 8-bit QDQ model) --INFERENCE_PRECISION_HINT--> OpenVINO CPU
        -> outputs x host scale vs the reference's FP32 outputs     VendorCheck.outputs
        -> runtime graph's runtimePrecision per layer vs the plan   VendorCheck.layers

OpenVINO lowers the model itself: an ONNX file's FP16 Cast islands do not survive its CPU
plugin (measured, target_profiles/openvino-cpu.yaml), so it is given the FP32 graph with the
plan's exact rewrites and the precision as a hint, which is how its users deploy.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import onnx

from npuprep.data import Feed
from npuprep.detections import Decision
from npuprep.model_io import Model, fingerprint
from npuprep.profiles import ResolvedTarget
from npuprep.verify.vendor import VendorCheck, vendor_output_errors

if TYPE_CHECKING:
    from npuprep.crosscheck.check import Crosscheck
    from npuprep.plan import Plan


def openvino_check(reference: onnx.ModelProto, candidate: onnx.ModelProto,
                   samples: Sequence[Feed], target: ResolvedTarget, *, plan: Plan | None = None,
                   precision: str | None = None, rtol: float = 1e-2,
                   host_scales: Mapping[str, float] | None = None,
                   top_k: Mapping[str, Decision] | None = None, device: str = "CPU") -> VendorCheck:
    """Compile `candidate` with OpenVINO for `precision` (default: the target's format), run
    `samples`, compare with `reference` in FP32, and crosscheck its runtime layers against
    `plan` (the conversion's)."""
    from npuprep.errors import NpuprepError
    from npuprep.vendors.openvino import run_openvino

    fmt = precision or target.fmt.name
    feeds = [dict(s) for s in samples]
    scales = dict(host_scales or {})
    common = dict(vendor="openvino", target_platform=f"{device}", rtol=rtol,
                  samples=len(feeds), host_scales=scales)
    try:
        done = run_openvino(candidate, feeds, fmt, default=target.weights.name,
                            device=device)
    except NpuprepError as e:
        return VendorCheck(built=False, stage="compile", refusal=str(e), **common)
    report = done.report()
    outputs = vendor_output_errors(reference, samples, done.outputs, scales, rtol, top_k)
    layers = runtime_crosscheck(candidate, report, target, plan)
    return VendorCheck(built=True, stage=f"hint {done.hint}", outputs=outputs,
                       accuracy_report=json.dumps(report, indent=1), layers=layers,
                       **{**common, "target_platform": f"{device}, hint {done.hint}"})


def runtime_crosscheck(model: onnx.ModelProto, report: dict[str, Any], target: ResolvedTarget,
                       plan: Plan | None = None) -> Crosscheck:
    """crosscheck of OpenVINO's runtime report against `plan` (a Plan), on `model`."""
    from npuprep.crosscheck.check import crosscheck
    from npuprep.crosscheck.names import NodeIndex
    from npuprep.crosscheck.openvino import hint_unsupported, read_openvino
    from npuprep.crosscheck.plan_view import decision_of

    named = Model(proto=model, path="the converted model", digest=fingerprint(model))
    index = NodeIndex(named)
    read = read_openvino("openvino runtime model", report, index)
    decision = None if plan is None else decision_of(plan, index, "the conversion's plan")
    checked = crosscheck(named, read, target, index=index, decision=decision)
    # A device without the hint's kernels ran everything wider: its note says so, not _wider's.
    wider = () if hint_unsupported(report) else _wider(checked, target.fmt.name)
    return replace(checked, notes=(*checked.notes, *wider))


def _wider(checked: Crosscheck, planned: str) -> tuple[str, ...]:
    """Where OpenVINO decided otherwise and it costs no accuracy: nodes the plan leaves in the
    target format that it ran wider (under bf16 it keeps elementwise, Softmax and Reduce f32)."""
    from npuprep.crosscheck.record import PRECISION_ORDER

    if planned not in PRECISION_ORDER:
        return ()
    wider = Counter(v.op_type for v in checked.verdicts if v.verdict == "ok" and v.runs_in
                    in PRECISION_ORDER and PRECISION_ORDER.index(v.runs_in) <
                    PRECISION_ORDER.index(planned))
    if not wider:
        return ()
    ops = ", ".join(f"{op} {n}" for op, n in wider.most_common(6))
    return (f"OpenVINO ran {sum(wider.values())} nodes the plan leaves in {planned} wider, its "
            f"own choice ({ops}): slower than planned, not less accurate",)

