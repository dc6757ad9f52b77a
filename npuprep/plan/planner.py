"""Planner: findings + measured ranges -> Plan, cheapest exact remedy first (rescale, pin, clamp).

Each finding is answered once: by a power-of-two rescale when its tensor's scale domain
has a feasible entry, else by an FP32 island that grows until every exit fits the target
range with headroom (a request where the compiler decides, impossible where the target
cannot pin), else by a clamp where the op allows one (Exp, Log and square inputs,
division denominators). An island holding an Exp also takes in the producers of large
Exp inputs, whose rounding Exp turns into relative error. Findings that measurement shows
safe get a note instead of an action. The planner reads the graph; it never changes it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import onnx

from npuprep.analyse.finding import Finding, Findings
from npuprep.graph import (
    constant_value,
    node_label,
    producers,
    tensor_types,
    topological_order,
    walk_graphs,
)
from npuprep.model_io import Model
from npuprep.numerics import NumberFormat, get_format
from npuprep.ops import LINEAR_WITH_WEIGHTS
from npuprep.plan.actions import Clamp, Declined, FindingRef, PinFp32, Rescale
from npuprep.plan.plan import Plan
from npuprep.profiles import Pinning, Severity, TargetProfile
from npuprep.rewrite.pin import grow_island, merge_islands
from npuprep.rewrite.rescale import check_rescale

# A rescale is declined when it would push more than this share of a domain tensor's
# values below the target's smallest normal (where they lose precision or flush to 0).
UNDERFLOW_SHARE = 0.01
# How many entries the planner tries when walking back from an overflowing tensor.
MAX_ENTRY_TRIES = 3
# How many times the planner deepens k when another domain tensor is still over the limit.
MAX_DEEPEN = 4
# Ops the scale passes through on the walk back from an overflowing tensor to its entry;
# value: positions of the data inputs to follow.
_WALK_THROUGH: dict[str, tuple[int, ...] | None] = {
    **{op: (0,) for op in (
        "Relu", "LeakyRelu", "PRelu", "MaxPool", "AveragePool", "GlobalAveragePool",
        "GlobalMaxPool", "Reshape", "Transpose", "Slice", "Flatten", "Squeeze", "Unsqueeze",
        "Identity", "Neg", "Pad", "Resize", "Upsample", "Split", "Gather", "Expand", "Tile",
        "DepthToSpace", "SpaceToDepth", "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin",
        "Dropout", "Abs",
    )},
    "Add": None, "Sub": None, "Sum": None, "Concat": None, "Max": None, "Min": None,
    "Mul": None, "Div": (0,), "Pow": (0,), "Sqrt": (0,),
}
# Affine normalisations whose gamma/beta can carry a scale (an entry for the rewrite).
_NORMS = {"LayerNormalization", "InstanceNormalization", "GroupNormalization",
          "BatchNormalization"}
# Ops that pass a large magnitude on (planning without measurements grows islands through
# them): sums, products, reductions, data movement. Linear layers with unknown weights,
# roots, divisions and normalisations end it.
_CARRIES_MAGNITUDE = frozenset({
    "Add", "Sub", "Mul", "Sum", "Mean", "Max", "Min", "Neg", "Abs", "Relu", "Pow",
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceL1",
    "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Concat", "Slice",
    "Split", "Gather", "Expand", "Tile", "Where", "Exp",
})
# Ops whose output a static pin finding marks as large (roots, divisions and
# normalisations flagged by a rule shrink what they read).
_MAKES_MAGNITUDE = _CARRIES_MAGNITUDE | LINEAR_WITH_WEIGHTS | {"ReduceSumSquare"}
# Relative error an Exp output may inherit from the rounding of its input: |x| >= 32
# in FP16 (a step of 2^-5 there) is past it. Below that the error stays under the default
# 1% verification threshold and pinning the producer (often a big matmul) would cost more
# than it buys; verification still pins it when the outputs say otherwise.
EXP_INPUT_ERROR = 2.0**-7
# Ops whose output carries its inputs' absolute rounding errors unchanged.
_ADDITIVE = frozenset({
    "Add", "Sub", "Neg", "Sum", "Concat", "Reshape", "Transpose", "Squeeze", "Unsqueeze",
    "Slice", "Gather", "Identity", "Flatten",
})
# Rules whose evidence is a measured range on one tensor.
_RANGE_RULES = ("range.overflow", "range.headroom")


@dataclass
class _Island:
    """An island grown for one or more findings, before merging."""

    island: Any
    findings: list[FindingRef]
    measured: dict[str, float]
    why: str


@dataclass
class _Planner:
    """The planning state for one model: actions so far, declines, notes."""

    model: Model
    profile: TargetProfile
    fmt: NumberFormat
    stats: Any
    forbid: frozenset[str]
    rescales: list[Rescale] = field(default_factory=list)
    # (entry, k) -> constants that rescale scales: {name: {exponent, absmax, min_nonzero}}
    scaled_cache: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    clamps: list[Clamp] = field(default_factory=list)
    islands: list[_Island] = field(default_factory=list)
    declined: list[Declined] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.limit = self.profile.limit(self.fmt)
        self.nodes: dict[str, tuple[onnx.NodeProto, onnx.GraphProto, str]] = {}
        self.order: dict[str, int] = {}
        self.produced_by: dict[str, onnx.NodeProto] = {}
        for scope in walk_graphs(self.model.graph):
            for node in topological_order(scope.graph):
                label = node_label(node)
                self.nodes[label] = (node, scope.graph, scope.path)
                self.order[label] = len(self.order)
            self.produced_by.update(producers(scope.graph))
        inits = {i.name for i in self.model.graph.initializer}
        self.graph_inputs = [i.name for i in self.model.graph.input if i.name not in inits]
        self.graph_outputs = {o.name for o in self.model.graph.output}
        self.static_hot: set[str] = set()
        self.hot_cache: dict[str, bool] = {}
        self.static_cool: set[str] = set()
        self.types = tensor_types(self.model.proto)
        self.checks: dict[tuple[str, int], Any] = {}

    # ------------------------------------------------------------ measurements

    def range_of(self, tensor: str) -> Any | None:
        if self.stats is None or not tensor:
            return None
        return self.stats.tensors.get(tensor)

    def fits(self, tensor: str) -> bool:
        """Does `tensor` fit the target with headroom? Unmeasured tensors fit, except the
        static hazards' outputs when planning without measurements."""
        if self.stats is None:
            return not self.hot(tensor)
        r = self.range_of(tensor)
        if r is None:
            return True
        return r.absmax <= self.limit and not (r.nan_count or r.inf_count)

    def hot(self, tensor: str) -> bool:
        """Without measurements: a static hazard's output, or what carries its magnitude on
        (sums, products, reductions, data movement) until an op that shrinks it or the end
        of the rule's pattern. Iterative: deep graphs would exhaust Python's recursion."""
        stack = [tensor]
        while stack:
            t = stack[-1]
            if t in self.hot_cache:
                stack.pop()
                continue
            node = self.produced_by.get(t)
            if t in self.static_hot or t in self.static_cool or node is None \
                    or node.op_type not in _CARRIES_MAGNITUDE:
                self.hot_cache[t] = t in self.static_hot
                stack.pop()
                continue
            inputs = [i for i in node.input if i and i != t]
            pending = [i for i in inputs if i not in self.hot_cache and i not in stack]
            if pending:
                stack.extend(pending)
                continue
            self.hot_cache[t] = any(self.hot_cache.get(i, False) for i in inputs)
            stack.pop()
        return self.hot_cache[tensor]

    def worst_output(self, label: str) -> tuple[str, Any] | None:
        """The measured float output of a node with the largest magnitude."""
        node = self.nodes[label][0] if label in self.nodes else None
        if node is None:
            return None
        measured = [(o, self.range_of(o)) for o in node.output if self.range_of(o) is not None]
        if not measured:
            return None
        return max(measured, key=lambda item: (item[1].absmax, item[0]))

    # ------------------------------------------------------------ dispatch

    def order_key(self, f: Finding) -> tuple[int, str, str]:
        label = f.node if f.node in self.nodes else self.producer_label(f.tensor)
        return (self.order.get(label, len(self.order)), f.rule, f.tensor)

    def producer_label(self, tensor: str) -> str:
        node = self.produced_by.get(tensor)
        return node_label(node) if node is not None else ""

    def handle(self, f: Finding) -> None:
        ref = FindingRef.of(f)
        where = f.tensor or f.node
        if f.rule == "range.nonfinite":
            self.notes.append(
                f"{ref}: the FP32 reference itself is not finite there; fix the model or the "
                "data, no precision change can"
            )
            return
        if f.rule == "range.underflow":
            self.fix_underflow(f, ref)
            return
        if f.rule == "init.out_of_range":
            self.fix_weights(f, ref)
            return
        if f.rule.startswith("init."):
            if f.severity >= Severity.WARNING:
                self.notes.append(f"{ref}: no plan action; lowering rounds this constant "
                                  f"({f.remedy_text or f.remedy})")
            return
        if f.rule in _RANGE_RULES and f.tensor:
            if self.attach(ref, f.tensor):
                return
            r = self.range_of(f.tensor)
            if r is not None and r.absmax <= self.limit and not (r.nan_count or r.inf_count):
                self.notes.append(self.safe_note(f, ref, r.absmax))
                return
            self.fix_overflow(f, ref, f.tensor)
            return
        if f.remedy not in ("rescale", "pin_fp32", "clamp"):
            if f.severity >= Severity.WARNING:
                text = f.remedy_text or f.remedy
                self.notes.append(f"{ref}: no plan action ({text})")
            return
        worst = self.worst_output(f.node) if self.stats is not None else None
        if worst is not None:
            tensor, r = worst
            if self.attach(ref, tensor):
                return
            if r.absmax <= self.limit and not (r.nan_count or r.inf_count):
                self.notes.append(self.safe_note(f, ref, r.absmax))
                return
            self.fix_overflow(f, ref, tensor)
            return
        if f.severity < Severity.WARNING or f.rule.startswith("autocast."):
            self.notes.append(f"{ref}: measure to decide ({f.remedy_text or f.remedy})")
            return
        island = next((i for i in self.islands if f.node in i.island.nodes), None)
        if island is not None:
            island.findings.append(ref)
            return
        self.fix_static(f, ref, where)

    def safe_note(self, f: Finding, ref: FindingRef, absmax: float) -> str:
        note = (
            f"{ref}: measured absmax {absmax:.6g} is within the limit {self.limit:.6g} "
            f"(headroom {self.profile.headroom:g} x {self.fmt.name} max); no action"
        )
        gain = f.evidence.get("error_gain")
        if isinstance(gain, int | float) and gain * self.fmt.eps > EXP_INPUT_ERROR:
            # Range is fine; precision is not the planner's to judge, verification measures it.
            note += (f"; it amplifies rounding error {gain:g}x ({gain * self.fmt.eps:.2g} "
                     f"relative in {self.fmt.name}): if verification fails there, pin what "
                     "feeds it")
        return note

    def attach(self, ref: FindingRef, tensor: str) -> bool:
        """Credit a finding to an action that already covers its tensor."""
        for i, rs in enumerate(self.rescales):
            p = rs.domain.get(tensor)
            r = self.range_of(tensor)
            if p is not None and r is not None and r.absmax * 2.0**p <= self.limit:
                self.rescales[i] = replace(rs, findings=rs.findings + (ref,))
                return True
        label = self.producer_label(tensor)
        for island in self.islands:
            if label in island.island.nodes:
                island.findings.append(ref)
                return True
        for i, c in enumerate(self.clamps):
            if any(tensor in self.nodes[n][0].output for n in c.consumers if n in self.nodes):
                self.clamps[i] = replace(c, findings=c.findings + (ref,))
                return True
        return False

    # ------------------------------------------------------------ overflow

    def fix_overflow(self, f: Finding, ref: FindingRef, tensor: str) -> None:
        r = self.range_of(tensor)
        if r is not None and (r.nan_count or r.inf_count):
            self.notes.append(
                f"{ref}: the FP32 reference of {tensor} has {r.nan_count} NaN and "
                f"{r.inf_count} Inf values; no precision change can fix that"
            )
            return
        declines: list[str] = []
        if r is not None:
            reason = self.try_rescale(ref, tensor, r.absmax)
            if reason is None:
                return
            declines.append(f"rescale declined: {reason}")
            if r.absmax <= self.fmt.max and f.severity < Severity.ERROR:
                # Within the format, only short of headroom: pinning costs speed, so it
                # waits until the profile calls this an error.
                self.notes.append(
                    f"{ref}: absmax {r.absmax:.6g} is past the headroom limit {self.limit:.6g} "
                    f"but within {self.fmt.name} max; left as is ({declines[0]}); set "
                    "severity.headroom to error in the profile to pin it"
                )
                return
        else:
            declines.append("rescale needs a measured range (run with --data)")
        reason = self.try_pin(ref, tensor, declines)
        if reason is None:
            return
        declines.append(f"FP32 pin declined: {reason}")
        reason = self.try_clamp(f, ref, tensor, declines)
        if reason is None:
            return
        self.declined.append(Declined("clamp", tensor, reason, (ref,)))
        self.notes.append(f"{ref}: unresolved; " + "; ".join(declines + [f"clamp declined: {reason}"]))

    def fix_static(self, f: Finding, ref: FindingRef, where: str) -> None:
        """A rule's remedy without measurements: pin or clamp where the rule says so."""
        tensor = f.tensor
        if not tensor and f.node in self.nodes:
            tensor = next((o for o in self.nodes[f.node][0].output if o), "")
        if f.remedy == "clamp":
            reason = self.try_clamp(f, ref, tensor, [])
            if reason is not None:
                self.declined.append(Declined("clamp", where, reason, (ref,)))
            return
        if f.remedy == "pin_fp32":
            members = [m for m in f.evidence.get("members", [f.node]) if m in self.nodes]
            final = f.evidence.get("output", "")
            for m in members:
                node = self.nodes[m][0]
                if node.op_type in _MAKES_MAGNITUDE:
                    self.static_hot.update(o for o in node.output if o and o != final)
            if final:
                self.static_cool.add(final)
            self.hot_cache.clear()
            declines = ["no measured range: the rule asks for FP32"]
            reason = self.try_pin(ref, tensor, declines, seeds=members)
            if reason is None:
                return
            declines.append(f"FP32 pin declined: {reason}")
            reason = self.try_clamp(f, ref, tensor, declines)
            if reason is not None:
                self.declined.append(Declined("clamp", where, reason, (ref,)))
                self.notes.append(f"{ref}: unresolved; " + "; ".join(declines + [f"clamp declined: {reason}"]))
            return
        self.declined.append(Declined("rescale", where, "rescale needs measured ranges (run with --data)", (ref,)))
        self.notes.append(f"{ref}: rescale suggested; calibrate to plan it")

    def fix_weights(self, f: Finding, ref: FindingRef) -> None:
        """A constant beyond the target's range: rescale its layer, else keep it in FP32."""
        worst = abs(float(f.evidence.get("worst", 0.0) or 0.0))
        if 0 < worst <= self.fmt.max:
            self.notes.append(f"{ref}: its largest value {worst:.6g} fits {self.fmt.name}; no action")
            return
        rescaled = self.rescaled_constant(f.tensor)
        if rescaled is not None and rescaled[1] <= self.fmt.max:
            entry, after = rescaled
            self.notes.append(f"{ref}: the rescale of {entry} scales it to {after:.6g}, which fits "
                              f"{self.fmt.name}; no action")
            return
        declines: list[str] = []
        if f.remedy == "rescale" and f.node in self.nodes and worst > 0:
            check, reason = self.checked(f.node, _needed_k(worst, self.limit))
            if check is not None:
                action = self.rescale_action(f.node, check, (ref,), f.tensor, worst, "")
                k = check.k
                self.rescales.append(replace(action, absmax_after=worst * 2.0**-k, why=(
                    f"weight {f.tensor} reaches {worst:.6g}; scaling it by 2^{-k} brings it "
                    f"within {self.limit:.6g}, exactly; absorbed by "
                    f"{', '.join(action.absorbers) or 'nothing'}")))
                return
            self.declined.append(Declined("rescale", f.node, reason, (ref,)))
            declines.append(f"rescale declined: {reason}")
        elif f.remedy == "fold":
            declines.append("folding is not a plan action")
        if f.node not in self.nodes:
            self.notes.append(f"{ref}: no consumer node to keep in FP32")
            return
        declines.append(f"the weight cannot be stored in {self.fmt.name}")
        node = self.nodes[f.node][0]
        if self.stats is None and node.op_type in _MAKES_MAGNITUDE:
            # Unmeasured: a weight past the format's max makes its layer's output large too.
            self.static_hot.update(o for o in node.output if o)
            self.hot_cache.clear()
        reason = self.try_pin(ref, f.tensor, declines, seeds=[f.node])
        if reason is not None:
            self.notes.append(f"{ref}: unresolved; " + "; ".join(declines + [reason]))

    def rescaled_constant(self, name: str) -> tuple[str, float] | None:
        """(entry, new abs-max) when a planned rescale scales constant `name` as it absorbs."""
        from npuprep.rewrite.rescale import apply_rescale

        for rs in self.rescales:
            key = (rs.entry, rs.k)
            if key not in self.scaled_cache:
                done = apply_rescale(self.model.proto, rs.entry, rs.k)
                self.scaled_cache[key] = dict(done.details.get("scaled_constants", {})) if done else {}
            if name in self.scaled_cache[key]:
                return rs.entry, float(self.scaled_cache[key][name]["absmax"])
        return None

    # ------------------------------------------------------------ rescale

    def try_rescale(self, ref: FindingRef, tensor: str, absmax: float) -> str | None:
        """Plan a rescale for an overflowing tensor; None on success, else why not."""
        for i, rs in enumerate(self.rescales):
            if tensor in rs.domain:
                need = rs.k + _needed_k(absmax * 2.0 ** rs.domain[tensor], self.limit)
                check, reason = self.checked(rs.entry, need, tensor)
                if check is None:
                    self.declined.append(Declined("rescale", rs.entry, reason, (ref,)))
                    return reason
                self.rescales[i] = self.rescale_action(
                    rs.entry, check, rs.findings + (ref,), tensor, absmax, "deepened"
                )
                return None
        candidates, stop = self.entries_for(tensor)
        if not candidates:
            self.declined.append(Declined("rescale", tensor, stop, (ref,)))
            return stop
        reasons: list[str] = []
        for entry in candidates:
            check, reason = self.checked(entry, _needed_k(absmax, self.limit), tensor)
            if check is not None:
                self.rescales.append(self.rescale_action(entry, check, (ref,), tensor, absmax, ""))
                return None
            self.declined.append(Declined("rescale", entry, reason, (ref,)))
            reasons.append(reason)
        return reasons[-1]

    def checked(self, entry: str, k: int, focus: str = "") -> tuple[Any | None, str]:
        """check_rescale, then the stats: every domain tensor within the limit (k grows
        until it is) and none pushed under the smallest normal in a harmful share."""
        fitted = not focus or k < 0
        for _ in range(MAX_DEEPEN):
            if (entry, k) not in self.checks:
                self.checks[(entry, k)] = check_rescale(self.model.proto, entry, k)
            check = self.checks[(entry, k)]
            if not check:
                return None, check.reason
            p_focus = check.exponents.get(focus, 0) if focus else 0
            if focus and p_focus * k >= 0:
                return None, f"scaling {entry} does not reach {focus}"
            r_focus = self.range_of(focus)
            if not fitted and r_focus is not None and p_focus != -k:
                # The focus carries the scale to a power (a square): size k for that power.
                fitted = True
                k_focus = _needed_k(r_focus.absmax, self.limit, per=-p_focus / k)
                if k_focus != k:
                    k = k_focus
                    continue
            worst, worst_tensor = 0.0, ""
            for t, p in sorted(check.exponents.items()):
                if p == 0:
                    continue
                r = self.range_of(t)
                if r is None:
                    return None, f"no measured range for domain tensor {t}"
                reason = self.underflow_veto(entry, k, t, p, r)
                if reason:
                    return None, reason
                if r.absmax * 2.0**p > worst:
                    worst, worst_tensor = r.absmax * 2.0**p, t
            if worst <= self.limit:
                return check, check.reason
            if k < 0:
                break
            k += _needed_k(worst, self.limit)
        return None, (
            f"2^{-k} on {entry} leaves {worst_tensor} at {worst:.6g}, over the limit {self.limit:.6g}"
        )

    def underflow_veto(self, entry: str, k: int, t: str, p: int, r: Any) -> str:
        """Why scaling `t` by 2^p flushes too much of it, or "" when it does not."""
        if p >= 0:
            return ""
        after = self.fmt.min_normal / 2.0**p
        newly, before = r.fraction_below(after), r.fraction_below(self.fmt.min_normal)
        if newly is None or before is None:
            # No histogram (an ordinary tensor): what drops under the smallest normal is
            # harmless while it also lies under the scaled tensor's own precision floor.
            floor = r.absmax * 2.0**p * self.fmt.eps
            if floor >= self.fmt.min_normal:
                return ""
            return (f"2^{-k} on {entry} brings {t} to {r.absmax * 2.0**p:.3g}, where its "
                    f"precision floor {floor:.3g} lies under the smallest {self.fmt.name} "
                    f"normal, and no histogram shows how much would flush")
        pushed = newly - before
        if pushed <= UNDERFLOW_SHARE:
            return ""
        return (f"2^{-k} on {entry} pushes {pushed:.1%} of {t} below the smallest "
                f"{self.fmt.name} normal ({self.fmt.min_normal:.3g})")

    def rescale_action(
        self, entry: str, check: Any, refs: tuple[FindingRef, ...], tensor: str,
        absmax: float, how: str,
    ) -> Rescale:
        k = check.k
        domain = {t: p for t, p in sorted(check.exponents.items()) if p != 0}
        absorbers = tuple(dict.fromkeys([a.node for a in check.absorbers] + list(check.exits)))
        after = absmax * 2.0 ** domain.get(tensor, -k)
        direction = "down" if k > 0 else "up"
        why = (
            f"measured absmax {absmax:.6g} of {tensor} against the limit {self.limit:.6g} "
            f"(headroom {self.profile.headroom:g} x {self.fmt.name} max); a power-of-two "
            f"rescale {direction} is exact and free at run time, the cheapest remedy: "
            f"{entry} x 2^{-k}, absorbed by {', '.join(absorbers) or 'nothing'}"
        )
        if how:
            why += f" ({how} to cover {tensor})"
        return Rescale(
            entry=entry, k=k, domain=domain, absorbers=absorbers, findings=refs,
            absmax=absmax, limit=self.limit, absmax_after=after, why=why,
        )

    def entries_for(self, tensor: str) -> tuple[list[str], str]:
        """Walk back from `tensor` through scale-commuting ops to candidate entries."""
        candidates: list[str] = []
        current = tensor
        seen: set[str] = set()
        while current not in seen and len(candidates) < MAX_ENTRY_TRIES:
            seen.add(current)
            if current in self.graph_inputs:
                candidates.append(current)
                return candidates, ""
            node = self.produced_by.get(current)
            if node is None:
                return candidates, f"{current} is a constant; nothing to rescale"
            label = node_label(node)
            if self.nodes[label][2] != "main":
                return candidates, f"{label} is inside a subgraph ({self.nodes[label][2]}); rescale works on the main graph"
            if self.is_entry(node):
                candidates.append(label)
            follow = _WALK_THROUGH.get(node.op_type, ())
            if node.op_type in ("Mul", "Div") and not self.has_constant_input(node):
                # x*x carries the scale squared; other products of activations stop here.
                square = node.op_type == "Mul" and node.input[0] == node.input[1]
                follow = (0,) if square else ()
            data = [i for pos, i in enumerate(node.input)
                    if i and (follow is None or pos in follow)
                    and constant_value(self.nodes[label][1], i) is None]
            if not data:
                stop = f"{node.op_type} node {label} does not commute with scaling"
                return candidates, stop
            current = max(data, key=lambda t: (self.range_of(t).absmax if self.range_of(t) else -1.0, t))
        return candidates, f"no scalable entry found upstream of {tensor}"

    def is_entry(self, node: onnx.NodeProto) -> bool:
        graph = self.nodes[node_label(node)][1]
        if node.op_type in LINEAR_WITH_WEIGHTS:
            return len(node.input) > 1 and constant_value(graph, node.input[1]) is not None
        if node.op_type in _NORMS:
            return len(node.input) > 1 and constant_value(graph, node.input[1]) is not None
        return node.op_type in ("Mul", "Div") and self.has_constant_input(node)

    def has_constant_input(self, node: onnx.NodeProto) -> bool:
        graph = self.nodes[node_label(node)][1]
        return any(constant_value(graph, i) is not None for i in node.input if i)

    # ------------------------------------------------------------ pin

    def try_pin(self, ref: FindingRef, tensor: str, declines: list[str],
                seeds: list[str] | None = None) -> str | None:
        if self.profile.fp32_pinning is Pinning.NONE:
            reason = f"target {self.profile.name} cannot pin nodes to FP32 (fp32_pinning: none)"
            self.declined.append(Declined("pin_fp32", tensor, reason, (ref,)))
            return reason
        seeds = seeds or self.seeds_for(tensor, ref)
        if not seeds:
            reason = f"no node computes {tensor}"
            self.declined.append(Declined("pin_fp32", tensor, reason, (ref,)))
            return reason
        grown = [grow_island(self.model.proto, seed, self.fits, types=self.types) for seed in seeds]
        parts = grown if len(grown) == 1 else list(merge_islands(
            self.model.proto, grown, self.fits, max_gap=0, types=self.types))
        precise = self.precise_inputs({n for part in parts for n in part.nodes})
        parts += [grow_island(self.model.proto, label, self.fits, types=self.types)
                  for label in precise]
        members = {n for part in parts for n in part.nodes}
        unfit = [t for part in parts for t in part.unfit_exits]
        banned = sorted(members & self.forbid, key=lambda n: self.order.get(n, 0))
        if banned:
            reason = f"the FP32 island would include {', '.join(banned)}, which forbid_pin excludes"
            self.declined.append(Declined("pin_fp32", tensor, reason, (ref,)))
            return reason
        if unfit:
            reason = (f"the FP32 island from {', '.join(seeds)} cannot close: "
                      f"{', '.join(unfit)} would still leave it beyond the limit "
                      f"{self.limit:.6g}")
            self.declined.append(Declined("pin_fp32", tensor, reason, (ref,)))
            return reason
        measured: dict[str, float] = {}
        r = self.range_of(tensor)
        if r is not None:
            measured["absmax"] = float(r.absmax)
            measured["limit"] = float(self.limit)
        request = self.profile.fp32_pinning is Pinning.COMPILER_DECIDES
        why = "; ".join(declines) + (
            f"; pinning to FP32 is exact and costs speed: the island grows from "
            f"{', '.join(seeds)} until every exit fits {self.fmt.name} with headroom"
        )
        if precise:
            why += (f"; {', '.join(precise)} join the island: Exp turns the {self.fmt.name} "
                    "rounding of its input into a relative error of its output")
        if request:
            why += "; the compiler decides precision, so this is a request (crosscheck verifies it)"
        for part in parts:
            self.islands.append(_Island(part, [ref], dict(measured), why.lstrip("; ")))
        return None

    def precise_inputs(self, members: set[str]) -> list[str]:
        """Producers outside the island whose rounding an Exp inside would turn into a
        relative error above EXP_INPUT_ERROR (exp(x + d) = exp(x)(1 + d)): the Exp input,
        and through additive ops the tensors summed into it."""
        todo = [self.nodes[n][0].input[0] for n in sorted(members)
                if self.nodes[n][0].op_type == "Exp"]
        extra: list[str] = []
        seen: set[str] = set()
        while todo:
            tensor = todo.pop(0)
            node = self.produced_by.get(tensor)
            r = self.range_of(tensor)
            if tensor in seen or node is None or r is None or not r.absmax > 0:
                continue
            seen.add(tensor)
            label = node_label(node)
            half_step = 2.0 ** math.floor(math.log2(r.absmax)) * self.fmt.eps / 2
            if label in members or label in extra or half_step <= EXP_INPUT_ERROR:
                continue
            extra.append(label)
            if node.op_type in _ADDITIVE:
                todo.extend(i for i in node.input if i)
        return extra

    def seeds_for(self, tensor: str, ref: FindingRef) -> list[str]:
        if ref.node in self.nodes and ref.rule not in _RANGE_RULES:
            return [ref.node]
        label = self.producer_label(tensor)
        if label:
            return [label]
        return [node_label(n) for _label, (n, _g, _s) in self.nodes.items() if tensor in n.input]

    # ------------------------------------------------------------ clamp

    def try_clamp(self, f: Finding, ref: FindingRef, tensor: str, declines: list[str]) -> str | None:
        label = f.node if f.node in self.nodes and f.rule not in _RANGE_RULES else self.producer_label(tensor)
        if label not in self.nodes:
            return f"no node to clamp around {tensor}"
        node, graph, _scope = self.nodes[label]
        limit = self.limit
        prefix = "; ".join(declines)
        prefix = f"{prefix}; " if prefix else ""
        if node.op_type == "Exp":
            hi = _floor3(math.log(limit))
            x = node.input[0]
            why = (f"{prefix}clip the input of Exp at ln(limit) = {hi:g} so exp stays within "
                   f"{limit:.6g}; only values that would overflow change")
            self.clamps.append(Clamp(x, None, hi, "exp", (label,), (ref,), self.clamp_numbers(x, hi), why))
            return None
        square_of = _square_input(node, graph)
        if square_of is not None:
            b = _floor3(math.sqrt(limit))
            why = (f"{prefix}clip the input of the square at +-sqrt(limit) = {b:g} so x^2 stays "
                   f"within {limit:.6g}; only values that would overflow change")
            self.clamps.append(Clamp(square_of, -b, b, "square", (label,), (ref,),
                                     self.clamp_numbers(square_of, b), why))
            return None
        if node.op_type in ("Div", "Reciprocal"):
            d = node.input[1] if node.op_type == "Div" else node.input[0]
            num = self.range_of(node.input[0]) if node.op_type == "Div" else None
            numerator = float(num.absmax) if num is not None else 1.0
            lo = max(self.fmt.min_normal, 2.0 ** math.ceil(math.log2(max(numerator, 1e-30) / limit)))
            measured = {"numerator_absmax": numerator, "limit": float(limit)}
            share = self.share(d, lo, below=True)
            if share is not None:
                measured["share_below_guard"] = share
            why = (f"{prefix}keep |{d}| >= {lo:.6g} so |numerator| {numerator:.6g} / |{d}| "
                   f"stays within {limit:.6g}; the sign is kept")
            self.clamps.append(Clamp(d, lo, None, "denominator", (label,), (ref,), measured, why))
            return None
        if node.op_type == "Log":
            lo = self.fmt.min_normal
            x = node.input[0]
            why = (f"{prefix}clip the input of Log at the smallest {self.fmt.name} normal "
                   f"{lo:.3g} so it never sees 0; only values that flush change")
            measured = {"bound": lo}
            share = self.share(x, lo, below=True)
            if share is not None:
                measured["share_clipped"] = share
            self.clamps.append(Clamp(x, lo, None, "log", (label,), (ref,), measured, why))
            return None
        return f"{node.op_type} node {label} takes no clamp (only Exp, Log, squares, divisions)"

    def clamp_numbers(self, tensor: str, bound: float) -> dict[str, float]:
        r = self.range_of(tensor)
        out = {"bound": float(bound), "limit": float(self.limit)}
        if r is not None:
            out["absmax"] = float(r.absmax)
        share = self.share(tensor, bound, below=False)
        if share is not None:
            out["share_clipped"] = share
        return out

    def share(self, tensor: str, bound: float, *, below: bool) -> float | None:
        """Measured share of |x| below (or above) a bound; None when unmeasured."""
        r = self.range_of(tensor)
        if r is None:
            return None
        value = r.fraction_below(bound) if below else r.fraction_above(bound)
        return None if value is None else float(value)

    # ------------------------------------------------------------ underflow

    def fix_underflow(self, f: Finding, ref: FindingRef) -> None:
        r = self.range_of(f.tensor)
        if r is None:
            self.notes.append(f"{ref}: underflow needs a measured range to plan a rescale")
            return
        scaled = next((rs for rs in self.rescales if f.tensor in rs.domain), None)
        if scaled is not None:
            reason = f"{f.tensor} is already in the scale domain of {scaled.entry} (2^{-scaled.k})"
            self.declined.append(Declined("rescale", f.tensor, reason, (ref,)))
            self.notes.append(f"{ref}: underflow left as is; {reason}")
            return
        base = r.fraction_below(self.fmt.min_normal)
        if base is None:
            self.notes.append(f"{ref}: no histogram of {f.tensor}; recalibrate with full detail to plan a rescale")
            return
        j = 0
        for step in range(1, 64):
            if r.absmax * 2.0**step > self.limit:
                break
            lifted = r.fraction_below(self.fmt.min_normal / 2.0**step)
            if lifted is not None and lifted <= UNDERFLOW_SHARE:
                j = step
                break
        if j == 0:
            reason = (f"no power of two lifts {f.tensor} out of the subnormal range without "
                      f"passing the limit {self.limit:.6g} (absmax {r.absmax:.6g})")
            self.declined.append(Declined("rescale", f.tensor, reason, (ref,)))
        else:
            candidates, stop = self.entries_for(f.tensor)
            for entry in candidates:
                check, reason = self.checked(entry, -j, f.tensor)
                if check is not None:
                    action = self.rescale_action(entry, check, (ref,), f.tensor, r.absmax, "")
                    self.rescales.append(replace(action, why=(
                        f"{base:.1%} of {f.tensor} lies below the smallest "
                        f"{self.fmt.name} normal; " + action.why)))
                    return
                self.declined.append(Declined("rescale", entry, reason, (ref,)))
            if not candidates:
                self.declined.append(Declined("rescale", f.tensor, stop, (ref,)))
        if f.severity >= Severity.ERROR:
            self.try_pin(ref, f.tensor, ["underflow with no feasible rescale"])
        else:
            self.notes.append(f"{ref}: underflow left as is (warning; no feasible rescale)")

    # ------------------------------------------------------------ result

    def pins(self) -> list[PinFp32]:
        """Merge the islands (fewer Casts) and turn each into a PinFp32 action."""
        if not self.islands:
            return []
        grown = [i.island for i in self.islands]
        merged = merge_islands(self.model.proto, grown, self.fits, types=self.types)
        if any(set(m.nodes) & self.forbid for m in merged):
            # Bridging pulled in a forbidden node: merge only what touches.
            merged = merge_islands(self.model.proto, grown, self.fits, max_gap=0, types=self.types)
        request = self.profile.fp32_pinning is Pinning.COMPILER_DECIDES
        out: list[PinFp32] = []
        for island in merged:
            members = set(island.nodes)
            parts = [i for i in self.islands if members & set(i.island.nodes)]
            refs = tuple(dict.fromkeys(r for p in parts for r in p.findings))
            measured: dict[str, float] = {}
            for p in parts:
                for k, v in p.measured.items():
                    measured[k] = max(measured.get(k, v), v)
            # Graph outputs stay FP32; the exits that matter feed target-precision nodes.
            inner = [t for t in island.exit_tensors if t not in self.graph_outputs]
            known = [r.absmax for r in map(self.range_of, inner) if r is not None]
            if known:
                measured["exit_absmax"] = float(max(known))
            nodes = tuple(sorted(members, key=lambda n: (self.order.get(n, len(self.order)), n)))
            out.append(PinFp32(
                nodes=nodes, exit_tensors=tuple(island.exit_tensors), findings=refs,
                measured=measured, request=request,
                why=" | ".join(dict.fromkeys(p.why for p in parts)),
            ))
        return sorted(out, key=lambda a: (self.order.get(a.nodes[0], 0), a.nodes))


