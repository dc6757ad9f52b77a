"""`npuprep compare REF CAND --data D` / `npuprep compare REF --emulate --target T`: first divergent node."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from npuprep import json_io
from npuprep.cli.common import (
    add_data,
    add_goal,
    add_json,
    begin,
    fmt,
    nonnegative_float,
    open_samples,
    out,
    parse_decisions,
    positive_float,
    positive_int,
    print_json,
    print_table,
    progress,
    say,
)
from npuprep.names import md_cell, md_code, md_text

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from npuprep.data import SampleSet
    from npuprep.model_io import Model
    from npuprep.numerics import NumberFormat
    from npuprep.profiles import ResolvedTarget, TargetProfile
    from npuprep.verify.compare import CompareResult, OutputGate

help = "compare two models (or a model and its emulation on a target) tensor by tensor"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ref", help="reference model (FP32)")
    p.add_argument("cand", nargs="?", help="candidate model (omit with --emulate)")
    p.add_argument("--emulate", action="store_true",
                   help="compare REF with its own emulation on --target (rounding, overflow)")
    p.add_argument("--target", "-t", help="profile name or YAML: format limit, overflow behaviour")
    p.add_argument("--pin", action="append", default=[], metavar="NODE",
                   help="with --emulate: node kept in FP32 (repeatable)")
    add_data(p, required=True)
    p.add_argument("--as-is", action="store_true",
                   help="run a low-precision CAND unchanged (default: widen it to FP32 with explicit "
                        "rounding where it stores FP16/BF16/FP8, as the target computes)")
    p.add_argument("--scales", metavar="R", help="convert report JSON whose 'tensor_scales' maps "
                   "tensor -> s with candidate = s * reference")
    p.add_argument("--rtol", type=positive_float, help="relative L2 threshold (default: 1%%, coarser for FP8)")
    p.add_argument("--atol", type=nonnegative_float, help="max abs error threshold (default 1e-3); a tensor "
                   "fails when both are exceeded")
    p.add_argument("--tol", action="append", default=[], metavar="NAME:RTOL[:ATOL]",
                   help="per-tensor thresholds (repeatable)")
    add_goal(p, default_metric=None)
    p.add_argument("--isolate", action="store_true",
                   help="also feed each node the reference's inputs: its own error apart from "
                        "accumulated error (runs the candidate twice)")
    p.add_argument("--worst", type=positive_int, default=5, metavar="K", help="how many worst tensors to show")
    p.add_argument("--with", dest="with_vendor", choices=("rknn",),
                   help="also build CAND with the vendor toolchain and compare its simulator's "
                        "outputs with REF (rknn: rknn-toolkit2 in its own venv)")
    p.add_argument("--vendor-python", metavar="PATH",
                   help="python of the vendor venv (default: $NPUPREP_RKNN_PYTHON, then "
                        "~/.cache/npuprep/rknn-venv)")
    p.add_argument("--report-md", dest="report", metavar="OUT.md", help="write a Markdown report")
    # `--report` names an input (crosscheck's compiler report); the old output spelling still works.
    p.add_argument("--report", dest="report", help=argparse.SUPPRESS)
    p.add_argument("--html", metavar="OUT.html", help="also write a self-contained HTML report")
    add_json(p)


def _as_exported_note(ref: Any, target: ResolvedTarget) -> tuple[str, ...]:
    """A note when `convert` would plan on another graph than the one emulated here (the
    fusions a compiler makes): a failure here may be gone there."""
    from npuprep.rewrite.passes import prepare_for_target

    prepared = prepare_for_target(ref, target)
    changes = prepared.notes
    if prepared.model is ref or not changes:
        return ()
    return (f"this emulates the model as exported; convert plans and verifies it after the "
            f"changes a compiler makes ({len(changes)}: {changes[0]}{'; ...' if len(changes) > 1 else ''}), "
            "and `convert --plan-only` lists them",)


def run(args: argparse.Namespace) -> int:
    from npuprep.errors import NpuprepError
    from npuprep.model_io import anchored, load_model
    from npuprep.verify.compare import (
        DEFAULT_ATOL,
        compare_models,
        default_rtol,
        emulation_notes,
        upgrade_notes,
    )
    from npuprep.verify.emulate import LIMITS

    if args.emulate == bool(args.cand):
        raise NpuprepError("give either a candidate model (REF CAND) or --emulate, not both or neither")
    if args.emulate and not args.target:
        raise NpuprepError("--emulate needs --target (which format and overflow to emulate)")
    if args.pin and not args.emulate:
        raise NpuprepError("--pin only applies with --emulate")
    if args.as_is and args.emulate:
        raise NpuprepError("--as-is applies to a candidate model, not to --emulate")
    if args.with_vendor and args.emulate:
        raise NpuprepError(f"--with {args.with_vendor} builds a candidate model: give REF CAND, not --emulate")
    if args.report and args.report.endswith(".onnx"):
        raise NpuprepError(f"--report {args.report}: the report is Markdown, not a model")
    run_ = begin(args, inputs=("data", "scales"), model_arg="ref", model_what="the reference model")
    ref, profile, target, outputs = run_.model, run_.profile, run_.target, run_.outputs
    outputs.reads_model(args.cand, "the candidate model")
    if args.report:
        outputs.writes(args.report, "--report")
    if args.html:
        outputs.writes(args.html, "--html")
    with outputs.open() as files:
        overrides = _parse_tols(args.tol)
        scales = _read_scales(args.scales) if args.scales else None
        samples = open_samples(args, ref.proto)
        notes: tuple[str, ...] = ()
        gate = None
        channel_scales: dict[str, np.ndarray] = {}
        if args.emulate:
            from npuprep.profiles import Pinning
            from npuprep.verify.emulate import emulate

            if args.pin and profile.fp32_pinning is Pinning.NONE:
                raise NpuprepError(f"--pin: target {profile.name} cannot keep nodes in FP32 "
                                   "(fp32_pinning: none); its device runs every node in "
                                   f"{target.fmt.name}")
            fmt_ = target.fmt
            # Weights rounded in the graph: the compare graph then holds one set of them.
            emulation = emulate(ref.proto, fmt_, saturate=target.saturate, pinned_nodes=args.pin,
                                weights_in_graph=True)
            known = _node_labels(ref.proto)
            unknown = [n for n in args.pin if n not in known]
            if unknown:
                raise NpuprepError(f"--pin names node '{unknown[0]}', which {args.ref} does not have")
            cand_proto = emulation.model
            notes = (emulation_notes(target, emulation.saturate) + upgrade_notes(emulation)
                     + _as_exported_note(ref, target))
        else:
            cand_proto = anchored(load_model(args.cand, weights="file")).proto
            gate, gate_notes = conversion_gate(ref, cand_proto, args, samples)
            notes += gate_notes
            if scales is None:
                scales, scale_note = _recorded_scales(ref, cand_proto)
                notes += scale_note
            channel_scales, channel_note = _recorded_channel_scales(ref, cand_proto)
            notes += channel_note
            stored = _stored_format(cand_proto)
            fmt_ = target.fmt if target else stored
            # An FP8 (or mixed INT8/FP8) conversion stores FP8 weights behind its Q/DQ pairs: it
            # is run as convert verified it, not widened as a model lowered to FP8 storage.
            verified = _as_verified(ref, cand_proto, profile) if not args.as_is else None
            if verified is not None:
                cand_proto, fmt_, said = verified
                notes += (said,)
            elif stored is not None and not args.as_is:
                from npuprep.verify.emulate_lowered import emulate_lowered

                # Overflow behaviour comes from the target; without one, IEEE (loud) is assumed.
                saturate = target.saturates_in(stored) if target else False
                cand_proto = emulate_lowered(cand_proto, stored, saturate=saturate).model
                notes += (f"the candidate stores {stored.name}: compared as the target computes it, "
                         f"widened to FP32 with explicit rounding wherever it stores {stored.name} "
                         f"(overflow {'saturates' if saturate else 'gives Inf/NaN'}"
                         f"{'' if profile else ', assumed: give --target'}); onnxruntime's CPU provider "
                         "would compute parts of it in FP32 and hide overflow (--as-is runs it unchanged)",
                         LIMITS)
            elif stored is not None:
                notes += ("the candidate ran as-is on onnxruntime's CPU provider, which computes parts "
                         f"of a {stored.name} model in FP32 and hides overflow",)
        gate, goal_notes = goal_gate(ref, args, samples, gate, fmt_)
        notes += goal_notes
        rtol = default_rtol(fmt_) if gate is None else gate.rtol
        atol = DEFAULT_ATOL if gate is None else gate.atol
        # A gate judges the graph outputs of this same run, as convert's output check does.
        ref_outputs: list[dict[str, Any]] | None = [] if gate is not None else None
        cand_outputs: list[dict[str, Any]] | None = [] if gate is not None else None
        result = compare_models(
            ref.proto, cand_proto, _Progress(samples, not args.json),
            rtol=rtol if args.rtol is None else args.rtol,
            atol=atol if args.atol is None else args.atol,
            overrides=overrides, tensor_scales=scales, channel_scales=channel_scales, fmt=fmt_,
            isolate=args.isolate, worst=args.worst,
            reference_outputs=ref_outputs, candidate_outputs=cand_outputs,
        )
        result = replace(result, notes=result.notes + notes, gate=gate, output_errors=(
            gate.judge(ref_outputs or [], cand_outputs or []) if gate is not None else {}))
        masks = mask_rows(ref, result)
        if args.report:
            files.text(args.report, render_markdown(result, args, masks))
        if args.html:
            from npuprep.report.render_html import render

            page = result.to_dict() | {"masks": sorted(masks)}
            if profile is not None:
                page["profile"] = profile.to_dict()
            files.text(args.html, render(page))
        vendor = _vendor(args, ref, samples, profile, scales) if args.with_vendor else None
    if args.json:
        print_json(result.to_dict() | {"masks": sorted(masks)}
                   | ({} if vendor is None else {"vendor": vendor.to_dict()}))
    else:
        _print(result, masks)
        if vendor is not None:
            from npuprep.cli.convert import _print_vendor

            _print_vendor(vendor.to_dict())
            print("vendor: PASSED" if vendor else "vendor: FAILED")
    return 0 if result and (vendor is None or vendor) else 1


def _vendor(args: argparse.Namespace, ref: Any, samples: Any, profile: Any,
            scales: dict[str, float] | None) -> Any:
    """CAND built and run by the vendor toolchain; outputs the convert report scales on the
    host (its `host_scales`) are multiplied back first."""
    from npuprep.model_io import load_model
    from npuprep.profiles import load_profile
    from npuprep.verify.vendor import vendor_check, with_layers

    cand = load_model(args.cand)
    host = _read_host_scales(args.scales) if args.scales else {}
    check = vendor_check(ref.proto, cand.proto, list(samples), vendor=args.with_vendor,
                         python=args.vendor_python, host_scales=host,
                         rtol=1e-2 if args.rtol is None else args.rtol)
    target = profile.resolve() if profile else load_profile("rk3588").resolve()
    return with_layers(check, cand, target, f"{args.cand} (accuracy_analysis)")


def _read_host_scales(path: str) -> dict[str, float]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return {str(k): float(v) for k, v in (data.get("host_scales") or {}).items()}


def _parse_tols(items: list[str]) -> dict[str, tuple[float, float]]:
    """`NAME:RTOL[:ATOL]` -> {name: (rtol, atol)}; names may themselves contain ':'."""
    from npuprep.errors import NpuprepError
    from npuprep.verify.compare import DEFAULT_ATOL

    out: dict[str, tuple[float, float]] = {}
    for item in items:
        parts = item.split(":")
        numbers: list[float] = []
        while len(parts) > 1 and len(numbers) < 2 and _is_number(parts[-1]):
            numbers.insert(0, float(parts.pop()))
        name = ":".join(parts)
        if not numbers or not name:
            raise NpuprepError(f"--tol {item}: expected NAME:RTOL[:ATOL] with numbers")
        if not all(math.isfinite(n) and n >= 0 for n in numbers) or numbers[0] == 0:
            raise NpuprepError(f"--tol {item}: RTOL must be a finite number > 0 and ATOL >= 0")
        out[name] = (numbers[0], numbers[1] if len(numbers) == 2 else DEFAULT_ATOL)
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def conversion_gate(ref: Model, cand: onnx.ModelProto, args: argparse.Namespace,
                    samples: SampleSet) -> tuple[OutputGate | None, tuple[str, ...]]:
    """When CAND is a conversion of REF that records its gate: judge it as convert did, by
    the graph outputs at the record's rtol/atol (--rtol/--atol still override), and a note
    when --data holds samples the conversion calibrated and planned on (its gate was met on
    others); (None, ()) for two unrelated models, which keep compare's own verdict."""
    from npuprep.holdout import seen_by_stats
    from npuprep.provenance import read_conversion
    from npuprep.verify.compare import OutputGate

    record = read_conversion(cand)
    if record is None or record.source.fingerprint != ref.fingerprint:
        return None, ()
    seen = sorted(seen_by_stats(record.calibration_source, record.calibration_ids, samples))
    notes = (f"{len(seen)} of these samples ({', '.join(seen[:3])}{' ...' if len(seen) > 3 else ''}) "
             "are ones the conversion calibrated and planned on; give the held-out ones "
             f"({', '.join(record.holdout_ids[:3]) or 'none recorded'}) to see what convert's gate "
             "saw",) if seen else ()
    outputs = tuple(o.name for o in ref.proto.graph.output)
    return OutputGate(outputs, record.gates.rtol if args.rtol is None else args.rtol,
                      record.gates.atol if args.atol is None else args.atol,
                      f"the conversion's record ({record.target}, {record.precision}: convert "
                      f"{'passed' if record.passed else 'FAILED'})",
                      top_k=dict(record.gates.top_k), host_scales=dict(record.host_scales)), notes


