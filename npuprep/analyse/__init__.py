"""Findings: where a model will leave the target's range, from static rules and measured stats."""

from __future__ import annotations

import dataclasses

from npuprep.analyse import autocast, dtypes, initialisers, patterns, small_ops
from npuprep.analyse.context import build_context
from npuprep.analyse.finding import Finding, Findings
from npuprep.model_io import Model
from npuprep.profiles import TargetProfile

__all__ = ["Finding", "Findings", "static_findings"]


def static_findings(model: Model, profile: TargetProfile) -> Findings:
    """Every rule that needs no data, over the main graph and all If/Loop/Scan bodies.

    A pattern finding lists its member nodes in `evidence["members"]`; the small-op
    findings at those members are folded into it (`evidence["covers"]`), and autocast notes
    are dropped where a hazard already names the node, so each place appears once.
    """
    ctx = build_context(model, profile)
    found_patterns = patterns.find(ctx)
    members = {(f.scope, m) for f in found_patterns for m in f.evidence["members"]}
    hazards: list[Finding] = []
    covered: dict[tuple[str, str], list[str]] = {}
    for f in small_ops.find(ctx):
        if (f.scope, f.node) in members:
            covered.setdefault((f.scope, f.node), []).append(f.rule)
        else:
            hazards.append(f)
    folded = []
    for f in found_patterns:
        covers = {m: covered[(f.scope, m)] for m in f.evidence["members"] if (f.scope, m) in covered}
        folded.append(dataclasses.replace(f, evidence={**f.evidence, "covers": covers}))
    flagged = members | {(f.scope, f.node) for f in hazards}
    notes = [f for f in autocast.find(ctx) if (f.scope, f.node) not in flagged]
    return Findings(tuple(dtypes.find(ctx) + initialisers.find(ctx) + folded + hazards + notes))
