"""What every remedy reads while planning: the graph's index, measured ranges, actions so far.

A `Problem` is one finding to answer; a remedy (one file each in plan/) proposes an action
for it, or says why it declines. The context records what was decided; it never changes
the graph.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import onnx

from npuprep.analyse.finding import Finding
from npuprep.analyse.precision import INHERITED_ERROR
from npuprep.graph import (
    consumers,
    node_label,
    producers,
    tensor_types,
    topological_order,
    walk_graphs,
)
from npuprep.model_io import Model
from npuprep.numerics import NumberFormat
from npuprep.ops import ADDITIVE, CARRIES_MAGNITUDE, MAC_OPS
from npuprep.plan.actions import (
    Action,
    Clamp,
    Declined,
    FindingRef,
    PinFp32,
    Rescale,
    SoftmaxShift,
    Unpinnable,
)
from npuprep.profiles import ResolvedTarget, TargetProfile

# Relative error an Exp output may inherit from the rounding of its input: |x| >= 32
# in FP16 (a step of 2^-5 there) is past it, |x| >= 4 in BF16. Below that the error stays
# under the default 1% verification threshold and pinning the producer (often a big matmul)
# would cost more than it buys; verification still pins it when the outputs say otherwise.
# The same bound as a cancellation's (npuprep.analyse.precision).
EXP_INPUT_ERROR = INHERITED_ERROR
# Rules whose evidence is a measured range on one tensor.
RANGE_RULES = ("range.overflow", "range.headroom")

# What a remedy answers: an action (or a few that go together), the reasons it declined,
# or None (not its kind of problem).
Outcome = Action | list[Action] | tuple[Declined, ...] | None


@dataclass(frozen=True)
class Problem:
    """One finding to answer. `kind`: `overflow` (a measured tensor past the limit),
    `static` (a rule's remedy, nothing measured), `weights` (a constant beyond the format),
    `tiny_weights` (a layer's weights the format stores as 0 or subnormals), `underflow`, or
    `precision` (within range, but the format's significand is too short
    there: a cancellation, a softmax's logits too coarse for exp). `absmax` is the measured (or worst constant) magnitude, None unmeasured;
    `seeds` are the nodes a static rule asks to pin."""

    finding: Finding
    ref: FindingRef
    tensor: str
    kind: str
    absmax: float | None = None
    seeds: tuple[str, ...] = ()


@dataclass
class PlanContext:
    """The planning state for one model: graph index, measurements, actions so far."""

    model: Model
    target: ResolvedTarget
    stats: Any
    forbid: frozenset[str]
    rescales: list[Rescale] = field(default_factory=list)
    shifts: list[SoftmaxShift] = field(default_factory=list)
    clamps: list[Clamp] = field(default_factory=list)
    islands: list[PinFp32] = field(default_factory=list)
    declined: list[Declined] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unpinnable: list[Unpinnable] = field(default_factory=list)
    # (entry, k) -> constants that rescale scales: {name: {exponent, absmax, min_nonzero}}
    scaled_cache: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    checks: dict[tuple[str, int], Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.profile: TargetProfile = self.target.profile
        self.fmt: NumberFormat = self.target.fmt
        self.limit = self.target.limit
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
        self.log_inputs = {n.input[0] for n, _, _ in self.nodes.values()
                           if n.op_type == "Log" and n.input}
        self.readers = consumers(self.model.graph)

    # ------------------------------------------------------------ measurements

    def range_of(self, tensor: str) -> Any | None:
        if self.stats is None or not tensor:
            return None
        r = self.stats.tensors.get(tensor)
        # A tensor in a branch no sample took was never observed: it is unmeasured.
        return r if r is not None and r.count else None

    def planned_exponent(self, tensor: str, besides: Collection[str] = ()) -> int:
        """The power of two the rescales planned so far put on `tensor`, all of them (their
        domains may overlap: the rewrite applies each in turn, so the scales multiply), those
        of the entries `besides` apart (a rescale of one of them replaces it)."""
        return sum(rs.domain.get(tensor, 0) for rs in self.rescales if rs.entry not in besides)

    def fits(self, tensor: str) -> bool:
        """Does `tensor` fit the target with headroom? Unmeasured tensors fit, except the
        static hazards' outputs when planning without measurements."""
        if self.stats is None:
            return not self.hot(tensor)
        r = self.range_of(tensor)
        if r is None:
            return True
        return r.absmax <= self.limit and not (r.nan_count or r.inf_count)

    def representable(self, tensor: str) -> bool:
        """Does `tensor` fit the target format at all (headroom aside)?"""
        if self.stats is None:
            return not self.hot(tensor)
        r = self.range_of(tensor)
        if r is None:
            return True
        return r.absmax <= self.fmt.max and not (r.nan_count or r.inf_count)

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
                    or node.op_type not in CARRIES_MAGNITUDE:
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

    def share(self, tensor: str, bound: float, *, below: bool) -> float | None:
        """Measured share of |x| below (or above) a bound; None when unmeasured."""
        r = self.range_of(tensor)
        if r is None:
            return None
        value = r.fraction_below(bound) if below else r.fraction_above(bound)
        return None if value is None else float(value)

    def precise_producers(self, tensors: list[str], members: set[str],
                          tolerance: float = EXP_INPUT_ERROR) -> list[str]:
        """Producers (outside `members`) of `tensors`, and through additive ops of what is
        summed into them, whose rounding to the target would be an absolute error above
        `tolerance`: EXP_INPUT_ERROR for an Exp, which turns it into that relative error; a
        cancellation's output scale times it for a Sub. Elementwise producers only:
        Conv/MatMul/Gemm are left to verification."""
        extra: list[str] = []
        for node in self.coarse_producers(tensors, tolerance, stop=members):
            label = node_label(node)
            # A matmul runs in FP32 only for range, never for this precision: its output's
            # rounding stays, and verification measures what it costs.
            if node.op_type not in MAC_OPS and label not in extra:
                extra.append(label)
        return extra

    def coarse_producers(self, tensors: list[str], tolerance: float,
                         stop: set[str] | frozenset[str] = frozenset()) -> Iterator[onnx.NodeProto]:
        """Producers of `tensors`, and through additive ops of what is summed into them,
        whose rounding to the target is a step above `tolerance`, nearest first; nodes in
        `stop` are neither given nor walked through."""
        todo, seen = list(tensors), set()
        while todo:
            tensor = todo.pop(0)
            node = self.produced_by.get(tensor)
            r = self.range_of(tensor)
            top = None if r is None else r.top_exponent()
            if tensor in seen or node is None or top is None:
                continue
            seen.add(tensor)
            if node_label(node) in stop or 2.0 ** top * self.fmt.eps / 2 <= tolerance:
                continue
            yield node
            if node.op_type in ADDITIVE:
                todo.extend(i for i in node.input if i)

    # ------------------------------------------------------------ graph

    def order_key(self, f: Finding) -> tuple[int, str, str]:
        label = f.node if f.node in self.nodes else self.producer_label(f.tensor)
        return (self.order.get(label, len(self.order)), f.rule, f.tensor)

    def producer_label(self, tensor: str) -> str:
        node = self.produced_by.get(tensor)
        return node_label(node) if node is not None else ""

    def node(self, label: str) -> onnx.NodeProto:
        return self.nodes[label][0]

    # ------------------------------------------------------------ recording

    def record(self, action: Action) -> None:
        """Keep an action; a rescale of an entry already planned replaces it (deepened)."""
        if isinstance(action, Rescale):
            for i, rs in enumerate(self.rescales):
                if rs.entry == action.entry:
                    self.rescales[i] = action
                    return
            self.rescales.append(action)
        elif isinstance(action, SoftmaxShift):
            self.shifts.append(action)
        elif isinstance(action, Clamp):
            self.clamps.append(action)
        else:
            self.islands.append(action)

    def attach(self, ref: FindingRef, tensor: str) -> bool:
        """Credit a finding to an action that already covers its tensor."""
        for i, rs in enumerate(self.rescales):
            p = rs.domain.get(tensor)
            r = self.range_of(tensor)
            if p is not None and r is not None and \
                    r.absmax * 2.0**self.planned_exponent(tensor) <= self.limit:
                self.rescales[i] = replace(rs, findings=rs.findings + (ref,))
                return True
        for i, sh in enumerate(self.shifts):
            if tensor in sh.covers:
                self.shifts[i] = replace(sh, findings=sh.findings + (ref,))
                return True
        label = self.producer_label(tensor)
        for i, pin in enumerate(self.islands):
            if label in pin.nodes:
                self.islands[i] = replace(pin, findings=pin.findings + (ref,))
                return True
        for i, c in enumerate(self.clamps):
            if any(tensor in self.nodes[n][0].output for n in c.consumers if n in self.nodes):
                self.clamps[i] = replace(c, findings=c.findings + (ref,))
                return True
        return False

    def attach_node(self, ref: FindingRef, label: str) -> bool:
        """Credit a finding on a node to an island that already holds it."""
        for i, pin in enumerate(self.islands):
            if label in pin.nodes:
                self.islands[i] = replace(pin, findings=pin.findings + (ref,))
                return True
        return False