def make_plan(
    model: Model,
    profile: TargetProfile,
    stats: Any,
    findings: Findings | Iterable[Finding],
    *,
    precision: str | None = None,
    forbid_pin: Iterable[str] = (),
) -> Plan:
    """One action per finding, cheapest exact remedy first; deterministic order.

    `stats` is a CalibrationStats (or None: plan from the static findings alone);
    `precision` overrides the profile's default precision; `forbid_pin` names nodes
    no FP32 island may contain.
    """
    fmt = get_format(precision or profile.default_precision)
    planner = _Planner(model, profile, fmt, stats, frozenset(forbid_pin))
    items = sorted(findings, key=planner.order_key)
    for f in items:
        planner.handle(f)
    if stats is None:
        planner.notes.insert(0, "planned without measured ranges: static findings only")
    actions = (*planner.rescales, *planner.clamps, *planner.pins())
    return Plan(
        fingerprint=model.fingerprint,
        target=profile.name,
        precision=fmt.name,
        actions=actions,
        declined=tuple(planner.declined),
        forbid_pin=tuple(sorted(planner.forbid)),
        notes=tuple(planner.notes),
    )


def _needed_k(absmax: float, limit: float, per: float = 1.0) -> int:
    """Smallest k >= 1 with absmax * 2^(-k * per) <= limit."""
    k = max(1, math.ceil(math.log2(absmax / limit) / per)) if absmax > 0 else 1
    while absmax * 2.0 ** (-k * per) > limit:
        k += 1
    return k


def _floor3(x: float) -> float:
    """Round a bound down to three decimals, so it reads well and stays on the safe side."""
    return math.floor(x * 1000) / 1000


def _square_input(node: onnx.NodeProto, graph: onnx.GraphProto) -> str | None:
    """The x of Mul(x, x) or Pow(x, 2), else None."""
    if node.op_type == "Mul" and len(node.input) == 2 and node.input[0] == node.input[1]:
        return node.input[0]
    if node.op_type == "Pow" and len(node.input) == 2:
        exponent = constant_value(graph, node.input[1])
        if exponent is not None and exponent.size == 1 and float(exponent.reshape(())) == 2.0:
            return node.input[0]
    return None