def goal_gate(ref: Model, args: argparse.Namespace, samples: SampleSet, gate: OutputGate | None,
              fmt_: NumberFormat | None) -> tuple[OutputGate | None, tuple[str, ...]]:
    """--metric/--top-k: the graph outputs judged by the rule convert's goal stage would choose
    (over a record's rule, whose rtol/atol stay), each output's rule said in a note."""
    if args.metric is None and not args.top_k and not args.detect:
        return gate, ()
    from npuprep.pipeline.stages import checked_top_k
    from npuprep.verify.compare import DEFAULT_ATOL, OutputGate, default_rtol
    from npuprep.verify.output_check import GOAL_SAMPLES, judged_outputs

    asked = checked_top_k(ref, parse_decisions(args.top_k, args.detect))
    first = list(samples.iter_range(0, min(GOAL_SAMPLES, len(samples))))
    top_k, judged = judged_outputs(ref.proto, first, args.metric or "auto", asked,
                                   source=ref.path)
    said = "; ".join(f"{name} by {rule}" for name, rule in sorted(judged.items()))
    if gate is not None:
        return replace(gate, top_k=top_k), (f"outputs judged as asked, not by the record's rule: "
                                            f"{said}",)
    rtol = args.rtol if args.rtol is not None else default_rtol(fmt_)
    outputs = tuple(o.name for o in ref.proto.graph.output)
    rule = (f"--metric {args.metric}" if args.metric else
            "--top-k" if not args.detect else "--detect" if not args.top_k else "--top-k/--detect")
    return (OutputGate(outputs, rtol, DEFAULT_ATOL if args.atol is None else args.atol, rule,
                       top_k=top_k),
            (f"outputs judged by {rule}: {said}; internal tensors are where to look",))


