"""The convert pipeline, in one screen:

    target = profile.resolve(precision)                      profiles.ResolvedTarget
    prepared = prepare_for_target(model, target, ...)        rewrite/passes.py (PRE_PLAN_PASSES)
    findings = findings_for(prepared.model, target, stats)   analyse/
    plan = make_plan(prepared.model, target, stats, ...)     plan/ (one remedy per file)
    for each round:
        build = _build(...)   apply_plan -> lower -> emulate -> compare -> check outputs
        pin = rounds.propose(build, plan)                     verify/pin_rounds.py
    share = fp32_share(...)                                   report/share.py

Each stage is its own module; this file only chains them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from npuprep.analyse import findings_for
from npuprep.analyse.finding import Findings
from npuprep.data import Feed
from npuprep.errors import NpuprepError
from npuprep.graph import weight_bytes
from npuprep.ledger.ledger import build_ledger
from npuprep.model_io import Model, WeightScratch, anchored, fingerprint
from npuprep.numerics import NumberFormat, eight_bit_format
from npuprep.plan import Plan
from npuprep.plan.planner import make_plan
from npuprep.plan.remedies import remedied
from npuprep.profiles import Pinning, ResolvedTarget, TargetProfile
from npuprep.provenance import record_source
from npuprep.report.share import DEFAULT_MAX_FP32_SHARE, fp32_share
from npuprep.rewrite.apply import apply_plan
from npuprep.rewrite.lower import lower
from npuprep.rewrite.passes import prepare_for_target
from npuprep.verify.compare import DEFAULT_ATOL, compare_models, emulation_notes
from npuprep.verify.emulate import emulate
from npuprep.verify.output_check import OutputCheck, check_output_sets
from npuprep.verify.pin_rounds import Build, PinRounds, sample_shapes

SCHEMA_VERSION = 1
# Models with at least this many bytes of weights keep their lowered weights in a scratch
# file while they are verified (npuprep.model_io.WeightScratch), not in memory.
SCRATCH_BYTES = 64 * 2**20
DEFAULT_RTOL = 1e-2


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
    # Outputs that leave the device scaled (target cannot pin): output -> host factor.
    host_scales: dict[str, float] = field(default_factory=dict)
    share: Any = None  # npuprep.report.share.Fp32Share
    # Per verification round that traced a precision failure to layers (verify.attribution).
    error_attribution: tuple[dict[str, Any], ...] = ()
    ledger: dict[str, Any] | None = None  # npuprep.ledger: estimated time per format, the pins' cost
    # 8-bit conversions (npuprep.convert_8bit): format, scale rule, multiply-add shares, ranking.
    eight_bit: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        """Outputs within tolerance under emulation, and the FP32 share within its limit:
        a model left mostly in FP32 has not been converted."""
        checks = [c for c in (self.output_check, self.holdout, self.share) if c is not None]
        if self.eight_bit:
            e = self.eight_bit
            checks.append(e["mac_share"][e["format"]] >= e["min_8bit_share"])
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
            "precision": self.eight_bit["format"] if self.eight_bit else self.fmt.name,
            "passed": self.passed,
            "samples": {"description": self.samples_description, "synthetic": self.synthetic},
            # Each finding with what the applied plan did for it, not the rule's suggestion.
            "findings": remedied(self.findings, self.plan, self.host_scales).to_dict(),
            "plan": self.plan.to_dict(),
            "actions": [a.to_dict() for a in self.plan.actions],
            "declined": [d.to_dict() for d in (*self.plan.declined, *self.declined)],
            "pinned_nodes": list(self.pinned_nodes),
            "forced_fp32": dict(sorted(self.lowered.forced_fp32.items())),
            "cast_count": self.lowered.cast_count,
            "flops_fp32_share": self.flops_fp32_share,
            "fp32_share": self.share.to_dict() if self.share is not None else None,
            "fp32_verdict": self.share.verdict() if self.share is not None else "",
            "tensor_scales": dict(sorted(self.tensor_scales.items())),
            "host_scales": dict(sorted(self.host_scales.items())),
            "tensors": self.tensor_rows(),
            "verification": self.output_check.to_dict() if self.output_check is not None else None,
            "holdout": self.holdout.to_dict() if self.holdout is not None else None,
            "first_divergent": layers["first_divergent"] if layers and not self.passed else None,
            "compare": layers,
            "rounds": self.rounds,
            "error_attribution": list(self.error_attribution),
            "ledger": self.ledger,
            "notes": list(self.notes),
        } | ({"eight_bit": self.eight_bit} if self.eight_bit else {})

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
    max_fp32_share: float = DEFAULT_MAX_FP32_SHARE,
    opset: int | None = None,
    top_k: Mapping[str, int] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ConversionResult:
    """Plan (unless a plan is given), rewrite, lower and verify `model` for `profile`.

    `samples` are the calibration samples (verification runs on them); `holdout` verifies
    on samples not used for calibration. `stats` are the calibration statistics (None:
    plan from static findings only). The result fails when more than `max_fp32_share` of
    the FLOPs stay FP32. The lowered model keeps the model's default-domain opset unless
    `opset` asks for another (onnx's version converter; a clear error when it cannot).
    `top_k` {output: K} also passes an output whose top-K classes along the last axis agree
    everywhere (a classifier judged by its decisions). `progress` is told each stage as it
    starts (the CLI's spinner).
    """
    if eight_bit_format(profile.precision_of(precision)) is not None:
        raise NpuprepError(f"{profile.precision_of(precision)} is an 8-bit format: "
                           "npuprep.convert_8bit.convert_8bit writes its QDQ model")
    stage = progress or (lambda _: None)
    stage("findings")
    # Rules and rewrites read each weight from the user's file as they need it.
    model = anchored(model)
    top_k = _checked_top_k(model, top_k)
    target = profile.resolve(precision)
    prepared, findings, plan = plan_for_target(model, target, stats, samples, plan, stage)
    work, stats = prepared.model, prepared.stats
    rounds = PinRounds(target, samples, rtol=rtol, max_fp32_share=max_fp32_share,
                       notes=list(prepared.notes))
    tried: tuple[Plan, Build] | None = None  # the plan before the last verification pin
    for round_no in range(1, max_rounds + 1):
        build = _build(work, target, plan, samples, io_types=io_types, rtol=rtol,
                       holdout=holdout, stats=stats, opset=opset, top_k=top_k,
                       stage=lambda s, r=round_no: stage(f"round {r}, {s}"))
        if tried is not None and not rounds.keeps(tried[1], build, round_no):
            plan, build = tried
            round_no -= 1
            break
        if build.output_check or round_no == max_rounds:
            break
        pin = rounds.propose(build, plan, round_no, stage)
        if pin is None:
            break
        tried = (plan, build)
        plan = replace(plan, actions=(*plan.actions, pin))
    # The converted model names its source, so the source's stats apply to it by name.
    record_source(build.lowered.model, model.fingerprint, build.tensor_scales)
    share = fp32_share(build.rewritten, _fp32_groups(plan, build, stats, target.fmt),
                       limit=max_fp32_share, input_shapes=sample_shapes(samples))
    ledger = build_ledger(build.rewritten, target, name=model.path,
                          input_shapes=sample_shapes(samples), pinned=sorted(build.pinned),
                          converted=build.lowered.model).to_dict(nodes=False)
    return ConversionResult(
        source=model, profile=profile, fmt=target.fmt, findings=findings, plan=plan,
        rewritten=build.rewritten, lowered=build.lowered,
        tensor_scales=build.tensor_scales, pinned_nodes=tuple(sorted(build.pinned)),
        output_check=build.output_check, layers=build.layers,
        holdout=build.holdout, flops_fp32_share=share.flops, rounds=round_no,
        samples_description=samples_description, synthetic=synthetic, stats=stats,
        declined=build.declined, notes=tuple(rounds.notes) + build.notes, share=share,
        host_scales=build.host_scales, error_attribution=tuple(rounds.attributions), ledger=ledger,
    )


def plan_for_target(model: Model, target: ResolvedTarget, stats: Any, samples: Sequence[Feed],
                    plan: Plan | None, stage: Callable[[str], None]) -> tuple[Any, Findings, Plan]:
    """What the target's compiler can take (the pre-plan passes), its findings, and the plan
    for it (`plan` when the user gave one): what gets rewritten and verified."""
    prepared = prepare_for_target(model, target, stats, samples)
    findings = findings_for(prepared.model, target, prepared.stats)
    if plan is None:
        stage("planning")
        plan = make_plan(prepared.model, target, prepared.stats, findings)
        plan = replace(plan, notes=(*prepared.notes, *plan.notes))
    return prepared, findings, plan


def _checked_top_k(model: Model, top_k: Mapping[str, int] | None) -> dict[str, int]:
    from npuprep.errors import NpuprepError

    outputs = {o.name for o in model.proto.graph.output}
    for name, k in (top_k or {}).items():
        if name not in outputs:
            raise NpuprepError(f"--top-k names '{name}', which is not an output of {model.path} "
                               f"(outputs: {', '.join(sorted(outputs))})")
        if not isinstance(k, int) or k < 1:
            raise NpuprepError(f"--top-k {name}: K must be a whole number >= 1, not {k!r}")
        out = next(o for o in model.proto.graph.output if o.name == name)
        dims = out.type.tensor_type.shape.dim
        if dims and dims[-1].HasField("dim_value") and k >= dims[-1].dim_value:
            raise NpuprepError(f"--top-k {name}:{k}: output '{name}' has {dims[-1].dim_value} classes along "
                               f"its last axis; K must be smaller (K = all of them judges nothing)")
    return dict(top_k or {})


def _fp32_groups(plan: Plan, build: Build, stats: Any,
                 fmt: NumberFormat) -> list[tuple[tuple[str, ...], str, str, bool]]:
    """The FP32 nodes of a conversion as (nodes, why, declined remedy, required): the plan's
    islands, what lowering forced, what the rewrites inserted, then anything else kept FP32.
    An island is required when an exit's measured range exceeds the format (it can only
    close at an output kept FP32) or when its ops have no kernel in the low format."""
    groups: list[tuple[tuple[str, ...], str, str, bool]] = []
    declined = list(plan.declined) + list(build.declined)
    no_low_kernel = _fixed_fp32_nodes(build.rewritten)
    for pin in plan.pins():
        refs = set(pin.findings)
        mine = [d for d in declined if refs & set(d.findings)]
        first = next((d for d in mine if d.remedy == "rescale"), mine[0] if mine else None)
        why = pin.why.split(" | ")[0]
        required = not pin.forced and (
            any(not _fits_format(stats, t, fmt) and stats is not None and t in stats.tensors
                for t in pin.exit_tensors) or set(pin.nodes) <= no_low_kernel)
        instead = f"{first.remedy} declined: {first.reason}" if first else (
            "forced: the plan asks for FP32" if pin.forced else
            "no remedy planned: verification pinned it" if not pin.findings else "")
        groups.append((pin.nodes, why, instead, required))
    for node, reason in sorted(build.lowered.forced_fp32.items()):
        groups.append(((node,), f"lowering: {reason}", "", node in no_low_kernel))
    by_reason: dict[str, list[str]] = {}
    for node in sorted(build.boundary):
        by_reason.setdefault(build.fp32_reasons.get(node, "inserted by a rewrite"), []).append(node)
    groups += [(tuple(nodes), why, "", False) for why, nodes in sorted(by_reason.items())]
    groups.append((tuple(sorted(build.pinned)), "kept FP32", "", False))
    return groups


def _fixed_fp32_nodes(model: Any) -> set[str]:
    """Nodes whose FP32 no remedy can change: ops of other domains (`ai.onnx.ml` has no FP16
    kernels) and ops whose output type an attribute fixes (npuprep.rewrite.lower)."""
    from npuprep.graph import node_label, walk_graphs
    from npuprep.rewrite.lower import FORCED_FP32_OPS

    return {node_label(n) for scope in walk_graphs(model.graph) for n in scope.graph.node
            if n.domain not in ("", "ai.onnx") or n.op_type in FORCED_FP32_OPS}


def _build(model: Model, target: ResolvedTarget, plan: Plan,
           samples: Sequence[Feed], *, io_types: str, rtol: float,
           holdout: Sequence[Feed] | None, stats: Any = None,
           opset: int | None = None, top_k: Mapping[str, int] | None = None,
           stage: Callable[[str], None] = lambda _: None) -> Build:
    """One round: apply `plan`, lower, emulate layer by layer and check the outputs."""
    profile, fmt, saturate = target.profile, target.fmt, target.saturate
    stage("rewriting")
    applied = apply_plan(model.proto, plan)
    # A target that cannot pin runs every node in its format: emulate it so (a PASSED then
    # matches the device) and move output compensations it cannot hold to the host.
    no_pin = profile.fp32_pinning is Pinning.NONE
    applied, host_scales, host_notes = _host_scales(model, applied, target, stats, samples) \
        if no_pin else (applied, {}, ())
    pinned = set(plan.pinned_nodes()) | set(applied.fp32_nodes)
    pinned |= {n for n, inp in applied.input_nodes.items() if not _fits_format(stats, inp, fmt)}
    lower_fmt = target.weights
    stage("lowering")
    lowered = lower(applied.model, lower_fmt, pinned_nodes=sorted(pinned), io_types=io_types,
                    scratch=WeightScratch() if weight_bytes(applied.model) >= SCRATCH_BYTES else None)
    pinned |= set(lowered.pinned_nodes)
    if opset is not None:
        from npuprep.opsets import convert_opset

        lowered = replace(lowered, model=convert_opset(lowered.model, opset, why="--opset"))
    stage("emulating and comparing layer by layer")
    # A target that cannot pin emulates every node in its format but BatchNorms folded at
    # build time; elsewhere an If that only carries a pinned branch node's FP32 output is not
    # rounded either.
    emulation = emulate(applied.model, fmt, saturate=saturate,
                        pinned_nodes=_folded_at_build(applied.model, lowered) if no_pin
                        else pinned | set(lowered.fp32_output_nodes), weights_in_graph=True)
    reference: list[dict[str, np.ndarray]] = []
    emulated: list[dict[str, np.ndarray]] = []
    layers = compare_models(model.proto, emulation.model, samples, rtol=rtol, atol=DEFAULT_ATOL,
                            tensor_scales=applied.tensor_scales, fmt=fmt, reference_outputs=reference,
                            candidate_outputs=emulated,
                            # The candidate is the emulation of the rewritten model, named by
                            # its source: hashing either would read every weight again.
                            fingerprints=(model.fingerprint, f"{fmt.name}-emulated:{model.fingerprint}"))
    notes = list(emulation_notes(target, saturate)) + list(host_notes)
    if no_pin:
        notes.append(f"target {profile.name} cannot pin FP32 (fp32_pinning: none): every node "
                     f"is emulated in {fmt.name}, FP32 islands of the ONNX file included")
    if fmt is not lower_fmt:
        notes.append(f"the ONNX artefact is lowered to {lower_fmt.name}; {fmt.name} is emulated, "
                     "quantisation to it is the compiler's job")
    everywhere = emulation.model if no_pin else None
    del emulation  # its copy of the graph is not needed for the output check elsewhere
    stage("checking the outputs")
    checks = check_output_sets(model.proto, lowered.model, lower_fmt,
                               [samples] + ([holdout] if holdout is not None else []),
                               saturate=saturate, rtol=rtol, io_types=io_types,
                               host_scales=host_scales, emulated=everywhere, top_k=top_k,
                               expected=reference, emulated_outputs=emulated)
    output_check, held = checks[0], (checks[1] if holdout is not None else None)
    return Build(
        rewritten=applied.model, lowered=lowered, tensor_scales=applied.tensor_scales,
        pinned=frozenset(pinned), layers=layers, output_check=output_check, holdout=held,
        declined=tuple(applied.declined), notes=tuple(notes), host_scales=host_scales,
        boundary=frozenset(set(applied.fp32_nodes) | (set(applied.input_nodes) & pinned)),
        fp32_reasons=dict(applied.fp32_reasons))


def _folded_at_build(model: Any, lowered: Any) -> set[str]:
    """BatchNormalizations whose weights lowering kept FP32: a compiler that cannot pin still
    folds them into a scale and shift in FP32 at build time (rknn-toolkit2 reports a fused
    `[Conv] bn` layer), so their raw variances never meet FP16; emulation rounds their
    result only."""
    from npuprep.graph import node_label

    ops = {node_label(n): n.op_type for n in model.graph.node}
    return {n for n in lowered.forced_fp32 if ops.get(n) == "BatchNormalization"}


def _host_scales(model: Model, applied: Any, target: ResolvedTarget, stats: Any,
                 samples: Sequence[Feed]) -> tuple[Any, dict[str, float], tuple[str, ...]]:
    """Rescale exits at graph outputs whose true range exceeds the limit leave the device
    scaled (npuprep.plan.host_scale decides, npuprep.rewrite.output_scale rewrites)."""
    from npuprep.plan.host_scale import factor_words, host_scaled_outputs
    from npuprep.rewrite.output_scale import leave_output_scaled

    producer = {o: n.name for n in applied.model.graph.node for o in n.output}
    exits = [o.name for o in applied.model.graph.output
             if producer.get(o.name) in set(applied.fp32_nodes)]
    if not exits:
        return applied, {}, ()
    chosen = host_scaled_outputs(exits, _output_absmax(model, stats, samples, exits), target)
    current, fp32_nodes = applied.model, list(applied.fp32_nodes)
    scales, host, notes = dict(applied.tensor_scales), {}, []
    for name, why in chosen.items():
        done = leave_output_scaled(current, name)
        if not done:
            notes.append(f"output '{name}' cannot be scaled on the host: {done.reason}")
            continue
        current = done.model
        factor = float(done.details["host_scales"][name])
        host[name] = factor
        scales[name] = 1.0 / factor
        fp32_nodes.remove(str(done.details["removed"]))
        times = factor_words(factor)
        by = factor_words(1.0 / factor) if factor < 1 else f"1/{times}"
        notes.append(f"output '{name}' leaves the device scaled by {by} ({why}); "
                     f"multiply it by {times} on the host (report key host_scales)")
    return (replace(applied, model=current, fp32_nodes=tuple(fp32_nodes), tensor_scales=scales),
            host, tuple(notes))


def _output_absmax(model: Model, stats: Any, samples: Sequence[Feed],
                   names: list[str]) -> dict[str, float]:
    """True |max| of graph outputs: from the calibration statistics, else a reference run."""
    if stats is not None and all(n in stats.tensors for n in names):
        return {n: float(stats.tensors[n].absmax) for n in names}
    from npuprep.runtime.session import make_session, run

    session = make_session(model.proto)
    found = dict.fromkeys(names, 0.0)
    for feed in samples:
        out = run(session, feed)
        for n in names:
            if n in out:
                found[n] = max(found[n], float(np.nanmax(np.abs(out[n]), initial=0.0)))
    return found


def _fits_format(stats: Any, tensor: str, fmt: NumberFormat) -> bool:
    """A graph input measured within the target format: scaling it by a power of two can
    run in that format. Unmeasured inputs are scaled in FP32, to be safe."""
    r = None if stats is None else stats.tensors.get(tensor)
    return r is not None and r.absmax <= fmt.max and not (r.nan_count or r.inf_count)
