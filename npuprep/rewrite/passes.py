"""The rewrites every target gets before planning, as one declared list of passes.

    ReduceSum -> Mul(1/N)        -> ReduceMean              (sum_to_mean.py)
    Conv -> Mul(s) -> Add(c)     -> Conv(s*W, s*b + c)      (fold_affine.py)
    x * HardSigmoid(x)           -> HardSwish(x)            (hardswish.py)
    If(cond, then, else)         -> the branch inlined      (control_flow.py; `control_flow: none`)

A compiler fuses these anyway, so planning on the fused graph stores no FP16 value that the
board never stores. `convert`, `check` and `checklist` run the same list (`PRE_PLAN_PASSES`)
through `prepare_for_target`; a pass is a small object with a `name`, `applies(target)` and
`run(model, target) -> RewriteResult`, and says what it did in `PassDetails`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import onnx

from npuprep.calibrate.stats import CalibrationStats
from npuprep.data import Feed
from npuprep.model_io import Model
from npuprep.profiles import ControlFlow, ResolvedTarget
from npuprep.rewrite.control_flow import remove_control_flow
from npuprep.rewrite.fold_affine import fold_affines
from npuprep.rewrite.hardswish import fuse_hardswish
from npuprep.rewrite.result import RewriteResult
from npuprep.rewrite.sum_to_mean import sums_to_means


@dataclass(frozen=True)
class PassDetails:
    """What one pass did, node by node: replaced (whole), partial, declined (with why)."""

    name: str
    reason: str
    replaced: Mapping[str, str] = field(default_factory=dict)
    partial: Mapping[str, str] = field(default_factory=dict)
    declined: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, name: str, result: RewriteResult) -> PassDetails:
        def table(key: str) -> dict[str, str]:
            value = result.details.get(key, {})
            return {str(k): str(v) for k, v in value.items()} if isinstance(value, Mapping) else {}

        return cls(name, result.reason, table("replaced"), table("partial"), table("declined"))


class RewritePass(Protocol):
    """One pre-planning rewrite."""

    name: str

    def applies(self, target: ResolvedTarget) -> bool: ...

    def run(self, model: onnx.ModelProto, target: ResolvedTarget) -> RewriteResult: ...

    def notes(self, details: PassDetails, target: ResolvedTarget) -> list[str]: ...


class _Fusion:
    """A fusion every target gets; its notes name the first nodes fused and each decline."""

    name = ""

    def applies(self, target: ResolvedTarget) -> bool:
        return True

    def notes(self, details: PassDetails, target: ResolvedTarget) -> list[str]:
        done = [n for n in details.replaced if n not in details.partial]
        more = f" and {len(done) - 3} more" if len(done) > 3 else ""
        notes = [f"fused before planning: {details.reason} ({', '.join(done[:3])}{more})"] if done else []
        return (notes + [f"'{node}' fused in part: {how}" for node, how in details.partial.items()]
                + [f"'{node}' not fused: {why}" for node, why in details.declined.items()])


class SumsToMeans(_Fusion):
    name = "sum_to_mean"

    def run(self, model: onnx.ModelProto, target: ResolvedTarget) -> RewriteResult:
        return sums_to_means(model)

    def notes(self, details: PassDetails, target: ResolvedTarget) -> list[str]:
        return [f"'{node}' folded before planning: {how}" for node, how in details.replaced.items()]


class FoldAffines(_Fusion):
    name = "fold_affine"

    def run(self, model: onnx.ModelProto, target: ResolvedTarget) -> RewriteResult:
        # Folded parameters are judged in the format the artefact stores them in.
        return fold_affines(model, target.weights, largest=target.limit_in(target.weights))


class FuseHardswish(_Fusion):
    name = "hardswish"

    def run(self, model: onnx.ModelProto, target: ResolvedTarget) -> RewriteResult:
        return fuse_hardswish(model)


class RemoveControlFlow:
    """Only for a target whose compiler takes no If (`control_flow: none`)."""

    name = "control_flow"

    def applies(self, target: ResolvedTarget) -> bool:
        return target.profile.control_flow == ControlFlow.NONE

    def run(self, model: onnx.ModelProto, target: ResolvedTarget) -> RewriteResult:
        return remove_control_flow(model)

    def notes(self, details: PassDetails, target: ResolvedTarget) -> list[str]:
        why = f"{target.profile.name} takes no control flow (control_flow: none)"
        return ([f"If node '{node}' replaced before planning, {why}: {how}"
                 for node, how in details.replaced.items()]
                + [f"'{node}' kept although {why}: {reason}" for node, reason in details.declined.items()])


PRE_PLAN_PASSES: tuple[RewritePass, ...] = (SumsToMeans(), FoldAffines(), FuseHardswish(),
                                           RemoveControlFlow())


def run_passes(model: onnx.ModelProto, target: ResolvedTarget,
               passes: Sequence[RewritePass] = PRE_PLAN_PASSES
               ) -> tuple[onnx.ModelProto, tuple[PassDetails, ...], tuple[str, ...]]:
    """`model` after each pass that applies to `target`, in order; what each did, and the notes."""
    done: list[PassDetails] = []
    notes: list[str] = []
    for step in passes:
        if not step.applies(target):
            continue
        result = step.run(model, target)
        details = PassDetails.of(step.name, result)
        done.append(details)
        notes += step.notes(details, target)
        if result:
            model = result.model
    return model, tuple(done), tuple(notes)


@dataclass(frozen=True)
class Prepared:
    """The graph a target's compiler is given (the passes applied), its statistics, and notes
    saying what changed. `model` keeps the source's path and fingerprint: plans and
    statistics still belong to the user's model (a kept tensor keeps its name)."""

    model: Model
    stats: CalibrationStats | None
    notes: tuple[str, ...]
    passes: tuple[PassDetails, ...] = ()


def prepare_for_target(model: Model, target: ResolvedTarget, stats: CalibrationStats | None = None,
                       samples: Sequence[Feed] | None = None) -> Prepared:
    """`model` as `target`'s compiler takes it (PRE_PLAN_PASSES). Tensors the source never
    computed (a branch the samples never took, a fused op's new tensor) are measured on
    `samples` (when given) and added to `stats`, unless their op bounds them."""
    proto, passes, notes = run_passes(model.proto, target)
    work = model if proto is model.proto else Model(proto=proto, path=model.path,
                                                       digest=model.fingerprint)
    if stats is not None and work is not model:
        stats, more = _unmeasured_stats(work, stats, samples)
        notes = (*notes, *more)
    return Prepared(work, stats, tuple(notes), passes)


def _unmeasured_stats(work: Model, stats: CalibrationStats, samples: Sequence[Feed] | None,
                      ) -> tuple[CalibrationStats, list[str]]:
    """`stats` completed with the tensors the source model never computed on these samples
    and the planned graph does, except those of statically bounded ops
    (npuprep.ops.BOUNDED_OUTPUTS)."""
    from npuprep.calibrate import calibrate
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
    # The scope the other stats have; those tensors only (a whole second calibration cost
    # ppocr_det a third of its first: most of it building the instrumented session).
    fresh = calibrate(work, samples, detail=stats.detail, tensors=missing)
    filled = {t: fresh.tensors[t] for t in missing if t in fresh.tensors}
    return replace(stats, tensors={**stats.tensors, **filled}), [
        f"measured {len(filled)} tensor(s) the source model never computed on these samples "
        f"(a branch not taken, a fused op's own: {', '.join(sorted(filled)[:3])}) on the graph "
        "as planned"]
