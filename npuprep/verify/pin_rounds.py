"""After a failed verification, which nodes to keep FP32 next: `Build` (failed) -> `PinFp32` or None.

Like Polygraphy's `debug precision`, one marker at a time, but led by what the check measured:

- an overflow (Inf/NaN, saturation) pins the first divergent node (or, when that node is
  already FP32, the producers of its inputs);
- a precision failure (finite outputs, no overflow) is traced to its source first
  (npuprep.verify.attribution): the cheapest set of nodes within the FLOPs budget whose own
  share of the error brings the predicted error within rtol; when none exists, the first
  divergent node as above;
- a pin that does not lower the outputs' error by 10% is dropped again (`keeps`), and the
  attribution's ranking is taken wider instead (`widen`): twice as many of its nodes, largest
  share first, within the budget, re-verified; roundings that do not add up independently
  (an error a Log or a normalisation amplifies) need more of them than the prediction says;
- held-out samples that fail where the calibration samples pass are treated as a failure too
  (precision-only): the pins are chosen on the calibration samples, aimed at the held-out error.

The rounds' notes and each attribution (for the report) accumulate on the object.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from npuprep.data import Feed
from npuprep.flops import node_flops
from npuprep.graph import consumers, infer_tensors, node_label, producers, walk_graphs
from npuprep.ops import MAC_OPS
from npuprep.plan import PinFp32, Plan
from npuprep.profiles import Pinning, ResolvedTarget
from npuprep.rewrite.lower import Lowered
from npuprep.verify.attribution import attribute_error, describe
from npuprep.verify.compare import CompareResult, TensorCompareResult
from npuprep.verify.emulate import stores_rounded_values
from npuprep.verify.output_check import OutputCheck

# Samples the attribution runs on: each candidate layer costs one session and one pass over them.
ATTRIBUTION_SAMPLES = 4
# How many times a conversion takes an attribution's ranking wider after a pin that bought too
# little: each doubles the set, so three reach 8x the first set.
MAX_WIDENINGS = 3


@dataclass(frozen=True)
class Build:
    """One verification round: the plan applied, lowered, emulated and checked."""

    rewritten: onnx.ModelProto  # FP32, same function (up to clamps)
    lowered: Lowered
    tensor_scales: dict[str, float]
    pinned: frozenset[str]
    layers: CompareResult
    output_check: OutputCheck
    holdout: OutputCheck | None
    declined: tuple[Any, ...]
    notes: tuple[str, ...]
    host_scales: dict[str, float]
    # Nodes a rewrite inserted or an input scaling kept FP32, and why (the FP32-share table).
    boundary: frozenset[str]
    fp32_reasons: dict[str, str]


def sample_shapes(samples: Sequence[Feed]) -> dict[str, tuple[int, ...]]:
    """Input sizes of the first sample: what FLOPs are counted at."""
    first = next(iter(samples), None)
    return {k: tuple(np.shape(v)) for k, v in (first or {}).items()}


def failing_check(build: Build) -> OutputCheck:
    """The check a round is judged on: the calibration samples', or the held-out samples'
    where the calibration samples pass and they do not."""
    if build.output_check and build.holdout is not None and not build.holdout:
        return build.holdout
    return build.output_check


def worst_rel_l2(check: OutputCheck | None) -> float:
    return check.worst_rel_l2 if check is not None else 0.0


def improved(before: OutputCheck | None, after: OutputCheck | None) -> bool:
    """Passing now, fewer non-finite outputs, or a worst relative L2 error at least 10% lower."""
    if before is None or after is None or after:
        return True
    bad = [sum(o["nonfinite"] for o in c.outputs.values()) for c in (before, after)]
    if bad[1] != bad[0] or bad[0]:
        # As many Inf/NaN as before: the failure is untouched, whatever the finite values do.
        return bad[1] < bad[0]
    return worst_rel_l2(after) <= 0.9 * worst_rel_l2(before)


def precision_only(check: OutputCheck | None, first: TensorCompareResult | None) -> bool:
    """Failed with finite outputs and no overflow where the error shows: FP16's rounding."""
    if check is None or check or any(o["nonfinite"] for o in check.outputs.values()):
        return False
    return not any(getattr(first, k, 0) for k in ("inf_count", "nan_count", "saturated_count"))


