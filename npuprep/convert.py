"""The convert pipeline: findings -> plan -> rewrite (FP32) -> lower -> verify under emulation.

Each stage is its own module; this file only chains them and, when verification names a
first divergent node, pins it and tries again (a bounded number of rounds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from npuprep.analyse.finding import Findings
from npuprep.data import Feed
from npuprep.model_io import Model, fingerprint, with_weights
from npuprep.numerics import NumberFormat, get_format
from npuprep.plan import PinFp32, Plan
from npuprep.profiles import Pinning, TargetProfile

SCHEMA_VERSION = 1
DEFAULT_RTOL = 1e-2


@dataclass(frozen=True)
class OutputCheck:
    """Graph outputs of the lowered model, emulated on the target, against the FP32 reference.

    Truthy when no output holds Inf/NaN and every relative L2 error is within `rtol`.
    """

    rtol: float
    samples: int
    outputs: dict[str, dict[str, float]]

    def __bool__(self) -> bool:
        return all(o["nonfinite"] == 0 and o["rel_l2"] <= self.rtol for o in self.outputs.values())

    def to_dict(self) -> dict[str, Any]:
        return {"passed": bool(self), "rtol": self.rtol, "samples": self.samples,
                "outputs": {k: dict(v) for k, v in sorted(self.outputs.items())}}


@dataclass(frozen=True)
class ConversionResult:
    """Everything `convert` decided and measured; truthy when verification passed."""

    source: Model
    profile: TargetProfile
    fmt: NumberFormat
    findings: Findings
    plan: Plan
    rewritten: Any  # onnx.ModelProto, FP32, same function (up to clamps)
    lowered: Any  # npuprep.rewrite.lower.Lowered
    tensor_scales: dict[str, float]
    pinned_nodes: tuple[str, ...]
    output_check: OutputCheck | None
    layers: Any  # CompareResult of the rewritten graph's emulation, layer by layer
    holdout: OutputCheck | None
    flops_fp32_share: float
    rounds: int
    samples_description: str
    synthetic: bool
    stats: Any = None
    declined: tuple[Any, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def passed(self) -> bool:
        checks = [c for c in (self.output_check, self.holdout) if c is not None]
        return all(checks)

    def __bool__(self) -> bool:
        return self.passed

    @property
    def first_divergent(self) -> Any:
        return None if self.layers is None else self.layers.first_divergent

    def to_dict(self, *, output: str = "") -> dict[str, Any]:
        layers = self.layers.to_dict() if self.layers is not None else None
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "convert",
            "fingerprint": self.source.fingerprint,
            "output_fingerprint": fingerprint(self.lowered.model),
            "model": self.source.path,
            "output": output,
            "target": self.profile.name,
            "profile": self.profile.to_dict(),
            "precision": self.fmt.name,
            "passed": self.passed,
            "samples": {"description": self.samples_description, "synthetic": self.synthetic},
            "findings": self.findings.to_dict(),
            "plan": self.plan.to_dict(),
            "actions": [a.to_dict() for a in self.plan.actions],
            "declined": [d.to_dict() for d in (*self.plan.declined, *self.declined)],
            "pinned_nodes": list(self.pinned_nodes),
            "forced_fp32": dict(sorted(self.lowered.forced_fp32.items())),
            "cast_count": self.lowered.cast_count,
            "flops_fp32_share": self.flops_fp32_share,
            "tensor_scales": dict(sorted(self.tensor_scales.items())),
            "tensors": self.tensor_rows(),
            "verification": self.output_check.to_dict() if self.output_check is not None else None,
            "holdout": self.holdout.to_dict() if self.holdout is not None else None,
            "first_divergent": layers["first_divergent"] if layers and not self.passed else None,
            "compare": layers,
            "rounds": self.rounds,
            "notes": list(self.notes),
        }

    def save(self, path: str | Path, *, exports: Sequence[str] | None = None,
             report_path: str | Path | None = None, html: str | Path | None = None,
             protected: Sequence[str | Path] = ()) -> dict[str, Any]:
        """Write what `npuprep convert` writes: the model at `path`, `<path>.plan.yaml`,
        `<path>.report.json`, `<path>.report.md`, and the constraint files of `exports`
        (None: the target compiler's; names in npuprep.report.artefacts.EXPORTS). Returns the
        report, its `artefacts` naming every file written."""
        from npuprep.report.artefacts import save_conversion

        return save_conversion(self, path, exports=exports, report_path=report_path, html=html,
                               protected=protected)

    def tensor_rows(self) -> list[dict[str, Any]]:
        """Every compared tensor: abs-max before (calibration of the original) and after (what
        the converted model stores, emulated), and the precision it is stored in."""
        if self.layers is None:
            return []
        from npuprep.graph import node_label, producers, walk_graphs

        made_by: dict[str, str] = {}
        for scope in walk_graphs(self.rewritten.graph):
            made_by.update({t: node_label(n) for t, n in producers(scope.graph).items()})
        pinned = set(self.pinned_nodes)
        measured = self.stats.tensors if self.stats is not None else {}
        fmt_max = self.fmt.max
        rows = []
        for t in self.layers.tensors:
            before = measured[t.tensor].absmax if t.tensor in measured else t.ref_absmax
            stored = "fp32" if made_by.get(t.tensor) in pinned else self.fmt.name
            rows.append({
                "tensor": t.tensor, "node": t.node, "op_type": t.op_type,
                "absmax_before": before, "absmax_after": t.cand_absmax, "stored_as": stored,
                "headroom_before": fmt_max / before if before else None,
                "headroom_after": (fmt_max / t.cand_absmax if t.cand_absmax else None)
                if stored != "fp32" else None,
                "scale": t.scale,
            })
        return rows


def convert(
    model: Model,
    profile: TargetProfile,
    samples: Sequence[Feed],
    *,
    stats: Any = None,
    plan: Plan | None = None,
    precision: str | None = None,
    io_types: str = "fp32",
    rtol: float = DEFAULT_RTOL,
    holdout: Sequence[Feed] | None = None,
    samples_description: str = "",
    synthetic: bool = False,
    max_rounds: int = 3,
    opset: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> ConversionResult:
    """Plan (unless a plan is given), rewrite, lower and verify `model` for `profile`.

    `samples` are the calibration samples (verification runs on them); `holdout` verifies
    on samples not used for calibration. `stats` are the calibration statistics (None:
    plan from static findings only). The lowered model keeps the model's default-domain
    opset unless `opset` asks for another (onnx's version converter; a clear error when it
    cannot convert). `progress` is told each stage as it starts (the CLI's spinner).
    """
    from npuprep.analyse import static_findings

    stage = progress or (lambda _: None)
    stage("findings")
    # Rules read constants and the rewrite lowers every weight: a light model gets its values.
    model = with_weights(model)
    from npuprep.plan.planner import make_plan

    fmt = get_format(precision or profile.default_precision)
    findings = static_findings(model, profile)
    if stats is not None:
        from npuprep.analyse.measured import measured_findings

        findings = findings.merged(measured_findings(model, profile, stats, precision))
    if plan is None:
        stage("planning")
        plan = make_plan(model, profile, stats, findings, precision=precision)
    notes: list[str] = []
    result = None
    for round_no in range(1, max_rounds + 1):
        result = _build(model, profile, fmt, plan, samples, io_types=io_types, rtol=rtol,
                        holdout=holdout, opset=opset, stage=lambda s, r=round_no: stage(f"round {r}, {s}"))
        if result["output_check"] or round_no == max_rounds:
            break
        first = result["layers"].first_divergent
        if first is None or not first.node:
            break
        if profile.fp32_pinning is Pinning.NONE:
            notes.append(f"verification failed at '{first.node}'; the target cannot pin FP32")
            break
        targets = _nodes_to_pin(result["rewritten"], first.node, set(result["pinned"]))
        targets = tuple(n for n in targets if n not in plan.forbid_pin)
        if not targets:
            break
        notes.append(f"round {round_no}: outputs failed verification; first divergent node "
                     f"'{first.node}' ({first.op_type}): pinned {', '.join(targets)} and retried")
        pin = PinFp32(nodes=targets, exit_tensors=(), forced=False,
                      request=profile.fp32_pinning is Pinning.COMPILER_DECIDES,
                      why=f"verification round {round_no}: first divergent node {first.node} "
                          f"(rel L2 {first.rel_l2:.3g}, max abs error {first.max_abs_error:.3g})")
        plan = replace(plan, actions=(*plan.actions, pin))
    assert result is not None
    return ConversionResult(
        source=model, profile=profile, fmt=fmt, findings=findings, plan=plan,
        rewritten=result["rewritten"], lowered=result["lowered"],
        tensor_scales=result["scales"], pinned_nodes=tuple(sorted(result["pinned"])),
        output_check=result["output_check"], layers=result["layers"],
        holdout=result["holdout"], flops_fp32_share=result["flops_share"], rounds=round_no,
        samples_description=samples_description, synthetic=synthetic, stats=stats,
        declined=result["declined"], notes=tuple(notes) + result["notes"],
    )


def _nodes_to_pin(rewritten: Any, node: str, pinned: set[str]) -> tuple[str, ...]:
    """The divergent node itself; if it is already FP32, the rounding came in through its
    inputs, so pin their producers instead."""
    if node not in pinned:
        return (node,)
    from npuprep.graph import node_label, producers, walk_graphs

    for scope in walk_graphs(rewritten.graph):
        made_by = producers(scope.graph)
        for n in scope.graph.node:
            if node_label(n) == node:
                ups = {node_label(made_by[i]) for i in n.input if i in made_by}
                return tuple(sorted(u for u in ups if u not in pinned))
    return ()


def _build(model: Model, profile: TargetProfile, fmt: NumberFormat, plan: Plan,
           samples: Sequence[Feed], *, io_types: str, rtol: float,
           holdout: Sequence[Feed] | None, opset: int | None = None,
           stage: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    from npuprep.report.flops import fp32_flops_share
    from npuprep.rewrite.apply import apply_plan
    from npuprep.rewrite.lower import lower
    from npuprep.verify.compare import DEFAULT_ATOL, compare_models, emulation_notes
    from npuprep.verify.emulate import emulate

    stage("rewriting")
    applied = apply_plan(model.proto, plan)
    pinned = set(plan.pinned_nodes()) | set(applied.fp32_nodes)
    lower_fmt = fmt if fmt.name in ("fp16", "bf16") else get_format("fp16")
    stage("lowering")
    lowered = lower(applied.model, lower_fmt, pinned_nodes=sorted(pinned), io_types=io_types)
    pinned |= set(lowered.pinned_nodes)
    if opset is not None:
        from npuprep.opsets import convert_opset

        lowered = replace(lowered, model=convert_opset(lowered.model, opset, why="--opset"))
    stage("emulating and comparing layer by layer")
    emulation = emulate(applied.model, fmt, saturate=profile.saturates, pinned_nodes=pinned)
    layers = compare_models(model.proto, emulation.model, samples, rtol=rtol, atol=DEFAULT_ATOL,
                            tensor_scales=applied.tensor_scales, fmt=fmt)
    notes = list(emulation_notes(profile, profile.saturates))
    if fmt is not lower_fmt:
        notes.append(f"the ONNX artefact is lowered to {lower_fmt.name}; {fmt.name} is emulated, "
                     "quantisation to it is the compiler's job")
    stage("checking the outputs")
    output_check = check_outputs(model.proto, lowered.model, lower_fmt, samples,
                                 saturate=profile.saturates, rtol=rtol, io_types=io_types)
    held = None
    if holdout is not None:
        held = check_outputs(model.proto, lowered.model, lower_fmt, holdout,
                             saturate=profile.saturates, rtol=rtol, io_types=io_types)
    return {
        "rewritten": applied.model, "lowered": lowered, "scales": applied.tensor_scales,
        "pinned": pinned, "layers": layers, "output_check": output_check, "holdout": held,
        "flops_share": fp32_flops_share(applied.model, pinned), "declined": applied.declined,
        "notes": tuple(notes),
    }


def check_outputs(reference: Any, lowered: Any, fmt: NumberFormat, samples: Sequence[Feed], *,
                  saturate: bool, rtol: float, io_types: str = "fp32") -> OutputCheck:
    """Run the reference and the lowered model's emulation; per-output Inf/NaN and errors.

    The lowered model is judged by widening it back to FP32 with explicit rounding wherever
    it stores the low format (npuprep.verify.widen), and it is also run as-is on
    onnxruntime, which proves it loads and runs.
    """
    from npuprep.runtime.session import make_session, run
    from npuprep.verify.widen import emulate_lowered

    ref = make_session(reference)
    emu = make_session(emulate_lowered(lowered, fmt, saturate=saturate).model)
    real = make_session(lowered)
    real_inputs = {i.name: i.type for i in real.get_inputs()}
    acc: dict[str, dict[str, float]] = {}
    n = 0
    for feed in samples:
        n += 1
        r = run(ref, feed)
        c = run(emu, feed)
        run(real, {k: _as_input(v, real_inputs.get(k, "")) for k, v in feed.items()})
        for name, rv in r.items():
            cv = np.asarray(c[name], dtype=np.float64)
            rv = np.asarray(rv, dtype=np.float64)
            if not np.issubdtype(rv.dtype, np.floating):
                continue
            a = acc.setdefault(name, {"nonfinite": 0, "err2": 0.0, "ref2": 0.0, "max_abs_error": 0.0})
            bad = ~np.isfinite(cv)
            a["nonfinite"] += int(bad.sum())
            diff = np.where(bad, 0.0, cv - rv)
            a["err2"] += float((diff**2).sum())
            a["ref2"] += float((rv**2).sum())
            a["max_abs_error"] = max(a["max_abs_error"], float(np.abs(diff).max(initial=0.0)))
    outputs = {
        name: {"nonfinite": a["nonfinite"], "max_abs_error": a["max_abs_error"],
               "rel_l2": float(np.sqrt(a["err2"] / a["ref2"])) if a["ref2"] > 0 else float(np.sqrt(a["err2"]))}
        for name, a in acc.items()
    }
    return OutputCheck(rtol=rtol, samples=n, outputs=outputs)


def _as_input(value: np.ndarray, ort_type: str) -> np.ndarray:
    if ort_type == "tensor(float16)":
        return value.astype(np.float16)
    return value