def _gate_said(gate: OutputGate, output: str) -> str:
    from npuprep.verify.output_errors import rule_said

    rule = gate.top_k.get(output)
    return (f"rel L2 {gate.rtol:g}" if rule is None else
            f"{rule_said(rule)} held, or rel L2 {gate.rtol:g}")


def _as_verified(ref: Model, cand: onnx.ModelProto, profile: TargetProfile | None
                 ) -> tuple[onnx.ModelProto, NumberFormat, str] | None:
    """An 8-bit conversion of REF as convert verified it (npuprep.verify.qdq_model.on_target):
    its Q/DQ pairs and recorded FP32 pins exact, every other tensor rounded to the target's
    wider format, overflowing as the target does there; None for any other candidate. The
    profile is --target's, else the record's built-in target."""
    from npuprep.numerics import eight_bit_format
    from npuprep.profile_names import builtin_names
    from npuprep.profiles import load_profile
    from npuprep.provenance import read_conversion
    from npuprep.verify.qdq_model import on_target

    record = read_conversion(cand)
    if (record is None or record.source.fingerprint != ref.fingerprint
            or eight_bit_format(record.precision) is None):
        return None
    if profile is None and record.target not in builtin_names():
        return None
    wide = (profile or load_profile(record.target)).resolve("fp16")
    said = (f"the candidate is an {record.precision} conversion: compared as convert verified it, "
            f"its Q/DQ pairs and {len(record.pinned_nodes)} FP32 pin(s) exact and every other "
            f"tensor rounded to {wide.fmt.name} (overflow "
            f"{'saturates' if wide.saturate else 'gives Inf/NaN'}, {wide.profile.name})")
    return on_target(cand, wide.fmt, record.pinned_nodes, saturate=wide.saturate), wide.fmt, said


