"""Compiler report vs our findings: one verdict per ONNX node (ok, mismatch, pin-ignored, ...).

A node is sensitive when a finding (measured range or small-op rule) says the target's
default precision is not enough for it; the compiler's report says what it actually runs
in. `unknown` marks a sensitive or pinned node whose precision the report does not give.
With a plan (npuprep.crosscheck.plan_view) the plan decides: its pins must run in FP32, a
finding its remedies answer (or a static one on a node it keeps in the target format) is
no mismatch, and a measured range it did not answer still is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from npuprep.analyse.finding import Finding, Findings, is_sensitive
from npuprep.crosscheck.names import NodeIndex
from npuprep.crosscheck.plan_view import PlanDecision
from npuprep.crosscheck.record import (
    FP32_OR_WIDER,
    FP32_RANGE,
    PRECISION_ORDER,
    CompilerReport,
    LayerRecord,
    narrowest,
)
from npuprep.model_io import Model
from npuprep.profiles import ResolvedTarget

SCHEMA_VERSION = 1
VERDICTS = ("ok", "non-finite", "mismatch", "pin-ignored", "unknown", "unmapped", "missing")
# `non-finite`: the compiler's own run (RKNN's simulator: q_inf, q_nan) gave Inf or NaN there.
FAILING = ("non-finite", "mismatch", "pin-ignored")
# Failing verdicts first, then the doubtful ones, then ok.
DISPLAY_ORDER = ("non-finite", "mismatch", "pin-ignored", "unknown", "missing", "unmapped", "ok")
# Columns of a per-layer error report that measure a layer on its own (fed golden inputs).
_OWN_COLUMNS = ("simulator_single", "runtime_single_sim")
# Of those, the ones about range only: BF16 (FP32's exponent) is enough for them.
RANGE_RULES = ("hazard.", "range.overflow", "range.headroom", "range.underflow",
               "pattern.layernorm", "pattern.softmax")


@dataclass(frozen=True)
class Verdict:
    """What the compiler did with one ONNX node (or, for `unmapped`, one report name)."""

    node: str
    verdict: str
    op_type: str = ""
    runs_in: str = ""
    needs: str = ""
    layers: tuple[str, ...] = ()
    rules: tuple[str, ...] = ()
    reason: str = ""
    flags: tuple[str, ...] = ()
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "verdict": self.verdict,
            "op_type": self.op_type,
            "runs_in": self.runs_in,
            "needs": self.needs,
            "layers": list(self.layers),
            "rules": list(self.rules),
            "reason": self.reason,
            "flags": list(self.flags),
            "evidence": dict(self.evidence),
        }


@dataclass(frozen=True)
class Crosscheck:
    """All verdicts for one report; truthy when no node is a mismatch or an ignored pin."""

    fingerprint: str
    target: str
    report: str
    report_format: str
    verdicts: tuple[Verdict, ...]
    notes: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return not any(v.verdict in FAILING for v in self.verdicts)

    @property
    def counts(self) -> dict[str, int]:
        return {k: sum(v.verdict == k for v in self.verdicts) for k in VERDICTS}

    def of(self, verdict: str) -> list[Verdict]:
        return [v for v in self.verdicts if v.verdict == verdict]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "crosscheck",
            "fingerprint": self.fingerprint,
            "target": self.target,
            "report": self.report,
            "report_format": self.report_format,
            "passed": bool(self),
            "counts": self.counts,
            "verdicts": [v.to_dict() for v in self.verdicts],
            "notes": list(self.notes),
        }


def crosscheck(
    model: Model,
    report: CompilerReport,
    target: ResolvedTarget,
    *,
    findings: Findings | Iterable[Finding] = (),
    pinned_nodes: Iterable[str] = (),
    index: NodeIndex | None = None,
    decision: PlanDecision | None = None,
) -> Crosscheck:
    """A verdict per ONNX node the report, the findings or the plan mention.

    `decision` (a plan or precision file, read by npuprep.crosscheck.plan_view) gives the
    pins with their reasons and the findings its remedies settle; `pinned_nodes` adds pins.
    A node the report gives no dtype for is assumed to run in `target.fmt`.
    """
    profile, runs_in = target.profile, target.fmt.name
    index = index or NodeIndex(model)
    pins = dict(decision.pins) if decision is not None else {}
    for n in pinned_nodes:
        pins.setdefault(n, "pinned to FP32 by the plan")
    sensitive: dict[str, list[Finding]] = {}
    settled: dict[str, dict[str, str]] = {}
    for f in findings:
        if not is_sensitive(f):
            continue
        node = f.node if f.node in index.op_types else index.producer.get(f.tensor, "")
        why = decision.settles(f) if decision is not None else ""
        # A pattern finding (decomposed LayerNorm, softmax, ...) covers all its members.
        for member in dict.fromkeys([node, *f.evidence.get("members", ())]):
            if member not in index.op_types:
                continue
            # A pinned node's findings are why it is pinned, whatever the plan says elsewhere.
            if why and member not in pins:
                settled.setdefault(member, {}).setdefault(f.rule, why)
            else:
                sensitive.setdefault(member, []).append(f)
    if decision is not None:
        # Nodes a remedy covers say so, findings or not (a shifted softmax has none left).
        for node, why in decision.safe.items():
            if node in index.op_types and node not in pins:
                settled.setdefault(node, {}).setdefault("remedy", why)
        for node, (_, why) in decision.wider.items():
            if node in index.op_types and node not in pins:
                settled.setdefault(node, {}).setdefault("8-bit", f"kept wider than 8 bits: {why}")
    placed: dict[str, list[LayerRecord]] = {}
    reformats: dict[str, list[LayerRecord]] = {}
    verdicts: list[Verdict] = []
    for record in report.records:
        for node in record.onnx_nodes:
            (placed if record.compute else reformats).setdefault(node, []).append(record)
        if record.compute:
            verdicts += _unmapped(record)
    notes = list(report.notes)
    if decision is not None:
        notes += list(decision.notes)
        source = decision.path if decision.kind == "planner" else f"the {decision.kind} file {decision.path}"
        notes.append(f"{source} decides: {len(pins)} nodes pinned to "
                     f"FP32, {len(settled)} nodes it keeps in {decision.precision} despite a "
                     "finding or by a remedy")
    if not report.dtypes_reported:
        notes.append(f"the report gives no dtypes: nodes are assumed to run in the target's "
                     f"precision ({runs_in})")
    compute = set(index.compute_nodes())
    nodes = sorted(set(placed) | compute | set(sensitive) | set(pins),
                   key=lambda n: (index.position.get(n, len(index.position)), n))
    keeps = decision.precision if decision is not None else runs_in
    eight_bit = decision.eight_bit if decision is not None else frozenset()
    for node in nodes:
        verdicts.append(_verdict(node, index, placed.get(node, []), reformats.get(node, []),
                                 sensitive.get(node, []), pins.get(node, ""), report, target,
                                 settled.get(node, {}), _keeps(decision, node, keeps),
                                 decision is not None, node in eight_bit))
    wider = [v for v in verdicts if v.evidence.get("wider_than_planned")]
    if wider:
        names = ", ".join(v.node for v in wider[:5]) + (f" (+{len(wider) - 5})" if len(wider) > 5 else "")
        notes.append(f"{len(wider)} layer(s) the plan puts in {keeps} run wider in the compiler "
                     f"({names}): slower than planned, not less accurate")
    order = {k: i for i, k in enumerate(DISPLAY_ORDER)}
    ranked = sorted(enumerate(verdicts), key=lambda iv: (order[iv[1].verdict], iv[0]))
    return Crosscheck(
        fingerprint=model.fingerprint,
        target=profile.name,
        report=report.path,
        report_format=report.format,
        verdicts=tuple(v for _, v in ranked),
        notes=tuple(notes),
    )


def _keeps(decision: PlanDecision | None, node: str, default: str) -> str:
    """The precision the plan keeps `node` in: its 8-bit decision's wider format, else `default`."""
    wider = decision.wider.get(node) if decision is not None else None
    return wider[0] if wider else default


