"""Findings: where a model will leave the target's range, from static rules and measured stats."""

from __future__ import annotations

import dataclasses
from typing import Any

from npuprep.analyse import autocast, dtypes, initialisers, inputs, patterns, small_ops
from npuprep.analyse.context import build_context
from npuprep.analyse.finding import Finding, Findings
from npuprep.model_io import Model
from npuprep.profiles import ResolvedTarget

__all__ = ["STATIC_RULES", "Finding", "Findings", "findings_for", "static_findings"]

# Every rule id the static rules emit, with what it means (reports and checklists cite these).
STATIC_RULES: dict[str, str] = {
    "dtype.unsupported": "a dtype the target does not run (BF16 on a2000, FP64 anywhere)",
    "dtype.slow": "a dtype the target runs, but not on its fast path (BF16 on orin)",
    "input.dynamic_shape": "a graph input with symbolic or unknown dims on a fixed-size target",
    "init.out_of_range": "constant values that become Inf in the target format",
    "init.underflow": "constant values that flush to zero or become subnormal",
    "init.mask_constant": "an additive mask (-inf, FP32 lowest) that needs the target's -max",
    "hazard.square": "x**p (Pow by a constant, Mul(x, x)) overflowing for |x| above a limit",
    "hazard.reduce_square": "a sum of squares (ReduceSumSquare, ReduceL2, ReduceSum of x**2)",
    "hazard.reduce_sum": "a sum over many elements",
    "hazard.exp": "Exp without a bound below ln(max) on its input",
    "hazard.div": "Div with no eps, Max or Clip keeping the denominator from 0",
    "hazard.reciprocal": "Reciprocal with no guard keeping its input from 0",
    "hazard.log": "Log with no guard keeping its input from 0",
    "hazard.sqrt": "Sqrt of a sum of squares that overflows before the root",
    "pattern.layernorm": "a LayerNorm written out as ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div",
    "pattern.softmax": "a softmax written out as Exp / ReduceSum(Exp) without max subtraction",
    "pattern.guidance": "a + w * (a - b) with |w| >= 2 (classifier-free guidance)",
    "autocast.fp32_op": "an op GPU autocast keeps in FP32 that the target may not",
}


def static_findings(model: Model, target: ResolvedTarget) -> Findings:
    """Every rule that needs no data, over the main graph and all If/Loop/Scan bodies.

    A pattern finding lists its member nodes in `evidence["members"]`; the small-op
    findings at those members are folded into it (`evidence["covers"]`), and autocast notes
    are dropped where a hazard already names the node, so each place appears once. Limits
    are the resolved format's (`target.fmt`).
    """
    ctx = build_context(model, target)
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
    return Findings(tuple(inputs.find(ctx) + dtypes.find(ctx) + initialisers.find(ctx) + folded
                          + hazards + notes))


def findings_for(model: Model, target: ResolvedTarget, stats: Any = None, *,
                 as_stored: bool = False) -> Findings:
    """The static findings, merged with the measured ones when `stats` are given: ranges
    (npuprep.analyse.measured; `as_stored`: see measured_findings) and the format's precision
    (npuprep.analyse.precision)."""
    findings = static_findings(model, target)
    if stats is None:
        return findings
    from npuprep.analyse.measured import kept_fp32, measured_findings
    from npuprep.analyse.precision import cancellation_findings

    skip = kept_fp32(model) if as_stored else set()
    return findings.merged(measured_findings(model, target, stats, as_stored=as_stored)) \
        .merged(cancellation_findings(model, target, stats, skip))