def _recorded_scales(ref: Any, cand: Any) -> tuple[dict[str, float] | None, tuple[str, ...]]:
    """A conversion of REF records its tensor scales in its metadata: compare reads them, so a
    rescaled tensor is no error (the step after convert needs no --scales)."""
    from npuprep.provenance import read_source

    source = read_source(cand)
    if source is None or source.fingerprint != ref.fingerprint or not source.tensor_scales:
        return None, ()
    return dict(source.tensor_scales), (
        f"the candidate is a conversion of the reference: its {len(source.tensor_scales)} rescaled "
        "tensors are compared divided by their recorded power-of-two scales",)


def _recorded_channel_scales(ref: Model, cand: onnx.ModelProto
                             ) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """An 8-bit conversion of REF records the tensors it rescaled per channel on purpose
    (equalised, balanced) and their factors: compare undoes them, so none reads as an error."""
    from npuprep.provenance import read_source

    source = read_source(cand)
    if source is None or source.fingerprint != ref.fingerprint or not source.channel_scales:
        return {}, ()
    return dict(source.channel_scales), (
        f"the candidate is a conversion of the reference: its {len(source.channel_scales)} "
        "tensors rescaled per channel (equalised, balanced) are compared divided by their "
        "recorded factors",)


def _read_scales(path: str) -> dict[str, float]:
    from npuprep.errors import NpuprepError

    p = Path(path)
    data = json_io.read_json(p, "convert report")
    if not isinstance(data, dict) or "tensor_scales" not in data:
        raise NpuprepError(f"{p}: key 'tensor_scales' is missing (expected a convert report)")
    scales = data["tensor_scales"]
    if not isinstance(scales, dict):
        raise NpuprepError(f"{p}: key 'tensor_scales': expected a mapping tensor -> scale")
    for k, v in scales.items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise NpuprepError(f"{p}: key 'tensor_scales.{k}': expected a number, got {v!r}")
    return {str(k): float(v) for k, v in scales.items()}


