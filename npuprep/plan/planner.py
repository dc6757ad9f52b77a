"""Planner: findings + measured ranges -> Plan, each finding answered by the first remedy that holds.

The remedies, one file each, in the order written once in REMEDIES: the softmax shift
(exact rewrite), a rescale absorbed by a Log (a power spectrum's), a power-of-two rescale of the tensor's scale domain, the underflow
scale-up, a layer's weights lifted out of the subnormals, a cancellation kept FP32 (precision),
an FP32 island, a clamp. Problems are of the
resolved format: its range (overflow, headroom, underflow) and its precision (a
cancellation, a softmax's logits too coarse for exp: BF16's hazards, where the range fits). Each proposes an action or declines with a reason; the
reasons of the declined ones travel into the chosen action's why, or into a note when
none holds. Findings that measurement shows safe get a note instead of an action. The
planner reads the graph; it never changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from npuprep.analyse.finding import Finding, Findings
from npuprep.model_io import Model
from npuprep.ops import MAKES_MAGNITUDE
from npuprep.plan import (
    clamp,
    island,
    log_domain,
    phase,
    precision,
    rescale_domain,
    softmax_shift,
    tiny_weights,
    underflow,
)
from npuprep.plan.actions import FindingRef
from npuprep.plan.context import EXP_INPUT_ERROR, RANGE_RULES, Outcome, PlanContext, Problem
from npuprep.plan.plan import Plan
from npuprep.profiles import ResolvedTarget, Severity

Remedy = Callable[[PlanContext, Problem, tuple[str, ...]], Outcome]
# Cheapest exact first; each remedy decides which kinds of problem it answers.
REMEDIES: tuple[Remedy, ...] = (
    softmax_shift.propose, log_domain.propose, rescale_domain.propose, underflow.propose,
    tiny_weights.propose, precision.propose, island.propose, clamp.propose,
)
_DECLINED_AS = {"softmax_shift": "softmax shift", "rescale": "rescale", "pin_fp32": "FP32 pin",
                "clamp": "clamp"}


def make_plan(
    model: Model,
    target: ResolvedTarget,
    stats: Any,
    findings: Findings | Iterable[Finding],
    *,
    forbid_pin: Iterable[str] = (),
) -> Plan:
    """One action per finding, cheapest exact remedy first; deterministic order.

    `target` is the profile and the format the run computes in (TargetProfile.resolve);
    `stats` is a CalibrationStats (or None: plan from the static findings alone);
    `forbid_pin` names nodes no FP32 island may contain.
    """
    profile, fmt = target.profile, target.fmt
    ctx = PlanContext(model, target, stats, frozenset(forbid_pin))
    # Tiny weights last: a measured underflow at their layer plans a lift that stores them too
    # (the weight's own lift then joins it instead of pinning the layer beside it).
    for f in sorted(findings, key=lambda f: (f.rule == "init.underflow", ctx.order_key(f))):
        _handle(ctx, f)
    if stats is not None:
        # Not a range problem: a phase too coarse for Sin/Cos overflows nothing.
        phase.wide_phases(ctx)
    if stats is None:
        ctx.notes.insert(0, "planned without measured ranges: static findings only")
    actions = (*ctx.shifts, *ctx.rescales, *ctx.clamps, *island.merged_pins(ctx))
    return Plan(
        fingerprint=model.fingerprint,
        target=profile.name,
        precision=fmt.name,
        actions=actions,
        declined=tuple(ctx.declined),
        forbid_pin=tuple(sorted(ctx.forbid)),
        notes=tuple(ctx.notes),
        unpinnable=tuple(ctx.unpinnable),
    )


def solve(ctx: PlanContext, problem: Problem, before: tuple[str, ...] = ()) -> bool:
    """Try the remedies in order; record the first action, or a note saying why none held."""
    reasons = list(before)
    for remedy in REMEDIES:
        out = remedy(ctx, problem, tuple(reasons))
        if out is None:
            continue
        if isinstance(out, tuple):
            ctx.declined.extend(out)
            if out:
                reasons.append(f"{_DECLINED_AS[out[-1].remedy]} declined: {out[-1].reason}")
            continue
        for action in out if isinstance(out, list) else [out]:
            ctx.record(action)
        return True
    ref, f = problem.ref, problem.finding
    absmax = problem.absmax
    if problem.kind == "overflow" and absmax is not None and absmax <= ctx.fmt.max:
        ctx.notes.append(
            f"{ref}: absmax {absmax:.6g} is past the headroom limit {ctx.limit:.6g} but within "
            f"{ctx.fmt.name} max; left as is ({reasons[0] if reasons else 'no remedy'}); set "
            "severity.headroom to error in the profile to pin it")
    elif problem.kind == "static" and f.remedy == "rescale":
        ctx.notes.append(f"{ref}: rescale suggested; calibrate to plan it")
    elif problem.kind == "underflow":
        ctx.notes.append(f"{ref}: underflow left as is ({'; '.join(reasons)})")
    else:
        ctx.notes.append(f"{ref}: unresolved; " + "; ".join(reasons))
    return False


def _handle(ctx: PlanContext, f: Finding) -> None:
    ref = FindingRef.of(f)
    if f.rule == "range.nonfinite":
        ctx.notes.append(f"{ref}: the FP32 reference itself is not finite there; fix the model "
                         "or the data, no precision change can")
        return
    if f.rule == "range.underflow":
        if ctx.range_of(f.tensor) is None:
            ctx.notes.append(f"{ref}: underflow needs a measured range to plan a rescale")
            return
        solve(ctx, Problem(f, ref, f.tensor, "underflow", ctx.range_of(f.tensor).absmax))
        return
    if f.rule == "init.out_of_range":
        _weights(ctx, f, ref)
        return
    if f.rule.startswith("precision.") and f.tensor:
        if not ctx.attach(ref, f.tensor):
            r = ctx.range_of(f.tensor)
            solve(ctx, Problem(f, ref, f.tensor, "precision", None if r is None else
                               float(r.absmax), (f.node,)))
        return
    if f.rule == "init.underflow" and f.remedy == "rescale" and f.severity >= Severity.WARNING \
            and f.node in ctx.nodes and ctx.stats is not None:
        # A layer's weights that FP16 stores as 0 or a few-bit subnormal: lifted, or kept FP32.
        solve(ctx, Problem(f, ref, f.tensor, "tiny_weights", None, (f.node,)),
              (f"{f.tensor} would lose its small values in {ctx.fmt.name}",))
        return
    if f.rule.startswith("init."):
        if f.severity >= Severity.WARNING:
            ctx.notes.append(f"{ref}: no plan action; lowering rounds this constant "
                             f"({f.remedy_text or f.remedy})")
        return
    if f.rule in RANGE_RULES and f.tensor:
        _measured(ctx, f, ref, f.tensor)
        return
    if f.remedy not in ("rescale", "pin_fp32", "clamp"):
        if f.severity >= Severity.WARNING:
            ctx.notes.append(f"{ref}: no plan action ({f.remedy_text or f.remedy})")
        return
    worst = ctx.worst_output(f.node) if ctx.stats is not None else None
    if worst is not None:
        _measured(ctx, f, ref, worst[0])
        return
    if f.severity < Severity.WARNING or f.rule.startswith("autocast."):
        ctx.notes.append(f"{ref}: measure to decide ({f.remedy_text or f.remedy})")
        return
    if ctx.attach_node(ref, f.node):
        return
    tensor = f.tensor
    if not tensor and f.node in ctx.nodes:
        tensor = next((o for o in ctx.node(f.node).output if o), "")
    seeds: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    if f.remedy == "pin_fp32":
        seeds = tuple(m for m in f.evidence.get("members", [f.node]) if m in ctx.nodes)
        before = ("no measured range: the rule asks for FP32",)
    solve(ctx, Problem(f, ref, tensor, "static", None, seeds), before)


def _measured(ctx: PlanContext, f: Finding, ref: FindingRef, tensor: str) -> None:
    """A finding whose tensor was measured: credit, note or solve."""
    if ctx.attach(ref, tensor):
        return
    r = ctx.range_of(tensor)
    if r is not None and (r.nan_count or r.inf_count):
        ctx.notes.append(f"{ref}: the FP32 reference of {tensor} has {r.nan_count} NaN and "
                         f"{r.inf_count} Inf values; no precision change can fix that")
        return
    if r is not None and r.absmax <= ctx.limit:
        problem = Problem(f, ref, tensor, "precision", float(r.absmax))
        # In range; a softmax's logits may still be too coarse in the format for exp.
        if not (softmax_shift.too_coarse(ctx, problem) and solve(ctx, problem)):
            ctx.notes.append(_safe_note(ctx, f, ref, r.absmax))
        return
    solve(ctx, Problem(f, ref, tensor, "overflow", None if r is None else float(r.absmax)))


def _weights(ctx: PlanContext, f: Finding, ref: FindingRef) -> None:
    """A constant beyond the target's range: rescale its layer, else keep it in FP32."""
    worst = abs(float(f.evidence.get("worst", 0.0) or 0.0))
    if 0 < worst <= ctx.fmt.max:
        ctx.notes.append(f"{ref}: its largest value {worst:.6g} fits {ctx.fmt.name}; no action")
        return
    rescaled = rescale_domain.rescaled_constant(ctx, f.tensor)
    if rescaled is not None and rescaled[1] <= ctx.fmt.max:
        entry, after = rescaled
        ctx.notes.append(f"{ref}: the rescale of {entry} scales it to {after:.6g}, which fits "
                         f"{ctx.fmt.name}; no action")
        return
    if f.node not in ctx.nodes:
        ctx.notes.append(f"{ref}: no consumer node to keep in FP32")
        return
    node = ctx.node(f.node)
    if ctx.stats is None and node.op_type in MAKES_MAGNITUDE:
        # Unmeasured: a weight past the format's max makes its layer's output large too.
        ctx.static_hot.update(o for o in node.output if o)
        ctx.hot_cache.clear()
    before = ("folding is not a plan action",) if f.remedy == "fold" else ()
    solve(ctx, Problem(f, ref, f.tensor, "weights", worst, (f.node,)),
          before + (f"the weight cannot be stored in {ctx.fmt.name}",))


def _safe_note(ctx: PlanContext, f: Finding, ref: FindingRef, absmax: float) -> str:
    note = (f"{ref}: measured absmax {absmax:.6g} is within the limit {ctx.limit:.6g} "
            f"(headroom {ctx.profile.headroom:g} x {ctx.fmt.name} max); no action")
    gain = f.evidence.get("error_gain")
    if isinstance(gain, int | float) and gain * ctx.fmt.eps > EXP_INPUT_ERROR:
        # Range is fine; precision is not the planner's to judge, verification measures it.
        note += (f"; it amplifies rounding error {gain:g}x ({gain * ctx.fmt.eps:.2g} relative "
                 f"in {ctx.fmt.name}): if verification fails there, pin what feeds it")
    return note
