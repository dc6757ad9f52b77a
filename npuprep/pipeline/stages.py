"""One conversion pipeline for every format, as a declared list of stages:

    STAGES = (hold_out, goal, calibrate, plan, build, vendor_check, user_load, verdict, record)

    hold_out      the held-out part of the samples (or the --holdout ones), refused when the
                  plan has seen them                                     npuprep/holdout.py
    goal          which rule judges each output: top-1 where a consumer decides by argmax,
                  else rel L2 (--metric, --top-k)                        verify/output_check.py
    calibrate     the statistics of the calibration part (unless given)  calibrate/
    plan          prepare, find, plan for the resolved target            plan/decide.py
    build         fp16, bf16: rounds of rewrite -> lower -> verify       pipeline/lower_and_verify.py
                  int8, fp8_e4m3: rewrite -> quantise -> verify, keep the most sensitive layers
                  wider                                                  pipeline/quantise_and_verify.py
    vendor_check  the vendor toolchain builds and simulates it (--verify-with)  verify/vendor*.py
    user_load     the model loaded and run once as users load it (default session options, a
                  forked child); a known onnxruntime refusal avoided       runtime/user_load.py
    verdict       passed, the gate that tripped, the cause               pipeline/verdict.py
    record        what the conversion did, into the converted model     provenance.py

Each stage takes the run so far and returns it with its part filled in (a frozen dataclass,
as onnxscript's PassManager passes a model through its passes); `convert` runs them all,
`draft_plan` the first three. The CLI parses arguments and renders; it runs no stage itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import onnx

from npuprep.calibrate.stats import CalibrationStats
from npuprep.data import Feed, SampleSet
from npuprep.detections import Decision, Detection
from npuprep.errors import NpuprepError
from npuprep.fp16_source import eight_bit_source
from npuprep.held_out_bound import held_out_bound_note
from npuprep.model_io import Model, anchored
from npuprep.numerics import eight_bit_format, get_format
from npuprep.pipeline.lower_and_verify import lower_and_verify
from npuprep.pipeline.quantise_and_verify import DEFAULT_MIN_8BIT_SHARE, quantise_and_verify
from npuprep.pipeline.result import ConversionResult, SampleUse
from npuprep.pipeline.verdict import judge
from npuprep.plan import Plan
from npuprep.plan.decide import Planned, plan_for
from npuprep.profiles import ResolvedTarget, TargetProfile
from npuprep.provenance import ConversionRecord, Gates, Source, record_conversion, stats_fingerprint
from npuprep.scale_rules import DEFAULT_RULE, ScaleRule
from npuprep.verify.compare import DEFAULT_ATOL, default_rtol
from npuprep.verify.fp32_share import DEFAULT_MAX_FP32_SHARE
from npuprep.verify.output_check import GOAL_SAMPLES, Metric, judged_outputs
from npuprep.verify.output_errors import CTC_TEXT
from npuprep.verify.qdq_trials import RunsFactory
from npuprep.verify.vendor import VendorCheck

DEFAULT_RTOL = 1e-2
# 8-bit scales round every activation: the outputs are judged at a wider default tolerance.
DEFAULT_RTOL_8BIT = 5e-2
# `holdout=SPLIT`: hold out 1 in 4 of the samples (npuprep.holdout); `stats=CALIBRATE`:
# calibrate on the part kept. Together they are what `npuprep convert --data D` does.
SPLIT = "split"
CALIBRATE = "calibrate"

Samples = SampleSet | Sequence[Feed]


@dataclass(frozen=True)
class Settings:
    """What the user asked of one conversion (the CLI's options), every format's knobs."""

    precision: str | None = None  # None: the profile's default
    io_types: str = "fp32"
    rtol: float | None = None  # None: DEFAULT_RTOL, or DEFAULT_RTOL_8BIT for 8 bits
    max_rounds: int = 3
    max_fp32_share: float = DEFAULT_MAX_FP32_SHARE
    min_8bit_share: float = DEFAULT_MIN_8BIT_SHARE
    scale_rule: ScaleRule = DEFAULT_RULE
    search: str | None = None  # 8 bits: None or "auto" keeps a plain start that errs little
    opset: int | None = None
    top_k: Mapping[str, Decision] = field(default_factory=dict)
    metric: Metric = Metric.AUTO
    verify_with: str | None = None  # a vendor toolchain (npuprep.verify.vendor.VENDORS)
    vendor_python: str | None = None
    jobs: int = 1
    streams: int = 0
    show_progress: bool = False
    ray: str | None = None  # the 8-bit search's trials on Ray: "" a local Ray, else its address
    ray_cpus: int = 1

    @property
    def eight_bit(self) -> bool:
        return eight_bit_format(self.precision or "") is not None


@dataclass(frozen=True)
class Run:
    """One conversion on its way through STAGES: what was given, then what each stage made."""

    model: Model
    profile: TargetProfile
    settings: Settings
    samples: Samples
    progress: Callable[[str], None]  # told each step as it starts (the CLI's spinner)
    holdout_asked: Samples | Literal["split"] | None = None
    stats: CalibrationStats | Literal["calibrate"] | None = None
    user_plan: Plan | None = None
    stats_from_caller: bool = False  # `stats` were given, not calibrated in this run
    # hold_out: the samples planned and verified on, and those held out
    calibration: Samples = ()
    held_out: Sequence[Feed] | None = None
    feeds: Sequence[Feed] = ()  # the calibration part, read once (plan)
    use: SampleUse = SampleUse()
    notes: tuple[str, ...] = ()
    # goal: each float output -> the rule that judges it, in words
    judged_by: Mapping[str, str] = field(default_factory=dict)
    # plan
    target: ResolvedTarget | None = None
    planned: Planned | None = None
    # build, vendor_check, verdict, record
    result: ConversionResult | None = None

    @property
    def stats_given(self) -> CalibrationStats | None:
        """Statistics the caller gave (not calibrated in this run)."""
        return self.stats if self.stats_from_caller and isinstance(self.stats, CalibrationStats) else None


Stage = Callable[[Run], Run]


def hold_out(run: Run) -> Run:
    """The calibration part and the held-out part; a held-out check on samples the plan has
    seen is not one: --holdout samples that are --data samples, or that the --stats were
    calibrated on, are refused, and the default split holds out none the --stats saw."""
    from npuprep.holdout import overlap, same_feeds, split_holdout

    samples, asked, given = run.samples, run.holdout_asked, run.stats_given
    ids = _ids(samples)
    if asked is None:
        return replace(run, calibration=samples, use=_use(run, ids, ()))
    if asked != SPLIT:
        held_ids, held = _ids(asked), list(asked)
        both = isinstance(samples, SampleSet) and isinstance(asked, SampleSet)
        shared = overlap(samples, asked) if both else []
        if shared:
            raise NpuprepError(f"--holdout {_source(asked)}: {_some(shared)} also in --data; "
                               "a held-out check needs samples the plan has not seen")
        # Equal values: a copy of the --data set is no held-out set; a few equal samples
        # (real data repeats itself) check nothing new, and the notes say so.
        same = [held_ids[i] for i in same_feeds(samples, held)]
        if same and len(same) == len(held):
            raise NpuprepError(f"--holdout {_source(asked)}: every sample equals a --data sample "
                               "in value; a held-out check needs samples the plan has not seen")
        notes = (f"{_some(same)} of --holdout equal --data samples in value: they check "
                 "nothing the calibration samples do not",) if same else ()
        seen = _seen(given, asked, held_ids)
        if seen:
            raise NpuprepError(f"--holdout {_source(asked)}: {_some(seen)} are among the samples the "
                               "--stats were calibrated on; held-out samples must be unseen")
        return replace(run, calibration=samples, held_out=held, use=_use(run, ids, held_ids),
                       notes=(*run.notes, *notes))
    if not isinstance(samples, SampleSet):
        raise NpuprepError("holdout='split' holds out part of a SampleSet (npuprep.data."
                           "load_samples); give held-out feeds as `holdout` instead")
    split = split_holdout(samples, stats_given=given is not None)
    seen = _seen(given, samples, split.held_out_ids)
    if seen:
        # The stats planned on every sample the split would hold out: verifying on them again
        # is no held-out check, and saying so is the truthful verdict.
        said = (f"no held-out check: the --stats were calibrated on the --data samples "
                f"that would be held out ({_some(seen)}); verified on all {len(ids)} --data "
                "samples (--holdout names samples the stats did not see)")
        return replace(run, calibration=samples, use=_use(run, ids, ()), notes=(*run.notes, said))
    kept = tuple(i for i in ids if i not in set(split.held_out_ids))
    return replace(run, calibration=split.calibration, held_out=split.held_out or None,
                   use=_use(run, kept, split.held_out_ids),
                   notes=(*run.notes, split.said))


def goal(run: Run) -> Run:
    """The user's goal: the outputs judged by their top-1 decision (the --top-k given, and
    under --metric auto those a consumer decides by argmax), the rest by rel L2."""
    s = run.settings
    samples = run.calibration
    first = list(samples.iter_range(0, min(GOAL_SAMPLES, len(samples)))) \
        if isinstance(samples, SampleSet) else list(samples[:GOAL_SAMPLES])
    top_k, judged = judged_outputs(run.model.proto, first, s.metric, s.top_k,
                                   source=run.model.path)
    return replace(run, settings=replace(s, top_k=top_k), judged_by=judged)


def calibrate(run: Run) -> Run:
    """Statistics of the calibration part, unless the caller gave them (or asked for none)."""
    if run.stats != CALIBRATE:
        return run
    from npuprep.calibrate import calibrate as measure

    run.progress("calibrating")
    s = run.settings
    # 8-bit scales read the exponent histogram of every element (percentile, MSE); FP16 and
    # BF16 read their own formats' counts only, exact at a fraction of the cost where the
    # activations pass FP8's range (raw pixels: issue 37's 512x416 FCN).
    detail = "all" if s.eight_bit else "fp16" if s.precision in ("fp16", "bf16") else "auto"
    stats = measure(run.model, run.calibration, jobs=s.jobs, streams=s.streams,
                    show_progress=s.show_progress, detail=detail)
    return replace(run, stats=stats)


def plan(run: Run) -> Run:
    """The target resolved once, then prepare, find, plan (npuprep.plan.decide.plan_for).
    8-bit conversions plan their wider layers in FP16: its remedies keep them in range."""
    s = run.settings
    target = run.profile.resolve("fp16" if s.eight_bit else s.precision)
    run.progress("findings")
    stats = run.stats if isinstance(run.stats, CalibrationStats) else None
    feeds = list(run.calibration)
    planned = plan_for(run.model, target, stats, feeds or None, plan=run.user_plan)
    return replace(run, target=target, planned=planned, feeds=feeds)


def build(run: Run) -> Run:
    """The plan applied and lowered (FP16/BF16) or quantised (INT8/FP8), and verified."""
    s, planned, target = run.settings, run.planned, run.target
    assert planned is not None and target is not None, "build runs after plan"
    samples, held = list(run.feeds), (list(run.held_out) if run.held_out else None)
    rtol = _rtol(s)
    eight = eight_bit_format(s.precision or "", target.profile.int8_activations)
    if eight is not None and planned.stats is None:
        raise NpuprepError(f"--precision {s.precision} sets its scales from calibration: give "
                           "--data or --stats")
    if s.search is not None and eight is None:
        raise NpuprepError(f"--search {s.search} chooses how the 8-bit search runs: it applies "
                           "to --precision int8 or fp8_e4m3")
    if s.search not in (None, "auto", "always"):
        raise NpuprepError(f"--search {s.search}: auto or always")
    if s.ray is not None and eight is None:
        raise NpuprepError("--ray runs the 8-bit search's trials on Ray: it applies to "
                           "--precision int8 or fp8_e4m3")
    if eight is not None:
        with _trial_runs(s) as runner:
            result = quantise_and_verify(run.model, planned, target, eight, samples, held,
                                         use=run.use, rtol=rtol, scale_rule=s.scale_rule,
                                         min_8bit_share=s.min_8bit_share, opset=s.opset,
                                         top_k=s.top_k, stage=run.progress, runner=runner,
                                         plain_start=s.search != "always")
    else:
        result = lower_and_verify(run.model, planned, target, samples, held, use=run.use,
                                  io_types=s.io_types, rtol=rtol, max_rounds=s.max_rounds,
                                  max_fp32_share=s.max_fp32_share, opset=s.opset,
                                  top_k=s.top_k, stage=run.progress)
    return replace(run, result=replace(result, notes=(*run.notes, *result.notes),
                                       judged_by=dict(run.judged_by)))


@contextlib.contextmanager
def _trial_runs(s: Settings) -> Iterator[RunsFactory | None]:
    """Where the 8-bit search's trial runs run: this process, or (`--ray`) Ray actors for the
    time of the search (npuprep.calibrate.on_ray)."""
    if s.ray is None:
        yield None
        return
    from npuprep.calibrate.on_ray import SessionsOnRay, joined

    with joined(s.ray or None) as ray:
        sessions = SessionsOnRay(ray, cpus_per_actor=s.ray_cpus)
        try:
            yield sessions
        finally:
            sessions.close()


def vendor_check(run: Run) -> Run:
    """The converted model built and simulated by the vendor toolchain (--verify-with); an
    exact rewrite that made a refusing tool build it becomes the model written."""
    s, result = run.settings, run.result
    if s.verify_with is None or result is None:
        return run
    from npuprep.verify.vendor import vendor_check as simulate
    from npuprep.verify.vendor import with_layers
    from npuprep.verify.vendor_8bit import vendor_check_8bit

    run.progress(f"building with {s.verify_with}")
    if s.verify_with == "openvino":
        return replace(run, result=replace(result, vendor=_openvino_check(run, result)))
    if result.eight_bit:
        held = list(run.held_out) if run.held_out else list(run.samples)
        check = vendor_check_8bit(run.model.proto, result, list(run.feeds), held,
                                  vendor=s.verify_with, python=s.vendor_python, rtol=_rtol(s),
                                  top_k=dict(s.top_k))
    else:
        check = simulate(run.model.proto, result.lowered.model, list(run.samples), vendor=s.verify_with,
                         python=s.vendor_python, rtol=_rtol(s), host_scales=result.host_scales,
                         bisect=True)
    built = check.fixed_model if check.fixed_model is not None else result.lowered.model
    check = with_layers(check, _named(built, run.model), result.profile.resolve(result.fmt.name),
                        f"{s.verify_with}_error_analysis.txt")
    if check.fixed_model is not None:
        result = _with_vendor_fix(result, check)
    return replace(run, result=replace(result, vendor=check))


def user_load(run: Run) -> Run:
    """The model to be written, loaded and run on one sample by onnxruntime with default
    session options (every fusion on), as a user loads it; npuprep's own sessions verified it
    with fusions that look through Casts off. What onnxruntime is known to refuse is written
    so it takes it (rewrite/default_session.py); any other refusal or crash is one line, and
    nothing is written."""
    from npuprep.runtime.user_load import load_as_users_do, onnxruntime_version

    result = run.result
    assert result is not None, "user_load runs after build"
    feeds = list(run.held_out or ()) or list(run.feeds)
    feed = feeds[0] if feeds else None
    run.progress("loading it as users do")
    model, note = result.lowered.model, None
    # An 8-bit model is run with basic optimisations too: a default-session fusion wrong for
    # its Q/DQ pairs computes another function than the one verified.
    drift = result.eight_bit is not None and feed is not None
    loaded = load_as_users_do(model, feed, drift=drift)
    fixed = _avoided(model, loaded.refused)
    if fixed is not None:
        model, note = fixed
        loaded = load_as_users_do(model, feed, drift=drift)
    said = loaded.refused
    if said is not None and _NO_KERNEL in said:
        # No CPU kernel for an op in this format (BF16 mostly) is this provider's gap, not a
        # defect of the model: the target's runtime has them. Said, not refused.
        kernel = said[said.index(_NO_KERNEL):].split(". ")[0]
        note = (f"not loaded as users load it here: onnxruntime {onnxruntime_version()}'s CPU "
                f"provider has no kernel for it ({kernel}); load it on the target's runtime")
        said = None
    if said is not None:
        raise NpuprepError(f"{run.model.path}: the converted model does not load in onnxruntime "
                           f"{onnxruntime_version()} with default session options, as users load it "
                           f"({said}); nothing was written")
    notes = ((note,) if note is not None else ()) + _drift_note(loaded.drift, _rtol(run.settings))
    if notes:
        result = replace(result, lowered=replace(result.lowered, model=model),
                         notes=(*result.notes, *notes))
    return replace(run, result=result)


def _drift_note(drift: Mapping[str, float], rtol: float) -> tuple[str, ...]:
    """A note where onnxruntime's default session computes the 8-bit model otherwise than the
    basic-optimisation sessions that verified it (a fusion wrong for 8-bit Q/DQ)."""
    from npuprep.runtime.user_load import onnxruntime_version

    off = {name: d for name, d in drift.items() if d > rtol / 10}
    if not off:
        return ()
    name, worst = max(off.items(), key=lambda kv: kv[1])
    return (f"onnxruntime {onnxruntime_version()}'s default session (every fusion on) computes "
            f"this model otherwise than the one verified: output '{name}' differs by rel L2 "
            f"{worst:.3g} from a session with basic optimisations (a fusion wrong for these Q/DQ "
            "pairs: 1.32's ReluQuantRewrite drops a Relu before an FP8 QuantizeLinear); run it "
            "with graph_optimization_level=ORT_ENABLE_BASIC to get the verified function (the "
            "target's compiler reads the Q/DQ pairs, not onnxruntime's fusions)",)


_NO_KERNEL = "Could not find an implementation for"


def _avoided(model: onnx.ModelProto, said: str | None) -> tuple[onnx.ModelProto, str] | None:
    """`model` rewritten to avoid the refusal onnxruntime `said`, and the note; None if it is
    no pattern we know."""
    from npuprep.rewrite.default_session import squares_as_products, transposes_in_fp32

    if said is not None and "LayerNormFusion" in said:
        fixed, squares = squares_as_products(model)
        if not squares:
            return None
        return fixed, (f"{len(squares)} norm square{'s' if len(squares) > 1 else ''} ({squares[0]}"
                       f"{' ...' if len(squares) > 1 else ''}) written Mul(x, x), not Pow(x, 2): "
                       "onnxruntime's LayerNormFusion fuses them across an FP16 -> FP32 Cast into a "
                       "node it refuses to load")
    if said is not None and "crashed" in said:
        fixed, moved = transposes_in_fp32(model)
        if not moved:
            return None
        return fixed, (f"{len(moved)} FP16 Transpose{'s' if len(moved) > 1 else ''} before a MatMul "
                       f"({moved[0]}{' ...' if len(moved) > 1 else ''}) computed in FP32 between "
                       "Casts, the same values: onnxruntime's default session crashes loading an "
                       "FP16 Transpose that feeds a MatMul")
    return None


def _openvino_check(run: Run, result: ConversionResult) -> VendorCheck:
    """OpenVINO given the FP32 graph with the plan's rewrites (the QDQ model for 8 bits) and
    the format as its precision hint, on the held-out samples."""
    from npuprep.verify.vendor_openvino import openvino_check

    held = list(run.held_out) if run.held_out else list(run.samples)
    model = result.lowered.model if result.eight_bit else result.rewritten
    target = result.profile.resolve(result.fmt.name)
    return openvino_check(run.model.proto, model, held, target, plan=result.plan,
                          rtol=_rtol(run.settings), host_scales=result.host_scales,
                          top_k=dict(run.settings.top_k))


def verdict(run: Run) -> Run:
    """Passed, the gate that tripped and the cause: computed once, before anything is written."""
    assert run.result is not None, "verdict runs after build"
    from npuprep.holdout import louder_inputs
    louder = louder_inputs(run.feeds, run.held_out) if run.held_out else {}
    result = replace(run.result, louder_inputs=louder)
    held = result.holdout
    bound = None if held is None else held_out_bound_note(held.samples, held.rtol, held.outputs)
    if bound is not None:
        result = replace(result, notes=(*result.notes, bound))
    return replace(run, result=replace(result, verdict=judge(result)))


def record(run: Run) -> Run:
    """What the conversion did, written into the converted model itself (metadata_props):
    the plan as applied, the statistics and samples it used, its gates and its verdict."""
    s, result = run.settings, run.result
    assert result is not None and result.verdict is not None, "record runs after verdict"
    given = run.stats_given
    gates = Gates(rtol=_rtol(s), atol=DEFAULT_ATOL, top_k=dict(s.top_k),
                  max_fp32_share=None if s.eight_bit else s.max_fp32_share,
                  min_8bit_share=s.min_8bit_share if s.eight_bit else None)
    made = ConversionRecord(
        source=Source(run.model.fingerprint, dict(result.tensor_scales)),
        target=result.profile.name, precision=result.precision, gates=gates,
        plan=result.plan.to_dict(), passed=result.verdict.passed,
        cause="" if result.verdict.passed else result.verdict.said.removeprefix("FAILED").lstrip(": "),
        stats_fingerprint=stats_fingerprint(given.to_dict()) if given is not None else None,
        calibration_ids=result.samples.calibration_ids, holdout_ids=result.samples.holdout_ids,
        calibration_source=dict(result.samples.calibration_source),
        host_scales=dict(result.host_scales), pinned_nodes=tuple(result.pinned_nodes))
    record_conversion(result.lowered.model, made)
    return replace(run, result=replace(result, record=made))


STAGES: tuple[Stage, ...] = (hold_out, goal, calibrate, plan, build, vendor_check, user_load, verdict,
                             record)
# Up to the plan: what `convert --plan-only` writes.
PLAN_STAGES: tuple[Stage, ...] = (calibrate, plan)


def convert(
    model: Model,
    profile: TargetProfile,
    samples: Samples,
    *,
    stats: CalibrationStats | Literal["calibrate"] | None = None,
    plan: Plan | None = None,
    holdout: Samples | Literal["split"] | None = None,
    precision: str | None = None,
    io_types: str = "fp32",
    rtol: float | None = None,
    samples_description: str = "",
    synthetic: bool = False,
    max_rounds: int = 3,
    max_fp32_share: float = DEFAULT_MAX_FP32_SHARE,
    min_8bit_share: float = DEFAULT_MIN_8BIT_SHARE,
    scale_rule: ScaleRule = DEFAULT_RULE,
    search: str | None = None,
    opset: int | None = None,
    top_k: Mapping[str, Decision] | None = None,
    metric: Metric | str = Metric.AUTO,
    verify_with: str | None = None,
    vendor_python: str | None = None,
    jobs: int = 1,
    streams: int = 0,
    show_progress: bool = False,
    progress: Callable[[str], None] | None = None,
    ray: str | None = None,
    ray_cpus: int = 1,
) -> ConversionResult:
    """Plan (unless `plan` is given), rewrite, lower or quantise, and verify `model` for
    `profile` in `precision` (None: the profile's default; fp16, bf16, int8, fp8_e4m3).

    `samples`: a SampleSet (npuprep.data.load_samples) or a list of feeds; verification runs
    on them. `holdout`: feeds (or a SampleSet) not used for calibration to verify on too, or
    SPLIT to hold out 1 in 4 of `samples`. `stats`: calibration statistics, CALIBRATE to
    measure them on the calibration part, None to plan from static findings only (8 bits
    need statistics). `holdout=SPLIT, stats=CALIBRATE` is what `npuprep convert --data D`
    does. The result fails when an output misses `rtol` (default 1e-2, BF16 1.56e-2, 8 bits 5e-2;
    `top_k` {output: K} also passes an output whose top-K classes agree; `metric` "auto" adds
    K=1 for the outputs a consumer decides by argmax, "rel-l2" none, "top1" every output with
    classes), when more than
    `max_fp32_share` of the FLOPs stay FP32 (FP16/BF16), or when less than `min_8bit_share`
    of the multiply-adds run in 8 bits. `search` (8 bits): None or "auto" keeps the plain start
    (every layer 8-bit, default rule, weights at nearest) where it errs under half of `rtol`,
    "always" balances, rounds and searches anyway. `verify_with` ("rknn") also builds it with the vendor
    toolchain. The lowered model keeps the model's opset unless `opset` asks for another.
    `progress` is told each stage as it starts (the CLI's spinner). `ray` ("" a local Ray, or
    a cluster's address) runs the 8-bit search's trials as Ray actors of `ray_cpus` CPUs each
    (the result is the same as in one process)."""
    settings = Settings(
        precision=profile.precision_of(precision), io_types=io_types, rtol=rtol,
        max_rounds=max_rounds, max_fp32_share=max_fp32_share, min_8bit_share=min_8bit_share,
        scale_rule=scale_rule, search=search, opset=opset, top_k={}, metric=Metric(metric),
        verify_with=verify_with, vendor_python=vendor_python, jobs=jobs, streams=streams,
        show_progress=show_progress, ray=ray, ray_cpus=ray_cpus)
    run = _start(model, profile, samples, settings, progress, holdout=holdout, stats=stats,
                 plan=plan, described=(samples_description, synthetic))
    run = replace(run, settings=replace(settings, top_k=checked_top_k(run.model, top_k)))
    for stage in STAGES:
        run = stage(run)
    assert run.result is not None
    if run.result.source.path == model.path:
        return run.result
    # Reports name the user's file, also where the run converted its FP32 widening.
    return replace(run.result, source=replace(run.result.source, path=model.path))


def draft_plan(model: Model, profile: TargetProfile, samples: Samples | None, *,
               stats: CalibrationStats | Literal["calibrate"] | None = None,
               precision: str | None = None, jobs: int = 1, streams: int = 0,
               show_progress: bool = False) -> Plan:
    """The plan `convert` would start from (calibrated on every sample: nothing is held
    out, since nothing is verified): what `npuprep convert --plan-only` writes."""
    settings = Settings(precision=profile.precision_of(precision), jobs=jobs,
                        streams=streams, show_progress=show_progress)
    if samples is None and stats == CALIBRATE:
        stats = None
    run = _start(model, profile, samples or (), settings, None, holdout=None, stats=stats,
                 plan=None, described=("", False))
    run = replace(run, calibration=run.samples)
    for stage in PLAN_STAGES:
        run = stage(run)
    assert run.planned is not None
    return run.planned.plan


def _start(model: Model, profile: TargetProfile, samples: Samples, settings: Settings,
           progress: Callable[[str], None] | None, *, holdout: Samples | Literal["split"] | None,
           stats: CalibrationStats | Literal["calibrate"] | None, plan: Plan | None,
           described: tuple[str, bool]) -> Run:
    description, synthetic = described
    if isinstance(samples, SampleSet):
        description, synthetic = description or samples.describe(), synthetic or samples.synthetic
    # Rules and rewrites read each weight from the user's file as they need it.
    model = anchored(model)
    model, widened = eight_bit_source(model) if settings.eight_bit else (model, "")
    return Run(model=model, profile=profile, settings=settings, samples=samples,
               progress=progress or (lambda _: None), holdout_asked=holdout, stats=stats,
               user_plan=plan, stats_from_caller=isinstance(stats, CalibrationStats),
               use=SampleUse(description=description, synthetic=synthetic),
               notes=(widened,) if widened else ())


def _rtol(settings: Settings) -> float:
    """The user's rtol, else compare's default for the format (1%, or two units of its
    rounding where coarser: BF16 1.56%), so both commands hold a conversion to one gate."""
    if settings.rtol is not None:
        return settings.rtol
    if settings.eight_bit:
        return DEFAULT_RTOL_8BIT
    return default_rtol(get_format(settings.precision)) if settings.precision else DEFAULT_RTOL


def _ids(samples: Samples) -> tuple[str, ...]:
    if isinstance(samples, SampleSet):
        return tuple(str(i) for i in samples.sample_ids())
    return tuple(str(i) for i in range(len(samples)))


def _use(run: Run, calibration_ids: tuple[str, ...], holdout_ids: tuple[str, ...]) -> SampleUse:
    given = run.stats_given
    # Statistics given by the caller say which samples they were calibrated on.
    ids = tuple(str(i) for i in given.sample_ids) if given is not None else calibration_ids
    where = given.source if given is not None else (
        run.samples.source_info() if isinstance(run.samples, SampleSet) else {})
    return replace(run.use, calibration_ids=ids, holdout_ids=holdout_ids,
                   calibration_source=dict(where or {}))


def _seen(given: CalibrationStats | None, samples: Samples, ids: Sequence[str]) -> list[str]:
    from npuprep.holdout import seen_by_stats

    if given is None or not isinstance(samples, SampleSet):
        return []
    seen = set(seen_by_stats(given.source, given.sample_ids, samples))
    return [i for i in ids if i in seen]


def _source(samples: Samples) -> str:
    return samples.source if isinstance(samples, SampleSet) else "(feeds)"


def _some(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:2]) + (f" and {len(ids) - 2} more" if len(ids) > 2 else "")
    return f"{len(ids)} sample{'s' if len(ids) != 1 else ''} ({shown})"


def _named(proto: object, source: Model) -> Model:
    """The model a vendor built, named for its layer report."""
    from npuprep.model_io import fingerprint

    return Model(proto=proto, path=f"{source.path}.converted.onnx", digest=fingerprint(proto))


def _with_vendor_fix(result: ConversionResult, vendor: VendorCheck) -> ConversionResult:
    """The conversion with the exact rewrite that made the vendor tool build it
    (verify.vendor_bisect)."""
    lines = (vendor.bisection or {})["lines"]
    return replace(result, lowered=replace(result.lowered, model=vendor.fixed_model),
                   notes=(*result.notes, f"{lines[0]}; {'; '.join(lines[1:])} (the model written)"))


def checked_top_k(model: Model, top_k: Mapping[str, Decision] | None) -> dict[str, Decision]:
    """`--top-k` and `--detect` checked against the model's outputs (convert's and compare's
    one rule)."""
    outputs = {o.name for o in model.proto.graph.output}
    for name, k in (top_k or {}).items():
        flag = "--detect" if isinstance(k, Detection) else "--top-k"
        if name not in outputs:
            raise NpuprepError(f"{flag} names '{name}', which is not an output of {model.path} "
                               f"(outputs: {', '.join(sorted(outputs))})")
        out = next(o for o in model.proto.graph.output if o.name == name)
        dims = out.type.tensor_type.shape.dim
        if isinstance(k, Detection):
            _check_detection(model, name, k)
            continue
        if k == CTC_TEXT:
            # Judged by its CTC text (npuprep.verify.output_errors): steps x classes last.
            if out.type.tensor_type.HasField("shape") and len(dims) < 2:
                raise NpuprepError(f"--top-k {name}:ctc: output '{name}' has {len(dims)} axis(es); "
                                   "a CTC output is steps x classes (its last two axes)")
            continue
        if not isinstance(k, int) or k < 1:
            raise NpuprepError(f"--top-k {name}: K must be a whole number >= 1, not {k!r}")
        if dims and dims[-1].HasField("dim_value") and k >= dims[-1].dim_value:
            raise NpuprepError(f"--top-k {name}:{k}: output '{name}' has {dims[-1].dim_value} classes along "
                               f"its last axis; K must be smaller (K = all of them judges nothing)")
    return dict(top_k or {})


def _check_detection(model: Model, name: str, rule: Detection) -> None:
    """A --detect output is a float tensor with a classes (or box values) axis last, and a box
    output's other axes, where declared, are its score output's."""
    out = {o.name: o for o in model.proto.graph.output}
    dims = out[name].type.tensor_type.shape.dim
    if out[name].type.tensor_type.HasField("shape") and len(dims) < 1:
        raise NpuprepError(f"--detect {name}: output '{name}' is a scalar; a score output is "
                           "positions x classes")
    if rule.scores is None:
        if rule.classes is not None and dims and dims[-1].HasField("dim_value"):
            rule.check_classes(dims[-1].dim_value, name)
        return
    if rule.scores not in out:
        raise NpuprepError(f"--detect {rule.scores}={name}: '{rule.scores}' is not an output of "
                           f"{model.path}")
    theirs = out[rule.scores].type.tensor_type.shape.dim
    declared = [(a.dim_value if a.HasField("dim_value") else None) for a in dims[:-1]]
    scores = [(a.dim_value if a.HasField("dim_value") else None) for a in theirs[:-1]]
    differ = len(declared) != len(scores) or any(
        a is not None and b is not None and a != b for a, b in zip(declared, scores, strict=False))
    if dims and theirs and differ:
        raise NpuprepError(f"--detect {rule.scores}={name}: the box output's positions {declared} "
                           f"are not the score output's {scores} (every axis but the last must "
                           "match)")