class _Progress:
    """Re-iterable samples with a progress bar (compare may pass over them twice)."""

    def __init__(self, samples: Any, enabled: bool) -> None:
        self.samples = samples
        self.enabled = enabled

    def __iter__(self) -> Iterator[Any]:
        return progress(self.samples, len(self.samples), "comparing", self.enabled)

    def describe(self) -> str:
        return self.samples.describe()


def _node_labels(model: Any) -> set[str]:
    from npuprep.graph import node_label, walk_graphs

    return {node_label(n) for s in walk_graphs(model.graph) for n in s.graph.node}


def _stored_format(model: Any) -> Any:
    """The low-precision float format a model stores tensors in, if any."""
    from npuprep.graph import infer_tensors
    from npuprep.numerics import FLOAT_ONNX_TYPES, get_format

    names = {FLOAT_ONNX_TYPES[t] for t in infer_tensors(model).types.values() if t in FLOAT_ONNX_TYPES}
    for name in ("fp8_e4m3", "fp8_e5m2", "fp16", "bf16"):
        if name in names:
            return get_format(name)
    return None


def _columns(isolate: bool, full: bool = True) -> list[str]:
    if not full:
        return ["tensor", "op", "max abs err", "rel L2", *(["own rel L2"] if isolate else []), "cosine",
                "|cand| max", "Inf/NaN", "verdict"]
    cols = ["tensor", "node", "op", "max abs err", "rel L2", "cosine", "|cand| max", "headroom",
            "Inf/NaN", "saturated"]
    if isolate:
        cols += ["own max abs", "own rel L2"]
    return cols + ["verdict"]


