"""Every trial of the 8-bit search on one session: each layer's 8-bit inputs behind switches.

    x -> Q/DQ per format f and rule r -> Where(on[L,x,f,r], dq_fr, ... x) -> L
    W -> DQ(W8_f) per format f -> Where(on[L,f], dq_f, ... W) -> L

With a layer's switches off it reads its FP32 inputs (rounded to the target's wider format
where they enter it, as every node outside the pins is); with them on, it reads exactly what
the QDQ model of npuprep.verify.qdq_model.quantise gives it. Any set of 8-bit layers, with
any scale rule per activation and, on a target with both, INT8 or FP8 per layer, is then one
run of one session, not a model built and loaded per trial: the rule trials, the sensitivity
ranking and every widening step share it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.calibrate.stats import CalibrationStats
from npuprep.data import Feed
from npuprep.graph import constant_value, name_maker, node_label, tensor_types, to_array
from npuprep.numerics import EightBitFormat, NumberFormat
from npuprep.plan.layer_precision import activation_inputs
from npuprep.rewrite.bias_correction import BiasSlot, bias_slot, corrected_bias
from npuprep.rewrite.qdq import (
    fp32_weight,
    qdq_pair,
    sort_nodes,
    weight_axis,
    weight_dq,
)
from npuprep.rewrite.qdq_weights import WeightStore
from npuprep.scale_rules import ScaleRule
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.output_errors import OutputErrors, worst_pooled_rel_l2
from npuprep.verify.qdq_model import Sensitivity, activation_scale, on_target

# Samples a ranking or rule trial is measured on: it needs an order, not a verdict.
TRIAL_SAMPLES = 4


@dataclass(frozen=True)
class Variant:
    """One 8-bit format a layer may take: its activation rules (the first is the default),
    whether its QuantizeLinear saturates, and the headroom its activation scales keep."""

    fmt: EightBitFormat
    rules: tuple[ScaleRule, ...]
    saturate: bool
    headroom: float = 1.0


@dataclass(frozen=True)
class SwitchedQdq:
    """The QDQ model with every candidate layer's 8-bit inputs behind boolean graph inputs."""

    model: onnx.ModelProto
    variants: tuple[Variant, ...]
    weight_switches: dict[tuple[str, str], str]  # (layer, format) -> switch of its 8-bit weight
    # (layer, tensor, format, rule) -> switch of that activation's pair
    input_switches: dict[tuple[str, str, str, ScaleRule], str]
    # (layer, format) -> switch of its corrected bias, and what the artefact writes for it
    bias_switches: dict[tuple[str, str], str] = field(default_factory=dict)
    biases: dict[tuple[str, str], tuple[BiasSlot, np.ndarray]] = field(default_factory=dict)

    def feed(self, assign: Mapping[str, str], rules: Mapping[str, ScaleRule],
             corrected: Iterable[str] = ()) -> dict[str, np.ndarray]:
        """Switches for the layers of `assign` (layer -> 8-bit format), each activation by its
        rule in `rules` where its format has that rule (else the format's first), the layers
        in `corrected` with their corrected bias, every other layer wider."""
        own = {v.fmt.name: v.rules for v in self.variants}
        fixed = set(corrected)
        feed = {s: np.array(assign.get(layer) == fmt)
                for (layer, fmt), s in self.weight_switches.items()}
        feed.update({s: np.array(assign.get(layer) == fmt and layer in fixed)
                     for (layer, fmt), s in self.bias_switches.items()})
        for (layer, tensor, fmt, rule), s in self.input_switches.items():
            wanted = rules.get(tensor, own[fmt][0])
            feed[s] = np.array(assign.get(layer) == fmt and rule == (
                wanted if wanted in own[fmt] else own[fmt][0]))
        return feed