@dataclass
class PinRounds:
    """Proposes the next pins from a failed check; remembers its notes and attributions."""

    target: ResolvedTarget
    samples: Sequence[Feed]
    rtol: float
    max_fp32_share: float
    notes: list[str] = field(default_factory=list)
    attributions: list[dict[str, Any]] = field(default_factory=list)
    # The last attribution's ranking, the error it aimed at and the FLOPs room it had, and the
    # pin it proposed: what `widen` takes further.
    _ranked: tuple[Any, float, float, PinFp32] | None = None
    widenings: int = 0
    # The last first-divergent-node pin and the graph it was chosen on: what `upstream` takes
    # back towards the values' source.
    _divergent: tuple[onnx.ModelProto, PinFp32] | None = None
    # The graph and FP32 nodes of the round the ranking was measured on.
    _model: Any = None
    _fp32: set[str] = field(default_factory=set)

    def keeps(self, before: Build, after: Build, round_no: int) -> bool:
        """Whether round `round_no`'s pin bought enough to keep; a pin that leaves the
        outputs as wrong as before only costs FP32 (the error is FP16's precision accumulated
        through the model, not that node): noted, and its attribution marked dropped."""
        if improved(failing_check(before), failing_check(after)):
            return True
        was, now = worst_rel_l2(failing_check(before)), worst_rel_l2(failing_check(after))
        self.notes.append(f"round {round_no}: the pin did not improve the outputs (worst rel L2 "
                          f"{was:.3g} -> {now:.3g}); dropped it, as round {round_no - 1} was")
        for traced in self.attributions:
            if traced["round"] == round_no - 1:
                traced["dropped"] = True
        return False

    def propose(self, build: Build, plan: Plan, round_no: int,
                stage: Callable[[str], None] = lambda _: None) -> PinFp32 | None:
        """The pin for round `round_no + 1` after `build` failed, or None (nothing to pin,
        or the target cannot pin). A precision failure is attributed even where no single
        layer is over the tolerance: small errors each within it add up at the outputs."""
        first = build.layers.first_divergent
        if first is not None and not first.node:
            first = None
        limited = precision_only(failing_check(build), first)
        if first is None and not limited:
            return None
        profile = self.target.profile
        if profile.fp32_pinning is Pinning.NONE:
            where = f"at '{first.node}'" if first is not None else "by FP16's precision"
            self.notes.append(f"verification failed {where}; the target cannot pin FP32")
            return None
        found: tuple[Any, ...] = ()
        self._ranked = self._divergent = None
        if limited:
            stage(f"round {round_no}, attributing the error to layers")
            found = self._attributed(build, plan, round_no)
        if found:
            targets = _with_paths(build.rewritten, tuple(x.node for x in found), set(build.pinned))
            why = (f"{len(found)} layer(s) holding {100 * sum(x.share for x in found):.0f}% of "
                   f"the layers' own {self.target.weights.name.upper()} squared error")
        elif first is None:
            return None
        else:
            targets = _nodes_to_pin(build.rewritten, first.node, set(build.pinned))
            why = (f"first divergent node {first.node} (rel L2 {first.rel_l2:.3g}, max abs "
                   f"error {first.max_abs_error:.3g})")
        targets = tuple(n for n in targets if n not in plan.forbid_pin)
        if not targets:
            return None
        self.notes.append(f"round {round_no}: outputs failed verification; " + (
            f"the layers holding its {self.target.weights.name.upper()} error" if found else
            f"first divergent node '{first.node}' ({first.op_type})"  # type: ignore[union-attr]
            ) + f": pinned {', '.join(targets)} and retried")
        pin = PinFp32(nodes=targets, exit_tensors=(), forced=False,
                      request=profile.fp32_pinning is Pinning.COMPILER_DECIDES,
                      why=f"verification round {round_no}: {why}")
        if found and self._ranked is not None:
            self._ranked = (*self._ranked[:3], replace(pin, nodes=tuple(x.node for x in found)))
        elif not limited:
            self._divergent = (build.rewritten, pin)
        return pin

    def upstream(self, round_no: int, plan: Plan) -> PinFp32 | None:
        """After round `round_no`'s first-divergent-node pin bought nothing (`keeps` dropped
        it): that pin with the producers of its nodes' inputs, to verify in its place. An FP32
        node computes on the values it reads: where they arrive already lost (an epsilon of
        1e-12 added in FP16 is 0, its Sqrt 0, and the Div pinned at the NaN still divides 0 by
        0), the pin must reach back to where they were lost. None when it was no such pin, the
        widenings are spent, or nothing unpinned feeds it. An overflow's pin only: a precision
        failure's error is attributed, not walked up."""
        if self._divergent is None or self.widenings >= MAX_WIDENINGS:
            return None
        model, dropped = self._divergent
        ups = _input_producers(model, set(dropped.nodes))
        ups = tuple(n for n in ups if n not in plan.forbid_pin and n not in self._fp32)
        if not ups:
            return None
        self.widenings += 1
        pin = replace(dropped, nodes=(*dropped.nodes, *ups),
                      why=f"{dropped.why}, reaching back to its inputs' producers after round "
                          f"{round_no}")
        self._divergent = (model, pin)
        self.notes.append(f"round {round_no}: the values come in already lost; pinned "
                          f"{', '.join(ups)} (the producers of its inputs) too and retried")
        return pin

    def widen(self, round_no: int, plan: Plan) -> PinFp32 | None:
        """After round `round_no`'s attributed pin bought too little (`keeps` dropped it), or
        left the outputs over the gate when the rounds are spent: twice as many of the
        attribution's nodes, largest share first, that fit the FLOPs room, as the pin to verify
        in its place (or beside it); None when it was no attributed pin, the widenings are
        spent, or no larger set fits (then the failure is FP16's precision within the budget)."""
        if self._ranked is None or self.widenings >= MAX_WIDENINGS:
            return None
        attribution, error, room, dropped = self._ranked
        worth = sorted((x for x in attribution.layers if x.node not in plan.forbid_pin),
                       key=lambda x: (-x.share, x.node))
        chosen, spent = [], 0
        for layer in worth:
            if len(chosen) >= 2 * len(dropped.nodes):
                break
            if spent + layer.flops <= room:
                chosen.append(layer)
                spent += layer.flops
        if len(chosen) <= len(dropped.nodes):
            self.notes.append(f"round {round_no}: no wider set of the attributed nodes fits the "
                              "FP32 FLOPs budget")
            return None
        self.widenings += 1
        held = sum(x.share for x in chosen)
        # The layers between them and the FP32 nodes too, where the budget holds them: a
        # pinned layer whose output an FP16 layer reads is rounded there all the same (a
        # CQT's low-pass Conv feeding the next octave's Convs).
        nodes = tuple(x.node for x in chosen)
        flops = node_flops(self._model, sample_shapes(self.samples))
        targets = _with_paths(self._model, nodes, self._fp32, through_layers=True)
        if sum(flops.get(n, 0) for n in targets) > room:
            targets = _with_paths(self._model, nodes, self._fp32)
        targets = tuple(n for n in targets if n not in plan.forbid_pin)
        pin = replace(dropped, nodes=targets, why=(
            f"{dropped.why.split(':')[0]}, widened after round {round_no}: {len(chosen)} layer(s) "
            f"holding {100 * held:.0f}% of the layers' own "
            f"{self.target.weights.name.upper()} squared error (rel L2 {error:.3g} over the gate "
            f"with the pin of {len(dropped.nodes)})"))
        self._ranked = (attribution, error, room, replace(pin, nodes=tuple(x.node for x in chosen)))
        self.notes.append(f"round {round_no}: widened the attributed pin from "
                          f"{len(dropped.nodes)} "
                          f"to {len(chosen)} layer(s) ({100 * held:.0f}% of the attributed error): "
                          f"pinned {', '.join(targets)} and retried")
        return pin

    def _attributed(self, build: Build, plan: Plan, round_no: int) -> tuple[Any, ...]:
        """The nodes (layers and elementwise ops) whose own rounding error, on the worst sample
        and the first others, takes the outputs within rtol once kept FP32, within the FLOPs
        budget; () when no node fits the budget. Records the attribution and its note."""
        rewritten, pinned = build.rewritten, set(build.pinned)
        flops = node_flops(rewritten, sample_shapes(self.samples))
        total = sum(flops.values())
        room = self.max_fp32_share * total - sum(flops.get(n, 0) for n in pinned)
        types = infer_tensors(rewritten).types
        # Every node that stores a rounded value: a layer, or an elementwise op whose rounding
        # a cancellation after it amplifies (x + 1000 - 1000 needs both kept).
        candidates = [node_label(n) for s in walk_graphs(rewritten.graph) for n in s.graph.node
                      if n.op_type != "Constant" and stores_rounded_values(n)
                      and any(types.get(o) == TensorProto.FLOAT for o in n.output)
                      and node_label(n) not in pinned and node_label(n) not in plan.forbid_pin
                      and flops.get(node_label(n), 0) <= room]
        if not candidates:
            return ()
        check = failing_check(build)
        worst = max(check.outputs.values(), key=lambda o: o["rel_l2"])
        # The held-out samples' worst is no index into the calibration samples.
        at = worst.get("worst_sample", {}).get("sample", 0) if check is build.output_check else 0
        chosen = [self.samples[at], *(s for i, s in enumerate(self.samples) if i != at)]
        # The outputs are judged in the format the artefact stores (FP16 for an FP8 target).
        attribution = attribute_error(rewritten, self.target.weights, chosen[:ATTRIBUTION_SAMPLES],
                                      saturate=self.target.saturates_in(self.target.weights),
                                      candidates=candidates, flops=flops)
        pins = attribution.pins_for(worst["rel_l2"], self.rtol, room)
        self.notes.append(f"round {round_no}: {describe(attribution, pins, worst['rel_l2'], total)}")
        self.attributions.append({"round": round_no, **attribution.to_dict(),
                                  "pinned": [x.node for x in pins], "dropped": False})
        if pins:
            self._ranked = (attribution, worst["rel_l2"], room, PinFp32(nodes=()))
            self._model, self._fp32 = rewritten, pinned
        return pins