def mask_rows(ref: Any, result: Any) -> frozenset[str]:
    """Passing tensors whose reference is non-finite because a mask constant (-inf, or FP32's
    lowest) reaches them: intentional masks, labelled `ok:mask`, never a failure."""
    from npuprep.analyse.measured import downstream_of_mask_constants

    bad = {t.tensor for t in result.tensors if t and t.ref_nonfinite_count}
    return frozenset(bad & downstream_of_mask_constants(ref)) if bad else frozenset()


def _row(t: Any, isolate: bool, full: bool = True, masks: frozenset[str] = frozenset(),
         gate: OutputGate | None = None) -> list[Any]:
    code = verdict_code(t, masks)
    if gate is not None and not t and t.tensor not in gate.outputs:
        # Judged by a conversion's outputs: an internal tensor over the thresholds is a lead.
        code = code.replace("FAIL:", "look:")
    if not full:
        return [t.tensor, t.op_type, t.max_abs_error, t.rel_l2, *([t.isolated_rel_l2] if isolate else []),
                t.cosine, t.cand_absmax, f"{t.inf_count}/{t.nan_count}", code]
    row = [t.tensor, t.node, t.op_type, t.max_abs_error, t.rel_l2, t.cosine, t.cand_absmax,
           "-" if t.headroom is None else t.headroom, f"{t.inf_count}/{t.nan_count}",
           t.saturated_count]
    if isolate:
        row += [t.isolated_max_abs_error, t.isolated_rel_l2]
    return row + [code]


def verdict_code(t: Any, masks: frozenset[str] = frozenset()) -> str:
    """`ok`, or why a row with large numbers is still ok (`ok:<atol`, `ok:mask`, `ok:ref-nan`),
    or `FAIL:code`."""
    if t:
        if "reference holds non-finite" in t.reason:
            return "ok:mask" if t.tensor in masks else "ok:ref-nan"
        if not t.rel_l2 <= t.rtol:
            return "ok:<atol"
        return "ok"
    if "element counts" in t.reason:
        return "FAIL:shape"
    if "Inf" in t.reason:
        return "FAIL:inf/nan"
    if t.saturated_count:
        return "FAIL:saturated"
    return "FAIL:rtol+atol"