def switched_qdq(model: onnx.ModelProto, layers: Sequence[str], stats: CalibrationStats,
                 variants: Sequence[Variant], *,
                 tensor_scales: Mapping[str, float] | None = None,
                 weights: WeightStore | None = None,
                 means: Mapping[str, np.ndarray] | None = None) -> SwitchedQdq:
    """`model` (at an opset whose QuantizeLinear takes every format of `variants`) with
    `layers` switchable to each variant's format, each activation by any of its rules;
    scales as npuprep.verify.qdq_model.quantise places them. A layer whose input has a mean
    in `means` (per channel) and that adds a bias also gets its bias corrected for each
    format's weight rounding behind a switch. A layer whose inputs are not FP32 is left as
    it is."""
    rescaled = tensor_scales or {}
    weights = weights or WeightStore()
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    types = tensor_types(model)
    fresh = name_maker(g)
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

    weight_switches: dict[tuple[str, str], str] = {}
    input_switches: dict[tuple[str, str, str, ScaleRule], str] = {}
    bias_switches: dict[tuple[str, str], str] = {}
    biases: dict[tuple[str, str], tuple[BiasSlot, np.ndarray]] = {}
    bias_inputs: dict[BiasSlot, str] = {}
    input_means = means or {}
    pairs: dict[tuple[str, str, ScaleRule], str] = {}
    wanted = set(layers)
    for node in g.node:
        label = node_label(node)
        if label not in wanted or any(types.get(i, TensorProto.FLOAT) != TensorProto.FLOAT
                                      for i in node.input[:2] if i):
            continue
        weight = fp32_weight(g, node.input[1]) if len(node.input) > 1 else None
        activations = list(dict.fromkeys(activation_inputs(g, node)))
        slot = bias_slot(model.graph, node) if weight is not None else None
        mean = input_means.get(node.input[0]) if slot is not None else None
        if weight is not None:
            chosen, bias = node.input[1], slot.tensor if slot is not None else ""
            # A model whose weights fit in memory gets each 8-bit weight dequantised once here:
            # onnxruntime never folds a DequantizeLinear, so every trial run would repeat it.
            w = None if weights.scratch is not None else (
                weight if isinstance(weight, np.ndarray) else to_array(weight))
            for v in variants:
                if w is None:
                    dq = weight_dq(g, node, weight, v.fmt, fresh, v.saturate, weights)
                    exact = None
                else:
                    exact = _dequantised(node, w, v, weights)
                    dq = fresh(f"{node.input[1]}_{v.fmt.name}_dq8")
                    g.initializer.append(numpy_helper.from_array(exact, dq))
                weight_switches[label, v.fmt.name] = on = switch(f"{label}_{v.fmt.name}")
                chosen = where(on, dq, chosen, node.input[1])
                fixed = None if slot is None or mean is None else _corrected(
                    g, node, weight, v, slot, mean, exact, weights)
                if slot is not None and fixed is not None:
                    value = fresh(f"{slot.tensor}_{v.fmt.name}_corrected")
                    g.initializer.append(numpy_helper.from_array(fixed, value))
                    bias_switches[label, v.fmt.name] = on = switch(f"{label}_{v.fmt.name}_bias")
                    biases[label, v.fmt.name] = (slot, fixed)
                    bias = where(on, value, bias, slot.tensor)
            node.input[1] = chosen
            if slot is not None and bias != slot.tensor:
                bias_inputs[slot] = bias
        for name in activations:
            chosen = name
            for v in variants:
                for rule in v.rules:
                    key = (name, v.fmt.name, rule)
                    if key not in pairs:
                        scale = activation_scale(stats.tensors[name], v.fmt, rule,
                                                 rescaled.get(name, 1.0), v.headroom)
                        pairs[key] = qdq_pair(g, added, fresh, name, f"{name}_{v.fmt.name}_{rule}",
                                               v.fmt, v.saturate, scale)
                    input_switches[label, name, v.fmt.name, rule] = on = switch(
                        f"{label}_{v.fmt.name}_{rule}")
                    chosen = where(on, pairs[key], chosen, name)
            for i, x in enumerate(node.input[:2]):
                if x == name and not (i == 1 and weight is not None):
                    node.input[i] = chosen
    for n in g.node:
        for slot, bias in bias_inputs.items():
            if node_label(n) == slot.node and n.input[slot.index] == slot.tensor:
                n.input[slot.index] = bias
    g.node.extend(added)
    for name in switches:
        g.input.append(helper.make_tensor_value_info(name, TensorProto.BOOL, []))
    sort_nodes(g)
    return SwitchedQdq(out, tuple(variants), weight_switches, input_switches, bias_switches,
                       biases)


def _corrected(g: onnx.GraphProto, node: onnx.NodeProto, weight: onnx.TensorProto | np.ndarray,
               v: Variant, slot: BiasSlot, mean: np.ndarray,
               dequantised: np.ndarray | None, weights: WeightStore) -> np.ndarray | None:
    """The bias of `node` corrected for its weight's rounding in `v`'s format."""
    w = weight if isinstance(weight, np.ndarray) else to_array(weight)
    exact = dequantised if dequantised is not None else _dequantised(node, w, v, weights)
    bias = constant_value(g, slot.tensor)
    return None if bias is None else corrected_bias(node, w, exact, bias, mean)