# How far a pinned node's output is followed to the FP32 nodes it reaches.
MAX_PATH = 32


def _with_paths(model: onnx.ModelProto, nodes: tuple[str, ...], fp32: set[str], *,
                through_layers: bool = False) -> tuple[str, ...]:
    """`nodes` and the nodes on their paths (within MAX_PATH) to each other and to FP32 nodes,
    multiply-accumulate layers and what feeds `nodes` only `through_layers` (the attribution
    weighs layers first): an FP32 output that an FP16 node reads is rounded there, so the
    error a pinned Conv no longer makes is made by the Unsqueeze and Concat between it and the
    FP32 Log instead. Main graph only."""
    graph = model.graph
    by_label = {node_label(n): n for n in graph.node}
    made_by, read_by = producers(graph), consumers(graph)
    types = infer_tensors(model).types

    def reach(start: set[str], step: Callable[[onnx.NodeProto], list[onnx.NodeProto]]) -> set[str]:
        seen, frontier = set(start), set(start)
        for _ in range(MAX_PATH):
            frontier = {node_label(m) for n in frontier if n in by_label
                        for m in step(by_label[n])} - seen
            seen |= frontier
        return seen

    def upward(n: onnx.NodeProto) -> list[onnx.NodeProto]:
        return [made_by[i] for i in n.input if i in made_by]

    below = reach(set(nodes), lambda n: [m for o in n.output for m in read_by.get(o, [])])
    above = reach((fp32 | set(nodes)) & set(by_label), upward)
    # Through the layers, what feeds them too: an FP32 layer reading an FP16 input gets the
    # input's rounding all the same (a transform's quiet bins under its audio's FP16 steps).
    feeding = reach(set(nodes), upward) if through_layers else set()
    between = {n for n in (below & above) | feeding
               if n not in fp32 and n not in nodes
               and (through_layers or by_label[n].op_type not in MAC_OPS)
               and any(types.get(o) == TensorProto.FLOAT for o in by_label[n].output)}
    order = {node_label(n): i for i, n in enumerate(graph.node)}
    return tuple(sorted(set(nodes) | between, key=lambda n: order.get(n, -1)))


def _input_producers(rewritten: onnx.ModelProto, nodes: set[str]) -> tuple[str, ...]:
    """The nodes (but Constants) that write an input of any of `nodes`, not among them."""
    found: set[str] = set()
    for scope in walk_graphs(rewritten.graph):
        made_by = producers(scope.graph)
        for n in scope.graph.node:
            if node_label(n) in nodes:
                found |= {node_label(made_by[i]) for i in n.input
                          if i in made_by and made_by[i].op_type != "Constant"}
    return tuple(sorted(found - nodes))


def _nodes_to_pin(rewritten: onnx.ModelProto, node: str, pinned: set[str]) -> tuple[str, ...]:
    """The divergent node itself; if it is already FP32, the rounding came in through its
    inputs, so pin the nearest unpinned producers up its inputs instead."""
    if node not in pinned:
        return (node,)
    seen, found = {node}, set()
    frontier = {node}
    while frontier:
        ups = set(_input_producers(rewritten, frontier)) - seen
        seen |= ups
        found |= ups - pinned
        frontier = ups & pinned
    return tuple(sorted(found))