def _print(result: Any, masks: frozenset[str] = frozenset()) -> None:
    from npuprep.report.output_verdicts import agreement_said, decision_said

    full = out().verbose or out().width is None
    say(f"{len(result.tensors)} tensors compared on {result.samples_description}; "
        f"format {result.fmt or 'none'}; rtol {result.rtol:g}, atol {result.atol:g}")
    print_table(f"Worst {len(result.worst)} tensors", _columns(result.isolate, full),
                [_row(t, result.isolate, full, masks, result.gate) for t in result.worst])
    codes = {verdict_code(t, masks) for t in result.worst if t}
    if not full and codes - {"ok"}:
        say("; ".join(text for code, text in (
            ("ok:<atol", "ok:<atol = rel L2 over rtol but every error under atol"),
            ("ok:mask", "ok:mask = an intentional -inf mask (from a mask constant), kept as a mask"),
            ("ok:ref-nan", "ok:ref-nan = the reference itself is non-finite")) if code in codes))
    first = result.first_divergent
    if first is not None:
        # Judged by a conversion's outputs, a divergent internal tensor is where to look.
        label = "where to look, first divergent node" if result else "first divergent node"
        say(f"{label}: {first.node} ({first.op_type}) -> tensor '{first.tensor}': {first.reason}")
        if result.isolate and first.isolated_rel_l2 is not None:
            say(f"  own error with reference inputs: rel L2 {fmt(first.isolated_rel_l2)}, "
                f"max abs {fmt(first.isolated_max_abs_error)}")
    for name, errors in sorted(result.output_errors.items()):
        agree = errors.get("top_k_agreement")
        decisions = (f", {agreement_said(errors)}" if "detect" in errors else
                     f", {decision_said(errors)} agreement {agree:.0%}" if agree is not None else "")
        say(f"output {name}: rel L2 {fmt(errors['rel_l2'])}, {errors['nonfinite']} Inf/NaN"
            + decisions + f" (gate: {_gate_said(result.gate, name)})")
    if result.unobserved:
        say(f"{len(result.unobserved)} tensors not compared (inside subgraphs or not shared); "
            "see --json")
    for note in result.notes:
        say(f"note: {note}")
    say(verdict_line(result), always=True)


def verdict_line(result: CompareResult) -> str:
    """PASSED or FAILED and what it rests on: every tensor, or a conversion's outputs (then
    the internal tensors over the thresholds are where to look)."""
    failed = sum(1 for t in result.tensors if not t)
    verdict = "PASSED" if result else "FAILED"
    if result.gate is None:
        return f"{verdict}: {failed} of {len(result.tensors)} tensors cross the thresholds"
    outputs = len(result.failing_outputs)
    inside = sum(1 for t in result.tensors if not t and t.tensor not in result.gate.outputs)
    return (f"{verdict}: {outputs} of {len(result.gate.outputs)} outputs fail the gate of "
            f"{result.gate.source}" + (f"; {inside} internal tensors cross the thresholds "
                                       "(where to look, not failures)" if inside else ""))


def render_markdown(result: Any, args: argparse.Namespace, masks: frozenset[str] = frozenset()) -> str:
    """The compare result as a Markdown report."""

    def cell(v: Any) -> str:
        return fmt(v) if isinstance(v, float | int) else md_cell(v)

    lines = [
        "# npuprep compare",
        "",
        f"- reference: {md_code(args.ref)} (fingerprint `{result.fingerprint}`)",
        f"- candidate: {'emulation on ' + md_code(args.target) if args.emulate else md_code(args.cand)}"
        f" (fingerprint `{result.candidate_fingerprint}`)",
        f"- samples: {md_text(result.samples_description)}",
        f"- format: {result.fmt or 'none'}; thresholds: rel L2 > {result.rtol:g} and max abs error > "
        f"{result.atol:g}" + (f"; {len(result.overrides)} per-tensor overrides" if result.overrides else ""),
        f"- verdict: **{md_text(verdict_line(result))}**",
        "",
    ]
    first = result.first_divergent
    lines += ["## First divergent node", ""]
    if first is None:
        lines += ["None: every compared tensor is within its thresholds.", ""]
    else:
        lines += [f"{md_code(first.node)} ({md_text(first.op_type)}) writes {md_code(first.tensor)}: "
                  f"{md_text(first.reason)}.", ""]
    header = _columns(result.isolate)
    for title, rows in (("Worst tensors", result.worst), ("All tensors (topological order)", result.tensors)):
        lines += [f"## {title}", "", "| " + " | ".join(cell(h) for h in header) + " |",
                  "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cell(v) for v in _row(t, result.isolate, masks=masks,
                                                          gate=result.gate)) + " |"
                  for t in rows]
        lines.append("")
    if result.unobserved:
        lines += ["## Not compared", ""]
        lines += [f"- {md_code(k)}: {md_text(v)}" for k, v in sorted(result.unobserved.items())]
        lines.append("")
    if result.notes:
        lines += ["## Notes", ""] + [f"- {md_text(n)}" for n in result.notes] + [""]
    return "\n".join(lines)
