"""The convert pipeline: findings -> plan -> rewrite (FP32) -> lower -> verify under emulation.

Each stage is its own module; this file only chains them and, when verification fails, pins
and tries again (a bounded number of rounds): the layers that make a precision error
(npuprep.verify.attribution), else the first divergent node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from npuprep.analyse.finding import Findings
from npuprep.data import Feed
from npuprep.model_io import Model, fingerprint, with_weights
from npuprep.numerics import NumberFormat, get_format
from npuprep.plan import PinFp32, Plan
from npuprep.profiles import ControlFlow, Pinning, TargetProfile
from npuprep.provenance import record_source
from npuprep.report.share import DEFAULT_MAX_FP32_SHARE, fp32_share

SCHEMA_VERSION = 1
DEFAULT_RTOL = 1e-2


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
        from npuprep.verify.output_errors import output_passes

        return all(output_passes(o, self.rtol) for o in self.outputs.values())

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
    # Outputs that leave the device scaled (target cannot pin): output -> host factor.
    host_scales: dict[str, float] = field(default_factory=dict)
    share: Any = None  # npuprep.report.share.Fp32Share
    # Per verification round that traced a precision failure to layers (verify.attribution).
    error_attribution: tuple[dict[str, Any], ...] = ()

    @property
    def passed(self) -> bool:
        """Outputs within tolerance under emulation, and the FP32 share within its limit:
        a model left mostly in FP32 has not been converted."""
        checks = [c for c in (self.output_check, self.holdout, self.share) if c is not None]
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
    from npuprep.analyse import findings_for

    stage = progress or (lambda _: None)
    stage("findings")
    # Rules read constants and the rewrite lowers every weight: a light model gets its values.
    model = with_weights(model)
    from npuprep.plan.planner import make_plan

    top_k = _checked_top_k(model, top_k)
    fmt = get_format(precision or profile.default_precision)
    # What the target's compiler can take is what gets planned, rewritten and verified.
    work, stats, flow_notes = for_target(model, profile, stats, samples, precision)
    findings = findings_for(work, profile, stats, precision)
    if plan is None:
        stage("planning")
        plan = make_plan(work, profile, stats, findings, precision=precision)
        plan = replace(plan, notes=(*flow_notes, *plan.notes))
    notes: list[str] = list(flow_notes)
    result = None
    tried: tuple[Plan, dict[str, Any]] | None = None  # the plan before the last verification pin
    attributions: list[dict[str, Any]] = []
    for round_no in range(1, max_rounds + 1):
        result = _build(work, profile, fmt, plan, samples, io_types=io_types, rtol=rtol,
                        holdout=holdout, stats=stats, opset=opset, top_k=top_k,
                        stage=lambda s, r=round_no: stage(f"round {r}, {s}"))
        if tried is not None and not _improved(tried[1]["output_check"], result["output_check"]):
            # A pin that leaves the outputs as wrong as before only costs FP32: the error is
            # FP16's precision accumulated through the model, not this node.
            before, after = _worst(tried[1]["output_check"]), _worst(result["output_check"])
            notes.append(f"round {round_no}: the pin did not improve the outputs (worst rel L2 "
                         f"{before:.3g} -> {after:.3g}); dropped it, as round {round_no - 1} was")
            for traced in attributions:
                if traced["round"] == round_no - 1:
                    traced["dropped"] = True
            plan, result = tried
            round_no -= 1
            break
        if result["output_check"] or round_no == max_rounds:
            break
        first = result["layers"].first_divergent
        if first is None or not first.node:
            break
        if profile.fp32_pinning is Pinning.NONE:
            notes.append(f"verification failed at '{first.node}'; the target cannot pin FP32")
            break
        found: tuple[Any, ...] = ()
        if _precision_only(result["output_check"], first):
            stage(f"round {round_no}, attributing the error to layers")
            found, traced_note, measured = _attributed_pins(result, fmt, profile, samples, plan,
                                                            max_fp32_share, rtol)
            if measured is not None:
                notes.append(f"round {round_no}: {traced_note}")
                attributions.append({"round": round_no, **measured.to_dict(),
                                     "pinned": [x.node for x in found], "dropped": False})
        if found:
            targets = tuple(x.node for x in found)
            why = (f"{len(found)} layer(s) holding {100 * sum(x.share for x in found):.0f}% of "
                   "the layers' own FP16 squared error")
        else:
            targets = _nodes_to_pin(result["rewritten"], first.node, set(result["pinned"]))
            why = (f"first divergent node {first.node} (rel L2 {first.rel_l2:.3g}, max abs "
                   f"error {first.max_abs_error:.3g})")
        targets = tuple(n for n in targets if n not in plan.forbid_pin)
        if not targets:
            break
        notes.append(f"round {round_no}: outputs failed verification; " + (
            "the layers holding its FP16 error" if found else
            f"first divergent node '{first.node}' ({first.op_type})")
            + f": pinned {', '.join(targets)} and retried")
        pin = PinFp32(nodes=targets, exit_tensors=(), forced=False,
                      request=profile.fp32_pinning is Pinning.COMPILER_DECIDES,
                      why=f"verification round {round_no}: {why}")
        tried = (plan, result)
        plan = replace(plan, actions=(*plan.actions, pin))
    assert result is not None
    # The converted model names its source, so the source's stats apply to it by name.
    record_source(result["lowered"].model, model.fingerprint, result["scales"])
    share = fp32_share(result["rewritten"], _fp32_groups(plan, result, stats, fmt),
                       limit=max_fp32_share, input_shapes=_sample_shapes(samples))
    return ConversionResult(
        source=model, profile=profile, fmt=fmt, findings=findings, plan=plan,
        rewritten=result["rewritten"], lowered=result["lowered"],
        tensor_scales=result["scales"], pinned_nodes=tuple(sorted(result["pinned"])),
        output_check=result["output_check"], layers=result["layers"],
        holdout=result["holdout"], flops_fp32_share=share.flops, rounds=round_no,
        samples_description=samples_description, synthetic=synthetic, stats=stats,
        declined=result["declined"], notes=tuple(notes) + result["notes"], share=share,
        host_scales=result["host_scales"], error_attribution=tuple(attributions),
    )


def _checked_top_k(model: Model, top_k: Mapping[str, int] | None) -> dict[str, int]:
    from npuprep.errors import NpuprepError

    outputs = {o.name for o in model.proto.graph.output}
    for name, k in (top_k or {}).items():
        if name not in outputs:
            raise NpuprepError(f"--top-k names '{name}', which is not an output of {model.path} "
                               f"(outputs: {', '.join(sorted(outputs))})")
        if not isinstance(k, int) or k < 1:
            raise NpuprepError(f"--top-k {name}: K must be a whole number >= 1, not {k!r}")
    return dict(top_k or {})


def _worst(check: OutputCheck | None) -> float:
    return max((o["rel_l2"] for o in check.outputs.values()), default=0.0) if check is not None else 0.0


def _improved(before: OutputCheck | None, after: OutputCheck | None) -> bool:
    """Passing now, fewer non-finite outputs, or a worst relative L2 error at least 10% lower."""
    if before is None or after is None or after:
        return True
    bad = [sum(o["nonfinite"] for o in c.outputs.values()) for c in (before, after)]
    if bad[1] != bad[0]:
        return bad[1] < bad[0]
    return _worst(after) <= 0.9 * _worst(before)


def _precision_only(check: OutputCheck | None, first: Any) -> bool:
    """Failed with finite outputs and no overflow where the error shows: FP16's rounding."""
    if check is None or check or any(o["nonfinite"] for o in check.outputs.values()):
        return False
    return not any(getattr(first, k, 0) for k in ("inf_count", "nan_count", "saturated_count"))


