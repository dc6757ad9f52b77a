"""Every trial of the 8-bit search on one session: each layer's 8-bit inputs behind switches.

    x -> Q/DQ by rule r (one pair per tensor and rule) -> Where(on[L,x,r], dq_r, ... x) -> L
    W -> DQ(W8) -> Where(on[L], dq, W) -> L

With a layer's switches off it reads its FP32 inputs (rounded to the target's wider format
where they enter it, as every node outside the pins is); with them on, it reads exactly what
the QDQ model of npuprep.verify.qdq_model.quantise gives it. Any set of 8-bit layers, with
any scale rule per activation, is then one run of one session, not a model built and loaded
per trial: the rule trials, the sensitivity ranking and every widening step share it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.calibrate.stats import CalibrationStats
from npuprep.data import Feed
from npuprep.graph import name_maker, node_label
from npuprep.numerics import EightBitFormat, NumberFormat
from npuprep.plan.layer_precision import activation_inputs
from npuprep.rewrite.qdq import ActivationScale, insert_qdq, sort_nodes, zero_point
from npuprep.rewrite.qdq_weights import WeightStore
from npuprep.scale_rules import ScaleRule
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.output_errors import OutputErrors, worst_pooled_rel_l2
from npuprep.verify.qdq_model import Sensitivity, activation_scale, on_target

# Samples a ranking or rule trial is measured on: it needs an order, not a verdict.
TRIAL_SAMPLES = 4


@dataclass(frozen=True)
class SwitchedQdq:
    """The QDQ model with every candidate layer's 8-bit inputs behind boolean graph inputs."""

    model: onnx.ModelProto
    weight_switches: dict[str, str]  # layer -> switch of its 8-bit weight
    input_switches: dict[tuple[str, str, ScaleRule], str]  # (layer, tensor, rule) -> switch

    def feed(self, on: Iterable[str], rules: Mapping[str, ScaleRule],
             default: ScaleRule) -> dict[str, np.ndarray]:
        """Switches for the layers `on` in 8 bits, each activation by its rule in `rules`
        (else `default`), every other layer wider."""
        chosen = set(on)
        feed = {s: np.array(layer in chosen) for layer, s in self.weight_switches.items()}
        for (layer, tensor, rule), s in self.input_switches.items():
            feed[s] = np.array(layer in chosen and rules.get(tensor, default) == rule)
        return feed


def switched_qdq(model: onnx.ModelProto, layers: Sequence[str], stats: CalibrationStats,
                 fmt: EightBitFormat, rules: Sequence[ScaleRule], *, saturate: bool,
                 tensor_scales: Mapping[str, float] | None = None, headroom: float = 1.0,
                 weights: WeightStore | None = None) -> SwitchedQdq:
    """`model` (at a QDQ opset) with `layers` switchable to `fmt`, each activation by any of
    `rules`; scales as npuprep.verify.qdq_model.quantise places them."""
    rescaled = tensor_scales or {}
    weighted = insert_qdq(model, {label: {} for label in layers}, fmt, saturate=saturate,
                          weights=weights)
    out = onnx.ModelProto()
    out.CopyFrom(weighted.model)
    g = out.graph
    fresh = name_maker(g)
    source = {node_label(n): n for n in model.graph.node}
    kept = {i.name for i in g.initializer}
    originals = {i.name: i for i in model.graph.initializer}
    added: list[onnx.NodeProto] = []
    switches: list[str] = []

    def switch(base: str) -> str:
        name = fresh(f"npuprep_8bit_on__{base}")
        switches.append(name)
        return name

    def where(on: str, yes: str, no: str, base: str) -> str:
        chosen = fresh(f"{base}_sel8")
        added.append(helper.make_node("Where", [on, yes, no], [chosen], name=fresh(f"{base}_Sel8")))
        return chosen

    weight_switches: dict[str, str] = {}
    input_switches: dict[tuple[str, str, ScaleRule], str] = {}
    pairs: dict[tuple[str, ScaleRule], str] = {}
    wanted = set(layers)
    for node in g.node:
        label = node_label(node)
        if label not in wanted or label not in source:
            continue
        before = source[label]
        if len(node.input) > 1 and node.input[1] != before.input[1]:
            weight_switches[label] = on = switch(label)
            node.input[1] = where(on, node.input[1], before.input[1], before.input[1])
            if before.input[1] in originals and before.input[1] not in kept:
                g.initializer.append(originals[before.input[1]])
                kept.add(before.input[1])
        for name in dict.fromkeys(activation_inputs(model.graph, before)):
            chosen = name
            for rule in rules:
                if (name, rule) not in pairs:
                    pairs[name, rule] = _qdq_pair(g, added, fresh, name, rule, fmt, saturate,
                                                  activation_scale(stats.tensors[name], fmt, rule,
                                                                   rescaled.get(name, 1.0),
                                                                   headroom))
                input_switches[label, name, rule] = on = switch(f"{label}_{rule}")
                chosen = where(on, pairs[name, rule], chosen, name)
            for i, x in enumerate(node.input[:2]):
                if x == name and not (i == 1 and label in weight_switches):
                    node.input[i] = chosen
    g.node.extend(added)
    for name in switches:
        g.input.append(helper.make_tensor_value_info(name, TensorProto.BOOL, []))
    sort_nodes(g)
    return SwitchedQdq(out, weight_switches, input_switches)