def _dequantised(node: onnx.NodeProto, w: np.ndarray, v: Variant, weights: WeightStore) -> np.ndarray:
    """`w` as its 8-bit copy in `v`'s format (the store's: nearest, or rounded for the layer)
    dequantises it: DequantizeLinear's own float32 product of the stored value and its
    channel's scale."""
    axis = weight_axis(node, w.ndim)
    stored, scale = weights.values(w, axis, v.fmt, saturate=v.saturate)
    shape = [1] * w.ndim
    if axis is not None:
        shape[axis] = -1
    return (stored.astype(np.float32) * scale.reshape(shape)).astype(np.float32)


class Trials:
    """One session of a SwitchedQdq on the target, the reference's outputs run once: a trial
    is a set of 8-bit layers and the activations' rules, measured by one run per sample."""

    def __init__(self, reference: onnx.ModelProto, switched: SwitchedQdq, wide: NumberFormat,
                 pinned: Iterable[str], samples: Sequence[Feed], *, saturate: bool) -> None:
        from npuprep.runtime.session import make_session, run

        self.switched, self.samples = switched, list(samples)
        # Layers whose corrected bias the trials use (where they run in 8 bits).
        self.corrected: set[str] = set()
        ref = make_session(reference, prepack=False)
        self.expected = [run(ref, dict(f)) for f in self.samples]
        del ref
        every = set(switched.weight_switches.values()) | set(switched.input_switches.values())
        exact = {node_label(n) for n in switched.model.graph.node
                 if n.op_type == "Where" and n.input[0] in every}
        emulated = on_target(switched.model, wide, exact | set(pinned), saturate=saturate)
        self.session: Any = make_session(emulated, prepack=True)
        self.names = [o.name for o in self.session.get_outputs()]
        self.runs = 0

    def close(self) -> None:
        """Free the session (its weights) once the search is done."""
        self.session = None

    def outputs(self, assign: Mapping[str, str], rules: Mapping[str, ScaleRule],
                count: int | None = None) -> list[dict[str, np.ndarray]]:
        """The outputs of the first `count` samples (all: None) with the layers of `assign`
        in their 8-bit format (layer -> format)."""
        from npuprep.runtime.session import run

        switches = self.switched.feed(assign, rules, self.corrected)
        chosen = self.samples[:count]
        self.runs += 1
        return [run(self.session, {**f, **switches}, self.names) for f in chosen]

    def error(self, assign: Mapping[str, str], rules: Mapping[str, ScaleRule]) -> float:
        """The outputs' worst pooled rel L2 on the first TRIAL_SAMPLES samples."""
        got = self.outputs(assign, rules, TRIAL_SAMPLES)
        return worst_pooled_rel_l2(got, self.expected[:len(got)])

    def check(self, assign: Mapping[str, str], rules: Mapping[str, ScaleRule], *, rtol: float,
              top_k: Mapping[str, int]) -> OutputCheck:
        """The outputs' check on every sample, as check_outputs judges a built model."""
        errors = OutputErrors(top_k=dict(top_k), tie_rtol=rtol)
        for r, c in zip(self.expected, self.outputs(assign, rules), strict=True):
            for name, rv in r.items():
                if np.issubdtype(np.asarray(rv).dtype, np.floating):
                    errors.add(name, rv, np.asarray(c[name], dtype=np.float64))
        return OutputCheck(rtol=rtol, samples=len(self.samples), outputs=errors.result())


def rank_layers(trials: Trials, nodes: Sequence[str], assign: Mapping[str, str],
                rules: Mapping[str, ScaleRule]) -> list[Sensitivity]:
    """Each of `nodes` kept wider alone, every other layer of `assign` (layer -> 8-bit
    format) in 8 bits: what that gains over all of them in 8 bits; and each alone in 8 bits:
    its own error, which does not depend on the others (2 len(nodes) + 1 runs). Where the
    error is spread over many layers, the gains are differences of nearly equal numbers and
    the errors alone are the clearer signal; the gains show the layers that cancel."""
    every = trials.error(assign, rules)
    found = []
    for label in nodes:
        without = trials.error({n: f for n, f in assign.items() if n != label}, rules)
        alone = trials.error({label: assign[label]}, rules)
        found.append(Sensitivity(label, without, every - without, alone))
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
        measured = {rule: trials.error(dict.fromkeys(labels, fmt.name), {name: rule})
                    for rule in clips.values()}
        chosen[name] = min(measured, key=lambda r: measured[r])
    return chosen