def _unmapped(record: LayerRecord) -> list[Verdict]:
    names = record.unresolved or (() if record.onnx_nodes else (record.layer,))
    bad = non_finite(record)
    return [
        Verdict(node=name, verdict="non-finite" if bad else "unmapped", op_type=record.op_type,
                runs_in=record.compute_dtype, layers=(record.layer,),
                reason=f"{bad}; {_unmapped_reason(record, name)}" if bad
                else _unmapped_reason(record, name))
        for name in names
    ]


def non_finite(record: LayerRecord) -> str:
    """Why a report layer is non-finite ("" when it is not): its own overflow or one upstream."""
    markers = record.metrics.get("markers", ())
    if not markers:
        return ""
    own = any(str(record.metrics.get(f"{c}_{m}", "")) in markers
              for c in _OWN_COLUMNS for m in ("cos", "euc"))
    where = ("the layer itself leaves the range (single-layer column non-finite)" if own
             else "Inf/NaN arrives from an earlier layer")
    return f"'{record.layer}' is non-finite in the compiler's run ({', '.join(markers)}): {where}"


def _unmapped_reason(record: LayerRecord, name: str) -> str:
    if record.layer.startswith("__myl_"):
        ops = record.layer.removeprefix("__myl_").split("_myl")[0]
        return (f"Myelin kernel without Metadata (fused ops: {ops}); rebuild with TensorRT >= 8.6 "
                "and --profilingVerbosity=detailed to get ONNX names")
    return f"{record.where}: '{name}' is no node of this model (renamed, or added by the compiler)"


