"""Prepare, find, plan, once for every command: `model, target, stats -> Planned`.

check, compare, crosscheck, checklist, ledger and convert all call `plan_for`, so each tells
the story convert acts on: the graph the target's compiler takes (the pre-plan passes), its
findings on that graph, and the planner's plan (or the one the user gave).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from npuprep.analyse import findings_for
from npuprep.analyse.finding import Findings
from npuprep.calibrate.stats import RangeStats
from npuprep.data import Feed
from npuprep.model_io import Model
from npuprep.plan.plan import Plan
from npuprep.plan.planner import make_plan
from npuprep.plan.remedies import remedied
from npuprep.profiles import ResolvedTarget
from npuprep.rewrite.passes import prepare_for_target


@dataclass(frozen=True)
class Planned:
    """The planned graph (`model`: the source after the pre-plan passes, or the source itself),
    its stats (completed with tensors the passes made), findings (each with what the plan did
    for it, `Finding.planned`), plan, and the notes that
    say how the planned graph differs from the source."""

    model: Model
    stats: RangeStats | None
    findings: Findings
    plan: Plan
    notes: tuple[str, ...] = ()
    planned_here: bool = True  # False: `plan` is the one the caller gave


def plan_for(model: Model, target: ResolvedTarget, stats: RangeStats | None = None,
             samples: Sequence[Feed] | None = None, *, plan: Plan | None = None,
             findings: Findings | None = None, as_stored: bool = False) -> Planned:
    """What convert would do with `model` on `target` given `stats`.

    `samples` measure tensors the pre-plan passes made; `plan` (a user's or a conversion's)
    is kept instead of planning; `findings` of the source are reused when the passes left the
    graph as it was; `as_stored`: judge the model's own stored formats (check of a model
    already in a low format, npuprep.analyse.measured)."""
    prepared = prepare_for_target(model, target, stats, samples)
    if findings is None or prepared.model is not model:
        findings = findings_for(prepared.model, target, prepared.stats, as_stored=as_stored)
    # Findings leave with what the plan did for each (`Finding.planned`), never a suggestion
    # the plan did not take.
    if plan is not None:
        return Planned(prepared.model, prepared.stats, remedied(findings, plan), plan,
                       prepared.notes, False)
    made = make_plan(prepared.model, target, prepared.stats, findings)
    made = replace(made, notes=(*prepared.notes, *made.notes))
    return Planned(prepared.model, prepared.stats, remedied(findings, made), made, prepared.notes)
