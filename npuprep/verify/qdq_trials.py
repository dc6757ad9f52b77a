"""Every trial of the 8-bit search on one session: each layer's 8-bit inputs behind switches.

    x -> If(on[L,x,f,r], Q/DQ_fr(x), ... x) per format f and rule r -> L
    W -> DQ(W8_f) per format f -> Where(on[L,f], dq_f, ... W) -> L

With a layer's switches off it reads its FP32 inputs (rounded to the target's wider format
where they enter it, as every node outside the pins is); with them on, it reads exactly what
the QDQ model of npuprep.verify.qdq_model.quantise gives it. Any set of 8-bit layers, with
any scale rule per activation and, on a target with both, INT8 or FP8 per layer, is then one
run of one session, not a model built and loaded per trial. An activation's pair is computed
only where its switch is on (an If); a weight's choice is worked out once and the layer sits
in If branches, each reading its choice as a constant (npuprep.verify.weight_switches). The
search builds one such session per phase holding only the pairs it switches
(npuprep.pipeline.quantise_and_verify). A batch of trials (a ranking's, a rule choice's) is
handed to the session's runner at once: this process (LocalRuns: one session thread, a run
per core at a time, the model in pieces so a trial on the first samples starts at the last cut
before its first switch: npuprep.verify.trial_pieces), or Ray actors
(npuprep.calibrate.on_ray.SessionsOnRay)
that run the same jobs to the same outputs. The sessions have one thread each and no
prepacked weights: the built model's numbers at one thread, bit for bit (onnxruntime's Conv
may sum in another order on two threads: ppocr_det, 1e-5). So a trial one phase's session
ran, a later phase's takes instead of running it (TrialOutputs: the rule choice's trial of a
layer's input at the rule chosen is the ranking's trial of that layer alone).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.calibrate.stats import CalibrationStats
from npuprep.data import Feed
from npuprep.detections import Decision
from npuprep.graph import (
    constant_value,
    consumers,
    name_maker,
    node_label,
    node_scopes,
    tensor_types,
    to_array,
    walk_graphs,
)
from npuprep.numerics import EightBitFormat, NumberFormat
from npuprep.plan.layer_precision import activation_inputs
from npuprep.rewrite.bias_correction import BiasSlot, bias_slot, corrected_bias
from npuprep.rewrite.qdq import (
    ActivationScale,
    dequantised_weight,
    qdq_pair,
    scope_weight,
    sort_nodes,
    weight_dq,
)
from npuprep.rewrite.qdq_weights import WeightStore
from npuprep.scale_rules import ScaleRule
from npuprep.verify.bounded_trials import errors_within, least_errors
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.output_errors import (
    OutputErrors,
    PooledSums,
    reference_squares,
    worst_pooled_rel_l2,
)
from npuprep.verify.qdq_model import activation_scale, on_target
from npuprep.verify.trial_pieces import Prefixes, crossing, cut_into_pieces, first_pieces
from npuprep.verify.weight_switches import fold_weight_switches

# Samples a ranking or rule trial is measured on: it needs an order, not a verdict.
TRIAL_SAMPLES = 4
# A trial's error from its outputs and the reference's (per sample, output name -> values).
TrialScore = Callable[[Sequence[Mapping[str, np.ndarray]], Sequence[Mapping[str, np.ndarray]]],
                      float]
# Trials handed to the runner at once (x TRIAL_SAMPLES runs: Ray spreads them over its
# actors); their outputs are held until their errors are taken.
BATCH_TRIALS = 16
# Outputs one phase's trials hand to a later phase's session (TrialOutputs): up to this many
# bytes (ppocr_det: 33 rule trials of 6.6 MB each).
SHARED_OUTPUT_BYTES = 256 * 2**20


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
             corrected: Iterable[tuple[str, str]] = ()) -> dict[str, np.ndarray]:
        """Switches for the layers of `assign` (layer -> 8-bit format), each activation by its
        rule in `rules` where its format has that rule (else the format's first), the layers
        with their (layer, format) in `corrected` with their corrected bias, every other layer
        wider."""
        own = {v.fmt.name: v.rules for v in self.variants}
        fixed = set(corrected)
        feed = {s: np.array(assign.get(layer) == fmt)
                for (layer, fmt), s in self.weight_switches.items()}
        feed.update({s: np.array(assign.get(layer) == fmt and (layer, fmt) in fixed)
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
                 means: Mapping[str, np.ndarray] | None = None,
                 rules: Mapping[str, ScaleRule] | None = None,
                 formats: Mapping[str, str] | None = None,
                 centred_means: Mapping[str, np.ndarray] | None = None) -> SwitchedQdq:
    """`model` (at an opset whose QuantizeLinear takes every format of `variants`) with
    `layers` switchable to each variant's format, each activation by any of its rules;
    scales as npuprep.verify.qdq_model.quantise places them. A layer whose input has a mean
    in `means` (per channel) and that adds a bias also gets its bias corrected for each
    format's weight rounding behind a switch. A layer whose inputs are not FP32 is left as
    it is. With `rules` (the rules chosen), each activation gets only its own rule's pair
    per format. An activation's pairs sit in one If on any of their switches: switched off,
    one copy of the tensor per run, however many pairs. With `formats`
    (layer -> format), each layer gets only its own format's switches. `centred_means`:
    layer -> the per-channel mean of its centred input; its bias follows its weight's switch
    (npuprep.rewrite.shift.centred_bias)."""
    rescaled = tensor_scales or {}
    weights = weights or WeightStore()
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    types = tensor_types(model)
    fresh = name_maker(g)
    # A body's layer gets its gates in its body (its switches, scales and weights are the
    # main graph's, which every body reads): `added` is the nodes of the scope walked now.
    scopes = [s.graph for s in walk_graphs(g)]
    chains = node_scopes(g)
    added_to: dict[int, list[onnx.NodeProto]] = {}
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

    def gated_pair(on: str, tensor: str, stem: str, v: Variant, scale: ActivationScale,
                   previous: str, into: list[onnx.NodeProto]) -> str:
        # An If, not a Where: a Where computes its pair in every run, switched on or not (most
        # of a trial run's cost), an If only where its switch is on; the values are the same.
        inner: list[onnx.NodeProto] = []
        dq = qdq_pair(g, inner, fresh, tensor, stem, v.fmt, v.saturate, scale)
        return gated(on, inner, dq, previous, stem, into)

    def gated(on: str, inner: list[onnx.NodeProto], value: str, previous: str, stem: str,
              into: list[onnx.NodeProto]) -> str:
        """If(on): `inner`'s `value`, else `previous` (copied); its output."""
        kept, chosen = fresh(f"{stem}_kept8"), fresh(f"{stem}_sel8")
        into.append(helper.make_node(
            "If", [on], [chosen], name=fresh(f"{stem}_Sel8"),
            then_branch=helper.make_graph(inner, fresh(f"{stem}_on8"), [], [
                helper.make_tensor_value_info(value, TensorProto.FLOAT, None)]),
            else_branch=helper.make_graph([helper.make_node("Identity", [previous], [kept])],
                                          fresh(f"{stem}_off8"), [], [
                helper.make_tensor_value_info(kept, TensorProto.FLOAT, None)])))
        return chosen

    def gated_pairs(tensor: str, pairs: list[tuple[str, str, Variant, ActivationScale]]) -> str:
        """`tensor` through its pairs (switch, stem, variant, scale), the last switched on
        chosen. Several sit inside one If on any of them: switched off, a pair's If still
        copies its tensor, and with every rule of every format that was most of a run
        (unet_tiny's rule-choice trials: the Ifs and their copies 47% of one, the layers 20%)."""
        if len(pairs) == 1:
            on, stem, v, scale = pairs[0]
            return gated_pair(on, tensor, stem, v, scale, tensor, added)
        inner: list[onnx.NodeProto] = []
        chosen = tensor
        for on, stem, v, scale in pairs:
            chosen = gated_pair(on, tensor, stem, v, scale, chosen, inner)
        any_on = pairs[0][0]
        for on, stem, _, _ in pairs[1:]:
            either = fresh(f"{stem}_any8")
            added.append(helper.make_node("Or", [any_on, on], [either],
                                          name=fresh(f"{stem}_Any8")))
            any_on = either
        return gated(any_on, inner, chosen, tensor, f"{tensor}_{pairs[0][1]}", added)

    weight_switches: dict[tuple[str, str], str] = {}
    input_switches: dict[tuple[str, str, str, ScaleRule], str] = {}
    bias_switches: dict[tuple[str, str], str] = {}
    biases: dict[tuple[str, str], tuple[BiasSlot, np.ndarray]] = {}
    bias_inputs: dict[BiasSlot, str] = {}
    input_means = means or {}
    scales: dict[tuple[str, str, ScaleRule], ActivationScale] = {}
    wanted = set(layers)
    readers = consumers(model.graph)

    def own(label: str) -> list[Variant]:
        return [v for v in variants if formats is None or formats.get(label) == v.fmt.name]

    for node, scope in ((n, s) for s in scopes for n in s.node):
        label = node_label(node)
        if label not in wanted or any(types.get(i, TensorProto.FLOAT) != TensorProto.FLOAT
                                      for i in node.input[:2] if i):
            continue
        wanted.discard(label)  # a label two scopes share names the first node (node_scopes)
        added = added_to.setdefault(id(scope), [])
        chain = chains[label][1]
        weight = scope_weight(chain, node.input[1]) if len(node.input) > 1 else None
        activations = list(dict.fromkeys(activation_inputs(scope, node, chain[1:])))
        slot = bias_slot(model.graph, node, readers) if weight is not None else None
        mean = input_means.get(node.input[0]) if slot is not None else None
        centred_mean = (centred_means or {}).get(label) if slot is not None else None
        if weight is not None:
            chosen, bias = node.input[1], slot.tensor if slot is not None else ""
            # A model whose weights fit in memory gets each 8-bit weight dequantised once here:
            # onnxruntime never folds a DequantizeLinear, so every trial run would repeat it.
            w = None if weights.scratch is not None else (
                weight if isinstance(weight, np.ndarray) else to_array(weight))
            for v in own(label):
                if w is None:
                    dq = weight_dq(g, node, weight, v.fmt, fresh, v.saturate, weights, into=added)
                    exact = None
                else:
                    exact = dequantised_weight(node, w, v.fmt, saturate=v.saturate,
                                               weights=weights)
                    dq = fresh(f"{node.input[1]}_{v.fmt.name}_dq8")
                    g.initializer.append(numpy_helper.from_array(exact, dq))
                weight_switches[label, v.fmt.name] = on = switch(f"{label}_{v.fmt.name}")
                chosen = where(on, dq, chosen, node.input[1])
                # Corrected at its centred input's mean whenever 8-bit (shift.centred_bias).
                shifted = None if slot is None or centred_mean is None else _corrected(
                    g, node, weight, v, slot, centred_mean, exact, weights)
                if slot is not None and shifted is not None:
                    value = fresh(f"{slot.tensor}_{v.fmt.name}_centred")
                    g.initializer.append(numpy_helper.from_array(shifted, value))
                    bias = where(on, value, bias, slot.tensor)
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
            pairs = []
            for v in own(label):
                for rule in v.rules if rules is None else (_own_rule(v, rules.get(name)),):
                    key = (name, v.fmt.name, rule)
                    if key not in scales:
                        scales[key] = activation_scale(stats.tensors[name], v.fmt, rule,
                                                       rescaled.get(name, 1.0), v.headroom)
                    input_switches[label, name, v.fmt.name, rule] = on = switch(
                        f"{label}_{v.fmt.name}_{rule}")
                    pairs.append((on, f"{name}_{v.fmt.name}_{rule}", v, scales[key]))
            chosen = gated_pairs(name, pairs) if pairs else name
            for i, x in enumerate(node.input[:2]):
                if x == name and not (i == 1 and weight is not None):
                    node.input[i] = chosen
    for n in g.node:
        for slot, bias in bias_inputs.items():
            if node_label(n) == slot.node and n.input[slot.index] == slot.tensor:
                n.input[slot.index] = bias
    for name in switches:
        g.input.append(helper.make_tensor_value_info(name, TensorProto.BOOL, []))
    # Bodies first, innermost first: sorting a graph copies its nodes, bodies and all.
    for scope in reversed(scopes):
        scope.node.extend(added_to.get(id(scope), []))
        sort_nodes(scope)
    return SwitchedQdq(out, tuple(variants), weight_switches, input_switches, bias_switches,
                       biases)


def _own_rule(v: Variant, rule: ScaleRule | None) -> ScaleRule:
    """The rule `v`'s format quantises an activation by when `rule` was chosen for it (as
    SwitchedQdq.feed picks it)."""
    return rule if rule in v.rules else v.rules[0]


def _corrected(g: onnx.GraphProto, node: onnx.NodeProto, weight: onnx.TensorProto | np.ndarray,
               v: Variant, slot: BiasSlot, mean: np.ndarray,
               dequantised: np.ndarray | None, weights: WeightStore) -> np.ndarray | None:
    """The bias of `node` corrected for its weight's rounding in `v`'s format."""
    w = weight if isinstance(weight, np.ndarray) else to_array(weight)
    exact = dequantised if dequantised is not None else dequantised_weight(
        node, w, v.fmt, saturate=v.saturate, weights=weights)
    bias = constant_value(g, slot.tensor)
    return None if bias is None else corrected_bias(node, w, exact, bias, mean)


class LocalRuns:
    """Trial runs in this process: the trial model in pieces (npuprep.verify.trial_pieces),
    a session each, built once, of one thread and no prepacked weights
    (npuprep.verify.weight_switches), run by one thread per core at a time (onnxruntime runs
    a session from several threads at once). A trial run is ~2000 small nodes (the rounding
    chains, the switches): split over 2 threads each node waited for the other thread, and
    a run took twice the CPU time and, on a loaded machine, twice the wall time of one thread
    (ppocr_det, 2 cores: 0.147 against 0.075 CPU s); the jobs of a batch are independent and
    share the cores whole. The first TRIAL_SAMPLES samples' values at each cut with every
    switch off are kept, and a job on one of them starts at the last cut before its first
    switch on: a layer alone reruns only what follows it. The values a job crosses each cut
    with are kept too (Prefixes), and a later job on that sample with the same switches
    before a cut starts there."""

    def __init__(self, model: onnx.ModelProto, samples: Sequence[Feed]) -> None:
        from npuprep.calibrate.run import cores
        from npuprep.runtime.session import make_session

        self.samples = list(samples)
        shapes = {k: np.shape(v) for k, v in self.samples[0].items()} if self.samples else {}
        self.pieces = cut_into_pieces(model, shapes)
        self.sessions: list[Any] = [make_session(p.model, prepack=False, threads=1)
                                    for p in self.pieces]
        self.names = [o.name for o in model.graph.output]
        self.first = first_pieces(self.pieces, [i.name for i in model.graph.input])
        self.entering = [crossing(self.pieces, k, self.names) for k in range(len(self.pieces))]
        # sample -> the values entering each piece (and the outputs) with every switch off
        self.kept: dict[int, list[dict[str, np.ndarray]]] = {}
        self.prefixes = Prefixes(self.pieces, self.first)
        self.workers = cores()

    def _start(self, switches: Mapping[str, np.ndarray]) -> int:
        return min((self.first.get(s, 0) for s, on in switches.items() if bool(on)),
                   default=len(self.pieces))

    def _keep(self, i: int, switches: Mapping[str, np.ndarray]) -> None:
        values: dict[str, np.ndarray] = {**self.samples[i], **{s: np.array(False) for s in switches}}
        kept = []
        for k in range(len(self.pieces)):
            kept.append({n: values[n] for n in self.entering[k]})
            self._from_one(k, values)
        kept.append({n: values[n] for n in self.names})
        self.kept[i] = kept

    def _from_one(self, k: int, values: dict[str, np.ndarray]) -> None:
        from npuprep.runtime.session import run

        piece = self.pieces[k]
        values.update(run(self.sessions[k], {n: values[n] for n in piece.inputs}, piece.outputs))

    def run(self, jobs: Sequence[tuple[int, Mapping[str, np.ndarray]]]) -> list[dict[str, np.ndarray]]:
        """The outputs of each job: (sample index, switches)."""
        from concurrent.futures import ThreadPoolExecutor

        def one(job: tuple[int, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
            i, switches = job
            k = self._start(switches) if i in self.kept else 0
            keys = self.prefixes.keys(switches)
            values = {**self.samples[i], **switches}
            later = self.prefixes.latest(i, keys, k)
            if later is not None:
                k = later[0]
                values.update(later[1])
            elif k:
                values.update(self.kept[i][k])
            for j in range(k, len(self.pieces)):
                self._from_one(j, values)
                # All off before the cut on a kept sample: the all-off values are kept.
                if i not in self.kept or any(keys[j + 1]):
                    self.prefixes.put(i, j + 1, keys[j + 1], {
                        n: values[n] for n in (self.entering[j + 1] if j + 1 < len(self.pieces)
                                               else self.names)})
            return {n: values[n] for n in self.names}

        # A job on a kept sample that starts past the first piece needs that sample's values.
        keep = {i: s for i, s in jobs if i < TRIAL_SAMPLES and i not in self.kept
                and len(self.pieces) > 1 and self._start(s) > 0}
        with ThreadPoolExecutor(max(1, min(self.workers, len(jobs)))) as pool:
            list(pool.map(lambda item: self._keep(*item), keep.items()))
            if self.workers < 2 or len(jobs) < 2:
                return [one(job) for job in jobs]
            return list(pool.map(one, jobs))

    def close(self) -> None:
        self.sessions = []
        self.kept = {}
        self.prefixes.clear()


# What a trial switches on, whatever session runs it: ("weight", layer, format),
# ("input", layer, tensor, format, rule) and ("bias", layer, format) for each switch on.
Meaning = frozenset[tuple[str, ...]]


class TrialOutputs:
    """Trial outputs one phase's session hands to a later phase's (a session per phase:
    npuprep.pipeline.quantise_and_verify), by what the trial switches on: the rule choice's
    trial of an activation's reader alone at the rule chosen is the ranking's trial of that
    layer alone, run once. The sessions of one search quantise alike (the same model,
    statistics, weights and samples), and a pair switched off passes its tensor through, so
    the two sessions give that trial the same outputs bit for bit (one thread, no
    prepacking). Each is taken once; at most `max_bytes` are held."""

    def __init__(self, max_bytes: int = SHARED_OUTPUT_BYTES) -> None:
        self.max_bytes, self.held = max_bytes, 0
        self._outputs: dict[Meaning, list[dict[str, np.ndarray]]] = {}

    def put(self, meaning: Meaning, outputs: list[dict[str, np.ndarray]]) -> None:
        size = sum(np.asarray(v).nbytes for o in outputs for v in o.values())
        if meaning not in self._outputs and self.held + size <= self.max_bytes:
            self._outputs[meaning] = outputs
            self.held += size

    def clear(self) -> None:
        """Drop what no later trial took."""
        self._outputs.clear()
        self.held = 0

    def take(self, meaning: Meaning) -> list[dict[str, np.ndarray]] | None:
        found = self._outputs.pop(meaning, None)
        if found is not None:
            self.held -= sum(np.asarray(v).nbytes for o in found for v in o.values())
        return found


class TrialRuns(Protocol):
    """Where the trial runs run: this process (LocalRuns) or Ray actors
    (npuprep.calibrate.on_ray.SessionsOnRay); every job gives the same outputs in both."""

    def run(self, jobs: Sequence[tuple[int, Mapping[str, np.ndarray]]]) -> list[dict[str, np.ndarray]]: ...

    def close(self) -> None: ...


# Where the trial runs run: given the trial model and the samples.
RunsFactory = Callable[[onnx.ModelProto, Sequence[Feed]], TrialRuns]


def reference_outputs(reference: onnx.ModelProto, samples: Sequence[Feed]) -> list[dict[str, np.ndarray]]:
    """The FP32 reference's outputs on `samples` (run once for every trial and check)."""
    from npuprep.calibrate.run import pass_streams, session_threads
    from npuprep.runtime.session import make_session, run_in_streams

    streams = pass_streams(len(samples))
    ref = make_session(reference, prepack=False, threads=session_threads(streams))
    return list(run_in_streams(ref, samples, None, streams))


class ReferenceOutputs:
    """The FP32 reference's outputs on a conversion's calibration samples, run once (when first
    asked) for every measurement and trial session of it (each ran them in a session of its
    own: ddddocr_det ~1.5 CPU s); feeds that are not among the samples run on their own."""

    def __init__(self, reference: onnx.ModelProto, samples: Sequence[Feed]) -> None:
        self.reference, self.samples = reference, list(samples)
        self._found: list[dict[str, np.ndarray]] | None = None

    def on(self, feeds: Sequence[Feed]) -> list[dict[str, np.ndarray]]:
        at = {id(f): i for i, f in enumerate(self.samples)}
        if not all(id(f) in at for f in feeds):
            return reference_outputs(self.reference, feeds)
        if self._found is None:
            self._found = reference_outputs(self.reference, self.samples)
        return [self._found[at[id(f)]] for f in feeds]


class Trials:
    """One session of a SwitchedQdq on the target (the tensors outside the switches and
    `pinned` rounded to `wide`, as the board computes), the reference's outputs run once
    (or given: `expected`): a trial is a set of 8-bit layers and the activations' rules,
    measured by one run per sample, where `runs` runs them (default: this process). Trials
    whose switches are the same run once (their error is kept). Each layer's weight choices
    are worked out once, the layer in Ifs (npuprep.verify.weight_switches)."""

    def __init__(self, reference: onnx.ModelProto, switched: SwitchedQdq, wide: NumberFormat,
                 pinned: Iterable[str], samples: Sequence[Feed], *, saturate: bool,
                 expected: list[dict[str, np.ndarray]] | None = None,
                 runs: RunsFactory | None = None, shared: TrialOutputs | None = None) -> None:
        self.switched, self.samples, self.shared = switched, list(samples), shared
        # (layer, format)s whose corrected bias the trials use (where the layer runs in it).
        self.corrected: set[tuple[str, str]] = set()
        self.expected = expected if expected is not None else reference_outputs(reference, samples)
        every = set(switched.weight_switches.values()) | set(switched.input_switches.values())
        gates = [n for scope in walk_graphs(switched.model.graph) for n in scope.graph.node
                 if n.op_type in ("Where", "If") and n.input[0] in every]
        # The switches and the Q/DQ pairs inside their branches stay exact, as the pairs do.
        exact = {node_label(n) for n in gates} | {
            node_label(inner) for n in gates for a in n.attribute if a.type == a.GRAPH
            for inner in a.g.node}
        model = on_target(switched.model, wide, exact | set(pinned), saturate=saturate)
        model = fold_weight_switches(model, switched.weight_switches.values())
        self.runner: TrialRuns | None = (runs or LocalRuns)(model, self.samples)
        self.runs = 0
        # What a trial's error is (outputs, expected -> a number): the outputs' worst pooled
        # rel L2, or the gate's own units where outputs are judged by their decisions
        # (npuprep.verify.decision_margin).
        self.score: TrialScore = worst_pooled_rel_l2
        self._errors: dict[bytes, float] = {}
        self._check_squares: dict[str, float] | None = None
        self._checks: dict[tuple[bytes, float, float, str, float | None], OutputCheck] = {}
        self._order = sorted(set(switched.weight_switches.values())
                             | set(switched.input_switches.values())
                             | set(switched.bias_switches.values()))
        self._means = {name: (kind, *key) for kind, switches in (
            ("weight", switched.weight_switches), ("input", switched.input_switches),
            ("bias", switched.bias_switches)) for key, name in switches.items()}

    def scored_by(self, score: TrialScore) -> None:
        """Trials' errors from here on by `score` (the errors kept are in the old units)."""
        if score is not self.score:
            self.score = score
            self._errors.clear()

    def close(self) -> None:
        """Free the session (its weights) once the search is done."""
        if self.runner is not None:
            self.runner.close()
        self.runner = None

    def _switches(self, assign: Mapping[str, str],
                  rules: Mapping[str, ScaleRule]) -> dict[str, np.ndarray]:
        return self.switched.feed(assign, rules, self.corrected)

    def _key(self, switches: Mapping[str, np.ndarray]) -> bytes:
        return np.packbits(np.array([bool(switches[s]) for s in self._order], bool)).tobytes()

    def switches(self, assign: Mapping[str, str], rules: Mapping[str, ScaleRule]) -> dict[str, np.ndarray]:
        """The session's switches for the trial (assign, rules)."""
        return self._switches(assign, rules)

    def remember(self, switches: Mapping[str, np.ndarray], error: float) -> None:
        """The error of the trial these switches make, measured elsewhere (`errors` keeps it)."""
        self._errors[self._key(switches)] = error

    @property
    def trial_samples(self) -> int:
        """The samples a trial's error (`errors`) is measured on."""
        return min(TRIAL_SAMPLES, len(self.samples))

    @property
    def batch_runs(self) -> int:
        """The runs handed to the runner at once (their outputs held until taken)."""
        return BATCH_TRIALS * TRIAL_SAMPLES

    def run_on(self, sample: int, feeds: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Each of `feeds`' outputs on one sample (npuprep.verify.bounded_trials)."""
        assert self.runner is not None, "the trials were closed"
        return self.runner.run([(sample, f) for f in feeds])

    def meaning(self, assign: Mapping[str, str], rules: Mapping[str, ScaleRule]) -> Meaning:
        """What the trial (assign, rules) switches on, in any session of the search."""
        return self._meaning(self._switches(assign, rules))

    def _meaning(self, switches: Mapping[str, np.ndarray]) -> Meaning:
        return frozenset(self._means[s] for s, on in switches.items() if on)

    def _outputs(self, trials: Sequence[dict[str, np.ndarray]],
                 count: int) -> list[list[dict[str, np.ndarray]]]:
        """Every trial's outputs on the first `count` samples, in one batch of jobs."""
        assert self.runner is not None, "the trials were closed"
        n = min(count, len(self.samples))
        got = self.runner.run([(i, switches) for switches in trials for i in range(n)])
        self.runs += len(trials)
        return [got[k * n:(k + 1) * n] for k in range(len(trials))]

    def outputs(self, assign: Mapping[str, str], rules: Mapping[str, ScaleRule],
                count: int | None = None) -> list[dict[str, np.ndarray]]:
        """The outputs of the first `count` samples (all: None) with the layers of `assign`
        in their 8-bit format (layer -> format)."""
        return self._outputs([self._switches(assign, rules)], count or len(self.samples))[0]

    def errors(self, trials: Sequence[tuple[Mapping[str, str], Mapping[str, ScaleRule]]], *,
               seen: Callable[[int, list[dict[str, np.ndarray]]], None] | None = None) -> list[float]:
        """Each trial's (assign, rules) error (`score`: the outputs' worst pooled rel L2 unless
        set) on the first TRIAL_SAMPLES samples; the trials not run before run in batches of BATCH_TRIALS.
        `seen(i, outputs)`: called with the outputs of every trial i, while its batch is
        held (every trial then runs, run before or not)."""
        feeds = [self._switches(a, r) for a, r in trials]
        keys = [self._key(f) for f in feeds]
        todo: dict[bytes, list[int]] = {}
        for i, k in enumerate(keys):
            if seen is not None or k not in self._errors:
                todo.setdefault(k, []).append(i)
        batches = []
        for k, first in todo.items():
            # A trial an earlier phase's session ran (TrialOutputs) is not run again.
            given = None if self.shared is None else self.shared.take(self._meaning(feeds[first[0]]))
            if given is None or len(given) != min(TRIAL_SAMPLES, len(self.samples)):
                batches.append((k, first))
                continue
            self._errors[k] = self.score(given, self.expected[:len(given)])
            if seen is not None:
                for i in first:
                    seen(i, given)
        # A batch's outputs are held until its errors are taken: BATCH_TRIALS at a time.
        for start in range(0, len(batches), BATCH_TRIALS):
            batch = batches[start:start + BATCH_TRIALS]
            for (k, first), got in zip(batch, self._outputs([feeds[i[0]] for _, i in batch],
                                                             TRIAL_SAMPLES), strict=True):
                self._errors[k] = self.score(got, self.expected[:len(got)])
                if seen is not None:
                    for i in first:
                        seen(i, got)
        return [self._errors[k] for k in keys]

    def error(self, assign: Mapping[str, str], rules: Mapping[str, ScaleRule]) -> float:
        """The trial's error (`score`) on the first TRIAL_SAMPLES samples."""
        return self.errors([(assign, rules)])[0]

    def check(self, assign: Mapping[str, str], rules: Mapping[str, ScaleRule], *, rtol: float,
              top_k: Mapping[str, Decision], margin: float = 1.0,
              stop_past: float | None = None) -> OutputCheck:
        """The outputs' check on every sample, as check_outputs judges a built model; the
        top-K decisions also with the error scaled by `margin` (OutputErrors). `stop_past`
        (outputs judged by rel L2 alone): the samples run a core's worth at a time, and once an
        output's squared errors so far over every sample's squared references pass it (or it
        holds Inf/NaN), the check fails there: its samples those run, each rel L2 that lower
        bound. A trial checked before alike (the same switches and gate: a head two searches
        share, an FP8 search's start its INT8 search tried as its other format) is not run
        again."""
        assert self.runner is not None, "the trials were closed"
        feed = self._switches(assign, rules)
        key = (self._key(feed), rtol, margin, repr(sorted(top_k.items())), stop_past)
        if key not in self._checks:
            self._checks[key] = self._check(feed, rtol=rtol, top_k=top_k, margin=margin,
                                            stop_past=stop_past)
        return self._checks[key]

    def _check(self, feed: dict[str, np.ndarray], *, rtol: float, top_k: Mapping[str, Decision],
               margin: float, stop_past: float | None) -> OutputCheck:
        assert self.runner is not None, "the trials were closed"
        errors = OutputErrors(top_k=dict(top_k), tie_rtol=rtol, margin=margin)
        sums, count = PooledSums(), len(self.samples)
        step = count
        if stop_past is not None and not top_k:
            from npuprep.calibrate.run import cores
            step = max(1, cores())
        self.runs += 1
        for at in range(0, count, step):
            got = self.runner.run([(i, feed) for i in range(at, min(at + step, count))])
            for r, c in zip(self.expected[at:at + step], got, strict=True):
                for name, rv in r.items():
                    if np.issubdtype(np.asarray(rv).dtype, np.floating):
                        errors.add(name, rv, np.asarray(c[name], dtype=np.float64))
                if step < count:
                    sums.add(c, r)
            if at + step < count and sums.worst(self._all_squares()) > stop_past:  # type: ignore[operator]
                found = errors.result()
                for name, low in sums.lows(self._all_squares()).items():
                    found[name]["rel_l2"] = low
                return OutputCheck(rtol=rtol, samples=at + step, outputs=found)
        return OutputCheck(rtol=rtol, samples=count, outputs=errors.result())

    def _all_squares(self) -> dict[str, float]:
        if self._check_squares is None:
            self._check_squares = reference_squares(self.expected)
        return self._check_squares


def errors_alone(reference: onnx.ModelProto, model: onnx.ModelProto,
                 groups: Sequence[Sequence[str]], stats: CalibrationStats, variant: Variant,
                 samples: Sequence[Feed], *, tensor_scales: Mapping[str, float] | None = None,
                 weights: WeightStore | None = None, runs: RunsFactory | None = None,
                 bounds: Sequence[float] | None = None,
                 expected: list[dict[str, np.ndarray]] | None = None,
                 centred_means: Mapping[str, np.ndarray] | None = None,
                 score: TrialScore | None = None) -> list[float]:
    """Each group of layers of `model` alone in `variant`'s format, every other node in
    FP32: the outputs' worst pooled rel L2 on TRIAL_SAMPLES samples, as the QDQ model of
    npuprep.verify.qdq_model.quantise gives it; every group a run of one session. `bounds`:
    per group, past it a lower bound will do (bounded_trials.errors_within); `expected`: the
    reference's outputs on those samples, where the caller has them; `centred_means`: layer ->
    its centred input's mean per channel; `score`: the outputs' judge, where not rel L2."""
    trials = _alone(reference, model, groups, stats, variant, list(samples)[:TRIAL_SAMPLES],
                    tensor_scales=tensor_scales, weights=weights, runs=runs, expected=expected,
                    centred_means=centred_means)
    if score is not None:
        trials.scored_by(score)
    asked = [(dict.fromkeys(group, variant.fmt.name), {}) for group in groups]
    try:
        return trials.errors(asked) if bounds is None else errors_within(trials, asked, bounds)
    finally:
        trials.close()


def errors_alone_each(reference: onnx.ModelProto, model: onnx.ModelProto,
                      groups: Sequence[Sequence[str]], stats: CalibrationStats, variant: Variant,
                      samples: Sequence[Feed], *, tensor_scales: Mapping[str, float] | None = None,
                      weights: WeightStore | None = None,
                      runs: RunsFactory | None = None) -> list[list[float]]:
    """errors_alone of each group on each of `samples` read alone ([group][sample]): the
    outputs' worst rel L2 on that sample, from one session and one reference run over all
    of them, not a session and a reference run per sample."""
    trials = _alone(reference, model, groups, stats, variant, samples,
                    tensor_scales=tensor_scales, weights=weights, runs=runs)
    try:
        return [[worst_pooled_rel_l2([got], [want]) for got, want in zip(
            trials.outputs(dict.fromkeys(group, variant.fmt.name), {}), trials.expected,
            strict=True)] for group in groups]
    finally:
        trials.close()


def _alone(reference: onnx.ModelProto, model: onnx.ModelProto, groups: Sequence[Sequence[str]],
           stats: CalibrationStats, variant: Variant, samples: Sequence[Feed], *,
           tensor_scales: Mapping[str, float] | None, weights: WeightStore | None,
           runs: RunsFactory | None,
           expected: list[dict[str, np.ndarray]] | None = None,
           centred_means: Mapping[str, np.ndarray] | None = None) -> Trials:
    """Trials of `model` with every layer of `groups` switchable to `variant`'s format alone,
    every other node in FP32, on `samples`."""
    from npuprep.numerics import get_format

    switched = switched_qdq(model, [x for group in groups for x in group], stats, [variant],
                            tensor_scales=tensor_scales, weights=weights or WeightStore(),
                            centred_means=centred_means)
    return Trials(reference, switched, get_format("fp32"), (), samples,
                  saturate=variant.saturate, runs=runs, expected=expected)


def choose_rules(trials: Trials, model: onnx.ModelProto, nodes: Sequence[str],
                 stats: CalibrationStats, fmt: EightBitFormat,
                 rules: Sequence[ScaleRule]) -> dict[str, ScaleRule]:
    """Per activation of `nodes` whose `rules` place different clips: the rule whose clip
    gives the least output error with that tensor's 8-bit readers alone in 8 bits."""
    from npuprep.calibrate.scales import clip_for

    scopes = node_scopes(model.graph)
    readers: dict[str, list[str]] = {}
    for label in nodes:
        if label in scopes:
            node, (g, *outer) = scopes[label]
            for name in activation_inputs(g, node, outer):
                readers.setdefault(name, []).append(label)
    candidates: dict[str, list[ScaleRule]] = {}
    for name in readers:
        clips: dict[float, ScaleRule] = {}
        for rule in rules:
            clips.setdefault(clip_for(stats.tensors[name], fmt, rule).value, rule)
        if len(clips) > 1:
            candidates[name] = list(clips.values())
    # A tensor's readers alone at each rule: only the least's trial runs every sample (least_errors).
    found = least_errors(
        trials,
        [[(dict.fromkeys(readers[name], fmt.name), {name: rule}) for rule in each]
         for name, each in candidates.items()],
        keep_bytes=trials.shared.max_bytes - trials.shared.held if trials.shared is not None else 0)
    chosen = {}
    for (name, each), (k, _, outputs) in zip(candidates.items(), found, strict=True):
        chosen[name] = each[k]
        # A reader alone at the rule chosen is the ranking's trial of that layer alone.
        if trials.shared is not None and outputs is not None:
            trials.shared.put(trials.meaning(dict.fromkeys(readers[name], fmt.name),
                                             {name: chosen[name]}), outputs)
    return chosen
