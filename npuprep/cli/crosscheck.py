"""`npuprep crosscheck MODEL --report R --target T`: the compiler's precision choices vs ours."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from npuprep.cli.common import add_json, add_target
from npuprep.errors import NpuprepError

if TYPE_CHECKING:
    from npuprep.analyse.finding import Findings
    from npuprep.calibrate.stats import RangeStats
    from npuprep.crosscheck.check import Crosscheck
    from npuprep.crosscheck.names import NodeIndex
    from npuprep.crosscheck.plan_view import PlanDecision
    from npuprep.crosscheck.record import CompilerReport
    from npuprep.model_io import Model
    from npuprep.output_files import OutputPlan
    from npuprep.profiles import ResolvedTarget

help = "check a compiler's per-layer precision report against the nodes npuprep found sensitive"

FORMAT_CHOICES = ("auto", "trt_json", "generic", "horizon", "rknn", "openvino")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the ONNX model the compiler was given")
    p.add_argument("--report", "-r",
                   help="the compiler's report: TensorRT --exportLayerInfo JSON, CSV/JSON "
                        "node,precision, hb_mapper log, RKNN error_analysis.txt, or OpenVINO's "
                        "runtime report (convert --verify-with openvino writes one)")
    p.add_argument("--vendor", choices=("openvino",),
                   help="instead of --report: compile MODEL with this toolchain (openvino: its "
                        "CPU plugin, the target format as INFERENCE_PRECISION_HINT) and read "
                        "its own per-layer precisions")
    p.add_argument("--save-report", metavar="OUT.json",
                   help="with --vendor: also write the report it produced")
    add_target(p)
    # --format (still read, hidden) is a number format elsewhere: one flag, one meaning.
    p.add_argument("--format", dest="report_format", choices=FORMAT_CHOICES, default="auto",
                   help=argparse.SUPPRESS)
    p.add_argument("--report-format", choices=FORMAT_CHOICES, default="auto",
                   help="report format (default: detect from the content)")
    p.add_argument("--stats", "-s",
                   help="calibration stats JSON (of this model, or of the model it was converted "
                        "from): nodes whose measured range needs more than the target's format")
    p.add_argument("--plan", "-p",
                   help="the conversion's plan.yaml or .precision.yaml: its FP32 pins must be FP32 "
                        "in the report; nodes it made safe are no mismatch")
    add_json(p)
    p.add_argument("--report-md", metavar="OUT.md", help="also write the verdicts as Markdown")


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from npuprep.analyse import static_findings
    from npuprep.cli.common import begin, out, print_json, print_table, say
    from npuprep.crosscheck.check import crosscheck
    from npuprep.crosscheck.names import NodeIndex
    from npuprep.crosscheck.plan_view import read_decision, recorded_decision
    from npuprep.crosscheck.readers import read_report
    from npuprep.crosscheck.render import COLUMNS, SHORT_COLUMNS, row, short_row, to_markdown
    from npuprep.provenance import read_conversion

    if (args.report is None) == (args.vendor is None):
        raise NpuprepError("crosscheck: give --report R (the compiler's report) or --vendor "
                           "openvino (npuprep compiles MODEL and reads OpenVINO's own), not both")
    if args.save_report and not args.vendor:
        raise NpuprepError("--save-report writes the report --vendor produces; give --vendor")
    run_ = begin(args, inputs=("report", "stats", "plan"))
    profile, model, outputs = run_.profile, run_.model, run_.outputs
    for path, what in ((args.report_md, "--report-md"), (args.save_report, "--save-report")):
        if path:
            outputs.writes(path, what)
    outputs.check()
    index = NodeIndex(model)
    if args.vendor:
        report = _vendor_report(args, model, run_.target, index, outputs)
    else:
        report = read_report(args.report, index, args.report_format)
    findings = static_findings(model, run_.target)
    decision = read_decision(args.plan, model, index) if args.plan else None
    if args.stats:
        from npuprep.analyse.measured import measured_findings
        from npuprep.calibrate import load_stats

        stats = load_stats(args.stats, model)
        findings = findings.merged(measured_findings(model, run_.target, stats))
        if stats.mapping_note:
            report = replace(report, notes=(*report.notes, stats.mapping_note))
    record = read_conversion(model.proto)
    if decision is None and record is not None:
        # A conversion carries its applied plan: convert's decisions decide, as with --plan.
        decision = recorded_decision(record, model, index)
    if decision is None and args.stats:
        decision = planner_decision(model, run_.target, stats, findings, index)
    if decision is None:
        report = replace(report, notes=(*report.notes, *_plan_hint(model)))
    result = crosscheck(model, report, run_.target, findings=findings, index=index, decision=decision)
    if args.report_md:
        with outputs.open() as files:
            files.text(args.report_md, to_markdown(result))
    if args.json:
        print_json(result.to_dict())
    else:
        counts = ", ".join(f"{k} {n}" for k, n in result.counts.items() if n)
        listed = [v for v in result.verdicts if out().show_all or v.verdict not in COUNTED]
        full = out().verbose or out().width is None
        title = f"Crosscheck of {report.path} ({report.format}) for {profile.name}: {counts}"
        if listed:
            print_table(title, COLUMNS if full else SHORT_COLUMNS,
                        [row(v) if full else short_row(v) for v in listed])
        else:
            say(title)
        left = {k: n for k, n in result.counts.items() if k in COUNTED and n and not out().show_all}
        if left:
            say("not listed: " + ", ".join(f"{n} {k}" for k, n in left.items())
                + " (--show-all lists them; the reasons are in --json and --report-md)")
        for note in result.notes:
            say(f"note: {note}")
        say(failure_line(result), always=True)
    return 0 if result else 1


def _vendor_report(args: argparse.Namespace, model: Model, target: ResolvedTarget,
                   index: NodeIndex, outputs: OutputPlan) -> CompilerReport:
    """OpenVINO's runtime report of MODEL compiled for the target's format (saved when asked)."""
    from npuprep import json_io
    from npuprep.crosscheck.openvino import read_openvino
    from npuprep.vendors.openvino import report_of

    made = report_of(model.proto, target.fmt.name, default=target.weights.name)
    if args.save_report:
        with outputs.open() as files:
            files.text(args.save_report, json_io.dump_json(made))
    return read_openvino(args.save_report or f"openvino's runtime model of {model.path}", made, index)


# Verdicts counted, not listed, unless --show-all: a report names hundreds of layers, most of them fine.
COUNTED = ("ok", "missing", "unmapped")


def failure_line(result: Crosscheck) -> str:
    """PASSED, or FAILED naming the non-finite layers first, then what else failed."""
    if result:
        return "PASSED"
    bad = list(dict.fromkeys(layer for v in result.of("non-finite") for layer in v.layers))
    parts = []
    if bad:
        shown = ", ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
        parts.append(f"non-finite in the compiler's run: {shown}")
    if result.of("mismatch") or result.of("pin-ignored"):
        parts.append("a sensitive or pinned node runs in a lower precision")
    return "FAILED: " + "; ".join(parts)


def planner_decision(model: Model, target: ResolvedTarget, stats: RangeStats | None,
                     findings: Findings, index: NodeIndex) -> PlanDecision | None:
    """Without --plan, the planner's own decision on these stats (what check and convert
    would do: npuprep.plan.decide), so a node they call safe is no mismatch here; None for a
    conversion without its record, whose decisions are in its plan files."""
    from npuprep.crosscheck.plan_view import decision_of
    from npuprep.plan.decide import plan_for
    from npuprep.provenance import find_source

    if find_source(model) is not None:
        return None
    planned = plan_for(model, target, stats, findings=findings)
    # The compiler was given this model, not the rewritten one: a rescale or a shift the plan
    # would make is not in it, so only its pins and its measured verdicts count.
    return decision_of(planned.plan, index, "the planner's plan on these stats (check's and "
                       "convert's; no --plan given)", kind="planner", rewritten=False)


def _plan_hint(model: Model) -> tuple[str, ...]:
    """For a conversion checked without --plan: where its decisions are."""
    from npuprep.provenance import find_source

    if find_source(model) is None:
        return ()
    beside = Path(model.path).with_suffix(".precision.yaml") if model.path else None
    where = str(beside) if beside is not None and beside.is_file() else "its .precision.yaml"
    return (f"{model.path} is an npuprep conversion: --plan {where} lets its plan decide which "
            "nodes need FP32",)
