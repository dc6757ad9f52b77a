"""What the plan does for every node a finding flags: one story for check, checklist and convert.

    finding on /ln2/Pow (range.headroom) + plan -> /ln2/Pow: headroom (absmax 4.99e4 > limit
    3.28e4, within fp16 max; kept in fp16)

A node is flagged when a sensitive finding (a small-op rule or a measured range, as
crosscheck counts them) names it, or when the plan pins it. Its fate is read from the plan
itself, never re-decided: the action whose findings name it (pinned, rescaled, shifted,
clamped, host-scaled) or the planner's note on the finding (safe, headroom, non-finite, ...).
Intentional -inf masks are one warning of their own (`range.mask`), never a flagged node.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from npuprep.analyse.finding import Finding, is_sensitive
from npuprep.formatting import number
from npuprep.graph import node_label, producers, walk_graphs
from npuprep.model_io import Model
from npuprep.numerics import formats
from npuprep.plan.actions import Clamp, FindingRef, PinFp32, Rescale, SoftmaxShift
from npuprep.plan.host_scale import host_scaled_outputs
from npuprep.plan.plan import Plan
from npuprep.profiles import ResolvedTarget, TargetProfile

_ABSMAX = re.compile(r"absmax (-?(?:inf|nan|[0-9.]+(?:e[-+]?[0-9]+)?))")
# Most telling first: a node with several findings shows the fate that matters most.
FATES = ("pinned", "host-scaled", "rescaled", "shifted", "clamped", "covered", "non-finite",
         "unplanned", "unmeasured", "headroom", "underflow", "safe")
# What each fate says, for the sentence beside the counts.
FATE_TEXT = {
    "pinned": "pinned to FP32",
    "host-scaled": "rescaled, the output scaled back on the host",
    "rescaled": "rescaled into range (exact)",
    "shifted": "softmax max subtracted (exact)",
    "clamped": "clamped",
    "covered": "answered by an FP32 island upstream",
    "non-finite": "not finite in FP32 already (no precision change fixes it)",
    "unplanned": "no action planned",
    "unmeasured": "unmeasured: calibrate to decide",
    "headroom": "kept in the target format: past the headroom limit, within its max",
    "underflow": "kept in the target format: underflow left as is",
    "safe": "proved safe in the target format by measured ranges",
}


@dataclass(frozen=True)
class NodeStory:
    """One flagged node: its rules, what the plan does (`fate`) and the numbers (`detail`)."""

    node: str
    op_type: str
    rules: tuple[str, ...]
    fate: str
    detail: str
    because: str = ""

    @property
    def needs_fp32(self) -> bool:
        return self.fate == "pinned"

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "op_type": self.op_type, "rules": list(self.rules),
                "fate": self.fate, "detail": self.detail, "because": self.because,
                "needs_fp32": self.needs_fp32}


@dataclass(frozen=True)
class Story:
    """Every flagged node's fate plus the plan's own counts (those convert --plan-only prints)."""

    nodes: tuple[NodeStory, ...]
    actions: dict[str, int]
    pinned: tuple[str, ...]
    declined: int
    masks: tuple[str, ...] = ()

    @property
    def counts(self) -> dict[str, int]:
        return {f: n for f in FATES if (n := sum(s.fate == f for s in self.nodes))}

    def of(self, fate: str) -> list[NodeStory]:
        return [s for s in self.nodes if s.fate == fate]

    def to_dict(self) -> dict[str, Any]:
        return {"actions": dict(self.actions), "action_count": sum(self.actions.values()),
                "pinned_nodes": list(self.pinned), "declined": self.declined,
                "counts": self.counts, "masks": list(self.masks),
                "nodes": [s.to_dict() for s in self.nodes]}


def plan_story(model: Model, profile: TargetProfile, plan: Plan, findings: Iterable[Finding],
               stats: Any = None) -> Story:
    """Each node the findings flag or the plan pins, with what `plan` does there, in graph order."""
    index = _Index(model)
    # The plan records the format it was made for; an 8-bit plan's float part is FP16.
    target = profile.resolve(plan.precision if plan.precision in formats() else "fp16")
    pinned = plan.pinned_nodes()
    flagged: dict[str, list[Finding]] = {n: [] for n in pinned}
    masks: list[str] = []
    for f in findings:
        if f.rule == "range.mask":
            masks += [t for t in f.evidence.get("tensors", [f.tensor]) if t not in masks]
            continue
        if not is_sensitive(f):
            continue
        node = f.node if f.node in index.op_types else index.producer.get(f.tensor, "")
        for member in dict.fromkeys([node, *f.evidence.get("members", ())]):
            if member in index.op_types:
                flagged.setdefault(member, []).append(f)
    judge = _Judge(plan, target, stats, index)
    stories = []
    for node in sorted(flagged, key=index.key):
        found = flagged[node]
        rules = tuple(dict.fromkeys(f.rule for f in found))
        if node in pinned:
            fate, detail, because = "pinned", judge.pin_reason(node), judge.pin_island(node)
        else:
            fate, detail, because = min(
                ((*judge.fate(f), str(FindingRef.of(f))) for f in found),
                key=lambda fd: FATES.index(fd[0]), default=("unplanned", "", ""))
        stories.append(NodeStory(node, index.op_types.get(node, ""), rules, fate, detail, because))
    kinds: dict[str, int] = {}
    for a in plan.actions:
        kinds[a.action] = kinds.get(a.action, 0) + 1
    return Story(tuple(stories), kinds, tuple(sorted(pinned, key=index.key)), len(plan.declined),
                 tuple(masks))


class _Index:
    """Node labels in graph order, their op types, and the producer of every tensor."""

    def __init__(self, model: Model) -> None:
        self.op_types: dict[str, str] = {}
        self.position: dict[str, int] = {}
        self.producer: dict[str, str] = {}
        for scope in walk_graphs(model.graph):
            for node in scope.graph.node:
                label = node_label(node)
                self.op_types[label] = node.op_type
                self.position[label] = len(self.position)
            self.producer.update({t: node_label(n) for t, n in producers(scope.graph).items()})
        self.outputs = {o.name for o in model.graph.output}

    def key(self, node: str) -> tuple[int, str]:
        return (self.position.get(node, len(self.position)), node)


class _Judge:
    """Reads the plan's decision on one finding: the action naming it, else its note."""

    def __init__(self, plan: Plan, target: ResolvedTarget, stats: Any, index: _Index) -> None:
        self.plan, self.target, self.stats, self.index = plan, target, stats, index
        self.limit = target.limit
        self.by_ref: dict[FindingRef, Any] = {}
        for a in plan.actions:
            for ref in a.findings:
                self.by_ref.setdefault(ref, a)
        self.notes: dict[str, str] = {}
        for note in plan.notes:
            head, sep, rest = note.partition(": ")
            if sep:
                self.notes.setdefault(head, rest)

    def absmax(self, tensor: str) -> float | None:
        r = self.stats.tensors.get(tensor) if self.stats is not None and tensor else None
        return None if r is None or not getattr(r, "count", 1) else float(r.absmax)

    def pin_island(self, node: str) -> str:
        """The island holding `node`, named by its first node (nodes of one island group)."""
        return next((f"island {a.nodes[0]}" for a in self.plan.pins() if node in a.nodes), "")

    def pin_reason(self, node: str) -> str:
        pins = [a for a in self.plan.pins() if node in a.nodes]
        if not pins:
            return ""
        pin = pins[0]
        rules = ",".join(dict.fromkeys(f.rule for f in pin.findings))
        how = "user" if pin.forced else "request" if pin.request else ""
        return "; ".join(x for x in (rules or "verify", how) if x)

    def fate(self, f: Finding) -> tuple[str, str]:
        ref = FindingRef.of(f)
        action = self.by_ref.get(ref)
        if isinstance(action, Rescale):
            return self._rescaled(action, f.tensor)
        if isinstance(action, SoftmaxShift):
            x = action.measured.get("input_absmax")
            was = f" (input absmax {number(x)})" if x is not None else ""
            return "shifted", f"max subtracted before {action.exp}{was}: its output <= 1" + (
                " (the shift in FP32)" if action.fp32_shift else "")
        if isinstance(action, Clamp):
            if action.kind == "denominator":
                return "clamped", f"|{action.tensor}| >= {number(action.lo)}"
            lo = "-inf" if action.lo is None else number(action.lo)
            hi = "inf" if action.hi is None else number(action.hi)
            return "clamped", f"{action.tensor} to [{lo}, {hi}]"
        if isinstance(action, PinFp32):
            return "covered", f"island at {action.nodes[0]}" if action.nodes else "island"
        note = self.notes.get(str(ref), "")
        return self._from_note(note, f.tensor)

    def _rescaled(self, rs: Rescale, tensor: str) -> tuple[str, str]:
        e = rs.domain.get(tensor)
        before = self.absmax(tensor)
        if e is None or before is None:
            before, after = rs.absmax, rs.absmax_after
        else:
            # A domain value is the tensor's power-of-two factor (the planner's attach reads it so).
            after = before * 2.0**e
        detail = f"x2^{-rs.k} at {rs.entry}: absmax {number(before)} -> {number(after)} " \
                 f"(limit {number(self.limit)})"
        exits = [t for t in rs.domain if t in self.index.outputs]
        true = {t: a for t in exits if (a := self.absmax(t)) is not None}
        hosted = host_scaled_outputs(exits, true, self.target)
        if hosted:
            return "host-scaled", detail + f"; {', '.join(sorted(hosted))} leaves scaled"
        return "rescaled", detail

    def _from_note(self, note: str, tensor: str) -> tuple[str, str]:
        # The planner's own number (it measured the node's worst output), else the tensor's.
        said = _ABSMAX.search(note)
        absmax = float(said.group(1)) if said else self.absmax(tensor)
        measured = f"absmax {number(absmax)}" if absmax is not None else ""
        if not note:
            return "unplanned", measured
        if "within the limit" in note or " fits " in note:
            return "safe", f"{measured} <= limit {number(self.limit)}".strip()
        if "past the headroom limit" in note:
            return "headroom", f"{measured} > limit {number(self.limit)}, within max".strip()
        if "not finite" in note or "no precision change" in note:
            return "non-finite", measured or "FP32 reference not finite"
        if "underflow" in note and "left as is" in note:
            return "underflow", measured
        if "measure to decide" in note or "calibrate to plan" in note or "needs a measured" in note:
            return "unmeasured", ""
        return "unplanned", measured