# Samples the attribution runs on: each candidate layer costs one session and one pass over them.
ATTRIBUTION_SAMPLES = 4


def _attributed_pins(result: dict[str, Any], fmt: NumberFormat, profile: TargetProfile,
                     samples: Sequence[Feed], plan: Plan, max_fp32_share: float,
                     rtol: float) -> tuple[tuple[Any, ...], str, Any]:
    """The nodes (layers and elementwise ops) whose own FP16 error (npuprep.verify.attribution,
    on the worst sample and the first others) takes the outputs within `rtol` once kept FP32,
    within the FLOPs budget, the note saying so and the Attribution; ((), "", None) when no
    node fits the budget."""
    from onnx import TensorProto

    from npuprep.graph import infer_tensors, node_label, walk_graphs
    from npuprep.report.flops import node_flops
    from npuprep.verify.attribution import attribute_error, describe
    from npuprep.verify.emulate import stores_rounded_values

    rewritten, pinned = result["rewritten"], set(result["pinned"])
    flops = node_flops(rewritten, _sample_shapes(samples))
    total = sum(flops.values())
    room = max_fp32_share * total - sum(flops.get(n, 0) for n in pinned)
    types = infer_tensors(rewritten).types
    # Every node that stores a rounded value: a layer, or an elementwise op whose rounding a
    # cancellation after it amplifies (x + 1000 - 1000 needs both kept).
    candidates = [node_label(n) for s in walk_graphs(rewritten.graph) for n in s.graph.node
                  if n.op_type != "Constant" and stores_rounded_values(n)
                  and any(types.get(o) == TensorProto.FLOAT for o in n.output)
                  and node_label(n) not in pinned and node_label(n) not in plan.forbid_pin
                  and flops.get(node_label(n), 0) <= room]
    if not candidates:
        return (), "", None
    outputs = result["output_check"].outputs.values()
    worst = max(outputs, key=lambda o: o["rel_l2"])
    at = worst.get("worst_sample", {}).get("sample", 0)
    chosen = [samples[at], *(s for i, s in enumerate(samples) if i != at)]
    # The outputs are judged in the format the artefact stores (FP16 for an FP8 target).
    attribution = attribute_error(rewritten, weights_format(fmt), chosen[:ATTRIBUTION_SAMPLES],
                                  saturate=profile.saturates, candidates=candidates, flops=flops)
    pins = attribution.pins_for(worst["rel_l2"], rtol, room)
    return pins, describe(attribution, pins, worst["rel_l2"], total), attribution