def _verdict(node: str, index: NodeIndex, records: list[LayerRecord], reformats: list[LayerRecord],
             found: list[Finding], pin: str, report: CompilerReport,
             target: ResolvedTarget, settled: dict[str, str] | None = None,
             keeps: str = "", decided: bool = False, planned_8bit: bool = False) -> Verdict:
    op_type = index.op_types.get(node, "")
    pinned = bool(pin)
    settled = settled or {}
    rules = tuple(dict.fromkeys(f.rule for f in found))
    range_only = bool(found) and all(r.startswith(RANGE_RULES) for r in rules)
    needs = "fp32" if pinned or (found and not range_only) else ("fp32-range" if found else "")
    adequate = FP32_OR_WIDER if needs == "fp32" else FP32_RANGE
    evidence: dict[str, Any] = {}
    if found:
        evidence["findings"] = [f"{f.rule}: {f.message}" for f in found]
    if pinned:
        evidence["pin"] = pin
    if settled:
        evidence["plan"] = dict(settled)
    metrics = {r.layer: r.metrics for r in records if r.metrics}
    if metrics:
        evidence["metrics"] = metrics
    layers = tuple(r.layer for r in records)
    if not records:
        why = (f"pinned to FP32 by the plan ({pin})" if pinned
               else "sensitive" if found else "a compute node")
        return Verdict(node, "missing", op_type, needs=needs, rules=rules, evidence=evidence,
                       reason=f"{why}, but no report layer names it (folded, renamed or dropped)")
    runs_in = narrowest([r.precision_of(index.outputs.get(node, ())) for r in records])
    if not runs_in and not report.dtypes_reported:
        runs_in = target.fmt.name
        evidence["runs_in_assumed"] = True
    flags = tuple(
        f"Reformat layer '{r.layer}' converts to {narrowest(r.out_dtypes)} next to this node"
        for r in reformats
        if needs and narrowest(r.out_dtypes) and narrowest(r.out_dtypes) not in adequate
    )
    markers = [m for r in records for m in r.metrics.get("markers", ())]
    if markers:
        flags += (f"the report marks non-finite results: {', '.join(dict.fromkeys(markers))}",)
    common = dict(op_type=op_type, runs_in=runs_in, needs=needs, layers=layers, rules=rules,
                  flags=flags, evidence=evidence)
    bad = [why for why in map(non_finite, records) if why]
    if bad:
        also = f"; also needs {needs}, runs in {runs_in}" if needs and runs_in not in adequate else ""
        return Verdict(node, "non-finite", reason=bad[0] + also, **common)
    if needs and not runs_in:
        return Verdict(node, "unknown", reason="the report gives no precision for its layers "
                       "(dynamic shapes?); rebuild with static shapes to check it", **common)
    if pinned and runs_in not in FP32_OR_WIDER:
        return Verdict(node, "pin-ignored", reason=f"the plan pins it to FP32 ({pin}), the "
                       f"compiler runs it in {runs_in}", **common)
    if found and runs_in not in adequate:
        unanswered = "; the plan did not make it safe" if decided else ""
        return Verdict(node, "mismatch", reason=f"{', '.join(rules)}: needs {needs}, the compiler "
                       f"runs it in {runs_in}{unanswered}", **common)
    plan_why = "; ".join(dict.fromkeys(settled.values()))
    if settled and not found and not pinned and _narrower(runs_in, keeps):
        return Verdict(node, "mismatch", reason=f"the plan makes it safe in {keeps} ({plan_why}), "
                       f"the compiler runs it in {runs_in}", **common)
    reason = f"runs in {runs_in or 'a precision the report does not give'}"
    if planned_8bit and runs_in and not evidence.get("runs_in_assumed") and _narrower(keeps, runs_in):
        # Wider than the plan's 8 bits costs speed, never accuracy: a note, not a failure.
        evidence["wider_than_planned"] = keeps
        reason += f", wider than the plan's {keeps} (slower than planned, not less accurate)"
    if rules:
        reason += f", enough for {', '.join(rules)}"
    if settled and not pinned:
        reason += f"; plan: {plan_why}"
    return Verdict(node, "ok", reason=reason, **common)


def _narrower(runs_in: str, than: str) -> bool:
    """Whether precision `runs_in` is narrower than `than` (unknown names are not)."""
    return runs_in in PRECISION_ORDER and than in PRECISION_ORDER and \
        PRECISION_ORDER.index(runs_in) > PRECISION_ORDER.index(than)