def _qdq_pair(g: onnx.GraphProto, added: list[onnx.NodeProto], fresh: Callable[[str], str],
              tensor: str, rule: ScaleRule, fmt: EightBitFormat, saturate: bool,
              s: ActivationScale) -> str:
    """A QuantizeLinear/DequantizeLinear pair of `tensor` at scale `s` (an ActivationScale)."""
    scale, zp = fresh(f"{tensor}_{rule}_scale8"), fresh(f"{tensor}_{rule}_zp8")
    q, dq = fresh(f"{tensor}_{rule}_q8"), fresh(f"{tensor}_{rule}_dq8")
    g.initializer.append(numpy_helper.from_array(np.array(s.scale, np.float32), scale))
    g.initializer.append(zero_point(zp, fmt, (), unsigned=s.unsigned, value=s.zero_point))
    extra = {"saturate": int(saturate)} if fmt.is_float else {}
    added.append(helper.make_node("QuantizeLinear", [tensor, scale, zp], [q],
                                  name=fresh(f"{tensor}_{rule}_Q8"), **extra))
    added.append(helper.make_node("DequantizeLinear", [q, scale, zp], [dq],
                                  name=fresh(f"{tensor}_{rule}_DQ8")))
    return dq


class Trials:
    """One session of a SwitchedQdq on the target, the reference's outputs run once: a trial
    is a set of 8-bit layers and the activations' rules, measured by one run per sample."""

    def __init__(self, reference: onnx.ModelProto, switched: SwitchedQdq, wide: NumberFormat,
                 pinned: Iterable[str], samples: Sequence[Feed], *, saturate: bool,
                 default: ScaleRule) -> None:
        from npuprep.runtime.session import make_session, run

        self.switched, self.default, self.samples = switched, default, list(samples)
        ref = make_session(reference, prepack=False)
        self.expected = [run(ref, dict(f)) for f in self.samples]
        del ref
        exact = {node_label(n) for n in switched.model.graph.node if n.op_type == "Where"
                 and n.input[0] in set(switched.weight_switches.values())
                 | set(switched.input_switches.values())}
        emulated = on_target(switched.model, wide, exact | set(pinned), saturate=saturate)
        self.session: Any = make_session(emulated, prepack=True)
        self.names = [o.name for o in self.session.get_outputs()]
        self.runs = 0

    def close(self) -> None:
        """Free the session (its weights) once the search is done."""
        self.session = None

    def outputs(self, on: Iterable[str], rules: Mapping[str, ScaleRule],
                count: int | None = None) -> list[dict[str, np.ndarray]]:
        """The outputs of the first `count` samples (all: None) with `on` in 8 bits."""
        from npuprep.runtime.session import run

        switches = self.switched.feed(on, rules, self.default)
        chosen = self.samples[:count]
        self.runs += 1
        return [run(self.session, {**f, **switches}, self.names) for f in chosen]

    def error(self, on: Iterable[str], rules: Mapping[str, ScaleRule]) -> float:
        """The outputs' worst pooled rel L2 on the first TRIAL_SAMPLES samples."""
        got = self.outputs(on, rules, TRIAL_SAMPLES)
        return worst_pooled_rel_l2(got, self.expected[:len(got)])

    def check(self, on: Iterable[str], rules: Mapping[str, ScaleRule], *, rtol: float,
              top_k: Mapping[str, int]) -> OutputCheck:
        """The outputs' check on every sample, as check_outputs judges a built model."""
        errors = OutputErrors(top_k=dict(top_k), tie_rtol=rtol)
        for r, c in zip(self.expected, self.outputs(on, rules), strict=True):
            for name, rv in r.items():
                if np.issubdtype(np.asarray(rv).dtype, np.floating):
                    errors.add(name, rv, np.asarray(c[name], dtype=np.float64))
        return OutputCheck(rtol=rtol, samples=len(self.samples), outputs=errors.result())


def rank_layers(trials: Trials, nodes: Sequence[str], eight_bit: Sequence[str],
                rules: Mapping[str, ScaleRule]) -> list[Sensitivity]:
    """Each of `nodes` kept wider alone, every other layer of `eight_bit` in 8 bits: what
    that gains over all of them in 8 bits, the largest gain first (len(nodes) + 1 runs)."""
    every = trials.error(eight_bit, rules)
    found = []
    for label in nodes:
        without = trials.error([n for n in eight_bit if n != label], rules)
        found.append(Sensitivity(label, without, every - without))
    return sorted(found, key=lambda s: -s.gain)


def choose_rules(trials: Trials, model: onnx.ModelProto, nodes: Sequence[str],
                 stats: CalibrationStats, fmt: EightBitFormat,
                 rules: Sequence[ScaleRule]) -> dict[str, ScaleRule]:
    """Per activation of `nodes` whose `rules` place different clips: the rule whose clip
    gives the least output error with that tensor's 8-bit readers alone in 8 bits."""
    from npuprep.calibrate.scales import clip_for

    wanted = set(nodes)
    readers: dict[str, list[str]] = {}
    for node in model.graph.node:
        if node_label(node) in wanted:
            for name in activation_inputs(model.graph, node):
                readers.setdefault(name, []).append(node_label(node))
    chosen = {}
    for name, labels in readers.items():
        clips: dict[float, ScaleRule] = {}
        for rule in rules:
            clips.setdefault(clip_for(stats.tensors[name], fmt, rule).value, rule)
        if len(clips) < 2:
            continue
        measured = {rule: trials.error(labels, {name: rule}) for rule in clips.values()}
        chosen[name] = min(measured, key=lambda r: measured[r])
    return chosen