def _sample_shapes(samples: Sequence[Feed]) -> dict[str, tuple[int, ...]]:
    """Input sizes of the first sample: what FLOPs are counted at."""
    first = next(iter(samples), None)
    return {k: tuple(np.shape(v)) for k, v in (first or {}).items()}


def for_target(model: Model, profile: TargetProfile, stats: Any = None,
               samples: Sequence[Feed] | None = None,
               precision: str | None = None) -> tuple[Model, Any, tuple[str, ...]]:
    """`model` as the target's compiler can take it, its statistics, and notes saying what
    changed.

    Every target gets what its compiler would fuse anyway, so that no FP16 value is stored
    that the board never stores: a written-out mean (`ReduceSum -> Mul(1/N)`) as one
    ReduceMean (npuprep.rewrite.sum_to_mean), the scale and shift after a Conv folded into
    its weights (npuprep.rewrite.fold_affine) and a written-out hard-swish as one op
    (npuprep.rewrite.hardswish). A profile with `control_flow: none` gets its If nodes
    removed before planning (npuprep.rewrite.control_flow), so the remedies see a branch's
    nodes in the main graph. The result keeps the source's path and fingerprint: plans and
    statistics still belong to the user's model (a kept tensor keeps its name). Tensors the
    source never computed (a branch the samples never took, a fused op's new tensor) are
    measured on `samples` (when given) and added to `stats`, unless their op bounds them.
    """
    from npuprep.rewrite.fold_affine import fold_affines
    from npuprep.rewrite.hardswish import fuse_hardswish
    from npuprep.rewrite.sum_to_mean import sums_to_means

    proto, notes = model.proto, []
    means = sums_to_means(proto)
    if means:
        proto = means.model
        notes += [f"'{node}' folded before planning: {how}"
                  for node, how in means.details.get("replaced", {}).items()]
    weights = weights_format(get_format(precision or profile.default_precision))
    folded = fold_affines(proto, weights, largest=profile.limit(weights))
    fused = fuse_hardswish(folded.model)
    notes += _fusion_notes(folded) + _fusion_notes(fused)
    proto = fused.model
    if profile.control_flow == ControlFlow.NONE:
        from npuprep.rewrite.control_flow import remove_control_flow

        flow = remove_control_flow(proto)
        why = f"{profile.name} takes no control flow (control_flow: none)"
        notes += [f"If node '{node}' replaced before planning, {why}: {how}"
                  for node, how in flow.details.get("replaced", {}).items()]
        notes += [f"'{node}' kept although {why}: {reason}"
                  for node, reason in flow.details.get("declined", {}).items()]
        proto = flow.model if flow else proto
    work = _work(model, proto)
    if stats is not None and work is not model:
        stats, more = _unmeasured_stats(work, stats, samples)
        notes += more
    return work, stats, tuple(notes)


def weights_format(fmt: NumberFormat) -> NumberFormat:
    """The format a conversion to `fmt` stores weights in: FP8 targets get FP16 weights
    (the lowering writes FP16 and the compiler quantises)."""
    return fmt if fmt.name in ("fp16", "bf16") else get_format("fp16")


def _fusion_notes(result: Any) -> list[str]:
    """One note for what a fusing rewrite did (the first nodes named), one per decline."""
    partial = result.details.get("partial", {})
    done = [n for n in result.details.get("replaced", {}) if n not in partial]
    notes = [f"fused before planning: {result.reason} ({', '.join(done[:3])}"
             f"{f' and {len(done) - 3} more' if len(done) > 3 else ''})"] if done else []
    return notes + [f"'{node}' fused in part: {how}" for node, how in partial.items()] + [
        f"'{node}' not fused: {why}" for node, why in result.details.get("declined", {}).items()]


def _work(model: Model, proto: Any) -> Model:
    """The working copy of `model`: the same path and fingerprint (the user's plans and
    statistics belong to it), or `model` itself when nothing changed."""
    return model if proto is model.proto else Model(proto=proto, path=model.path, digest=model.fingerprint)


def _unmeasured_stats(work: Model, stats: Any,
                      samples: Sequence[Feed] | None) -> tuple[Any, list[str]]:
    """`stats` completed with the tensors the source model never computed on these samples
    and the planned graph does (a branch that was not taken and is now inlined, a tensor a
    fusion made), except those of statically bounded ops (npuprep.ops.BOUNDED_OUTPUTS)."""
    from npuprep.graph import float_tensor_names, producers
    from npuprep.ops import BOUNDED_OUTPUTS

    # A fused hard-swish's gate (HardSigmoid) lies in [0, 1] whatever its input: not worth
    # a second calibration pass.
    made = producers(work.proto.graph)
    missing = [t for t in float_tensor_names(work.proto, work.graph)
               if (t not in stats.tensors or not stats.tensors[t].count)
               and not (t in made and made[t].op_type in BOUNDED_OUTPUTS)]
    if not missing:
        return stats, []
    if not samples:
        return stats, [f"{len(missing)} tensor(s) the source model does not compute on these "
                       f"samples have no measured range yet ({', '.join(missing[:3])}); convert, "
                       "or check with --data, measures them on its samples"]
    from npuprep.calibrate import calibrate

    fresh = calibrate(work, samples)
    filled = {t: fresh.tensors[t] for t in missing if t in fresh.tensors}
    return replace(stats, tensors={**stats.tensors, **filled}), [
        f"measured {len(filled)} tensor(s) the source model never computed on these samples "
        f"(a branch not taken, a fused op's own: {', '.join(sorted(filled)[:3])}) on the graph "
        "as planned"]


def _fp32_groups(plan: Plan, result: dict[str, Any], stats: Any,
                 fmt: NumberFormat) -> list[tuple[tuple[str, ...], str, str, bool]]:
    """The FP32 nodes of a conversion as (nodes, why, declined remedy, required): the plan's
    islands, what lowering forced, what the rewrites inserted, then anything else kept FP32.
    An island is required when an exit's measured range exceeds the format (it can only
    close at an output kept FP32) or when its ops have no kernel in the low format."""
    groups: list[tuple[tuple[str, ...], str, str, bool]] = []
    declined = list(plan.declined) + list(result["declined"])
    no_low_kernel = _fixed_fp32_nodes(result["rewritten"])
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
    for node, reason in sorted(result["lowered"].forced_fp32.items()):
        groups.append(((node,), f"lowering: {reason}", "", node in no_low_kernel))
    by_reason: dict[str, list[str]] = {}
    for node in sorted(result["boundary"]):
        by_reason.setdefault(result["fp32_reasons"].get(node, "inserted by a rewrite"), []).append(node)
    groups += [(tuple(nodes), why, "", False) for why, nodes in sorted(by_reason.items())]
    groups.append((tuple(sorted(result["pinned"])), "kept FP32", "", False))
    return groups


def _fixed_fp32_nodes(model: Any) -> set[str]:
    """Nodes whose FP32 no remedy can change: ops of other domains (`ai.onnx.ml` has no FP16
    kernels) and ops whose output type an attribute fixes (npuprep.rewrite.lower)."""
    from npuprep.graph import node_label, walk_graphs
    from npuprep.rewrite.lower import FORCED_FP32_OPS

    return {node_label(n) for scope in walk_graphs(model.graph) for n in scope.graph.node
            if n.domain not in ("", "ai.onnx") or n.op_type in FORCED_FP32_OPS}


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
           holdout: Sequence[Feed] | None, stats: Any = None,
           opset: int | None = None, top_k: Mapping[str, int] | None = None,
           stage: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    from npuprep.rewrite.apply import apply_plan
    from npuprep.rewrite.lower import lower
    from npuprep.verify.compare import DEFAULT_ATOL, compare_models, emulation_notes
    from npuprep.verify.emulate import emulate

    stage("rewriting")
    applied = apply_plan(model.proto, plan)
    # A target that cannot pin runs every node in its format: emulate it so (a PASSED then
    # matches the device) and move output compensations it cannot hold to the host.
    no_pin = profile.fp32_pinning is Pinning.NONE
    applied, host_scales, host_notes = _host_scales(model, applied, profile, stats, samples) \
        if no_pin else (applied, {}, ())
    pinned = set(plan.pinned_nodes()) | set(applied.fp32_nodes)
    pinned |= {n for n, inp in applied.input_nodes.items() if not _fits_format(stats, inp, fmt)}
    lower_fmt = weights_format(fmt)
    stage("lowering")
    lowered = lower(applied.model, lower_fmt, pinned_nodes=sorted(pinned), io_types=io_types)
    pinned |= set(lowered.pinned_nodes)
    if opset is not None:
        from npuprep.opsets import convert_opset

        lowered = replace(lowered, model=convert_opset(lowered.model, opset, why="--opset"))
    stage("emulating and comparing layer by layer")
    # A target that cannot pin emulates every node in its format but BatchNorms folded at
    # build time; elsewhere an If that only carries a pinned branch node's FP32 output is not
    # rounded either.
    emulation = emulate(applied.model, fmt, saturate=profile.saturates,
                        pinned_nodes=_folded_at_build(applied.model, lowered) if no_pin
                        else pinned | set(lowered.fp32_output_nodes))
    layers = compare_models(model.proto, emulation.model, samples, rtol=rtol, atol=DEFAULT_ATOL,
                            tensor_scales=applied.tensor_scales, fmt=fmt)
    notes = list(emulation_notes(profile, profile.saturates)) + list(host_notes)
    if no_pin:
        notes.append(f"target {profile.name} cannot pin FP32 (fp32_pinning: none): every node "
                     f"is emulated in {fmt.name}, FP32 islands of the ONNX file included")
    if fmt is not lower_fmt:
        notes.append(f"the ONNX artefact is lowered to {lower_fmt.name}; {fmt.name} is emulated, "
                     "quantisation to it is the compiler's job")
    everywhere = emulation.model if no_pin else None
    stage("checking the outputs")
    output_check = check_outputs(model.proto, lowered.model, lower_fmt, samples,
                                 saturate=profile.saturates, rtol=rtol, io_types=io_types,
                                 host_scales=host_scales, emulated=everywhere, top_k=top_k)
    held = None
    if holdout is not None:
        held = check_outputs(model.proto, lowered.model, lower_fmt, holdout,
                             saturate=profile.saturates, rtol=rtol, io_types=io_types,
                             host_scales=host_scales, emulated=everywhere, top_k=top_k)
    return {
        "boundary": set(applied.fp32_nodes) | (set(applied.input_nodes) & pinned),
        "fp32_reasons": applied.fp32_reasons,
        "rewritten": applied.model, "lowered": lowered, "scales": applied.tensor_scales,
        "pinned": pinned, "layers": layers, "output_check": output_check, "holdout": held,
        "declined": applied.declined, "notes": tuple(notes), "host_scales": host_scales,
    }


def _folded_at_build(model: Any, lowered: Any) -> set[str]:
    """BatchNormalizations whose weights lowering kept FP32: a compiler that cannot pin still
    folds them into a scale and shift in FP32 at build time (rknn-toolkit2 reports a fused
    `[Conv] bn` layer), so their raw variances never meet FP16; emulation rounds their
    result only."""
    from npuprep.graph import node_label

    ops = {node_label(n): n.op_type for n in model.graph.node}
    return {n for n in lowered.forced_fp32 if ops.get(n) == "BatchNormalization"}


def _host_scales(model: Model, applied: Any, profile: TargetProfile, stats: Any,
                 samples: Sequence[Feed]) -> tuple[Any, dict[str, float], tuple[str, ...]]:
    """Rescale exits at graph outputs whose true range exceeds the limit leave the device
    scaled (npuprep.plan.host_scale decides, npuprep.rewrite.output_scale rewrites)."""
    from npuprep.plan.host_scale import host_scaled_outputs
    from npuprep.rewrite.output_scale import leave_output_scaled

    producer = {o: n.name for n in applied.model.graph.node for o in n.output}
    exits = [o.name for o in applied.model.graph.output
             if producer.get(o.name) in set(applied.fp32_nodes)]
    if not exits:
        return applied, {}, ()
    chosen = host_scaled_outputs(exits, _output_absmax(model, stats, samples, exits), profile)
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
        notes.append(f"output '{name}' leaves the device scaled by 1/{factor:g} ({why}); "
                     f"multiply it by {factor:g} on the host (report key host_scales)")
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
                       else emulate_lowered(lowered, fmt, saturate=saturate).model)
    host = host_scales or {}
    real = make_session(lowered)
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
