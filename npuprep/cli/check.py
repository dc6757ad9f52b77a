"""`npuprep check MODEL --target T`: findings without rewriting; exit 1 when one reaches --fail-on."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from npuprep.cli.common import (
    add_data,
    add_json,
    add_target,
    fmt,
    out,
    print_json,
    print_table,
    say,
    scale_rule,
)
from npuprep.names import shown
from npuprep.scale_rules import DEFAULT_RULE, ScaleRule

if TYPE_CHECKING:
    from npuprep.analyse.finding import Findings
    from npuprep.calibrate.stats import RangeStats
    from npuprep.model_io import Model
    from npuprep.plan.decide import Planned
    from npuprep.plan.plan import Plan
    from npuprep.profiles import ResolvedTarget, Severity

help = "report where MODEL will leave the target's range (static rules; no rewrite)"

SCHEMA_VERSION = 1
_EVIDENCE_ITEMS = 5
_NODES_SHOWN = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?",
                   help="ONNX model to check (default: the bundled example planner)")
    add_target(p)
    add_json(p)
    p.add_argument("--fail-on", choices=("info", "warning", "error"), default="error",
                   help="exit 1 when a finding reaches this severity (default: error)")
    add_data(p)
    p.add_argument("--stats", "-s", help="measured ranges from `npuprep calibrate` (instead of --data)")
    p.add_argument("--precision", help="check measured ranges against this format (e.g. fp8_e4m3) "
                                       "instead of the target's default precision")
    p.add_argument("--scale-rule", type=scale_rule, choices=tuple(ScaleRule), default=DEFAULT_RULE,
                   help="8-bit only: the scale rule convert is given (default percentile); "
                        "range.scale_clip shows its clip and, for INT8, the others convert weighs")
    p.add_argument("--html", metavar="OUT.html", help="also write a self-contained HTML report")
    p.add_argument("--vendor", choices=("rknn",),
                   help="also build MODEL with the vendor toolchain (rknn: rknn-toolkit2 for the "
                        "target's platform); when it refuses or crashes, bisect to the nodes "
                        "that break it and try their exact rewrite")
    p.add_argument("--vendor-python", metavar="PATH",
                   help="python of the vendor venv (default: $NPUPREP_RKNN_PYTHON, then "
                        "~/.cache/npuprep/rknn-venv)")


def _measured_stats(args: argparse.Namespace, model: Model, detail: str = "auto") -> RangeStats | None:
    """Stats from --stats, or calibrated on the fly from --data/--synthetic; None without either.
    `detail="all"` for 8-bit scales, as convert calibrates for them (percentile, MSE);
    "fp16" for an FP16 or BF16 target, exact for those formats only."""
    from npuprep.errors import NpuprepError

    if getattr(args, "stats", None):
        if getattr(args, "data", None) or getattr(args, "synthetic", None):
            raise NpuprepError("give either --stats or --data/--synthetic, not both")
        from npuprep.calibrate import load_stats

        return load_stats(args.stats, model)
    from npuprep.cli.common import open_samples

    samples = open_samples(args, model.proto)
    if samples is None:
        if getattr(args, "precision", None):
            raise NpuprepError("--precision checks measured ranges: give --data, --synthetic or --stats")
        return None
    from npuprep.calibrate import calibrate

    return calibrate(model, samples, show_progress=not getattr(args, "json", False) and sys.stderr.isatty(),
                     detail=detail)


def run(args: argparse.Namespace) -> int:
    from npuprep.cli.common import begin
    from npuprep.profiles import Severity

    fail_on = Severity.parse(args.fail_on)
    if args.model is None:
        from npuprep.examples import example_model_path

        args.model = str(example_model_path())
        print(f"npuprep: no MODEL given; checking the bundled example {args.model}", file=sys.stderr)
    # Before the target is resolved: INT8's findings run in FP16 (see _eight_bit).
    eight = _eight_bit(args)
    run_ = begin(args, inputs=("data", "stats"))
    profile, target, model, outputs = run_.profile, run_.target, run_.model, run_.outputs
    widened = ""
    if eight is not None:
        from dataclasses import replace

        from npuprep.fp16_source import eight_bit_source

        eight = replace(eight, activations=profile.int8_activations)

        model, widened = eight_bit_source(model)
    if args.html:
        outputs.writes(args.html, "--html")
    with outputs.open() as files:
        # As convert calibrates: every element for 8-bit, FP16/BF16's own scope for those.
        detail = "all" if eight is not None else "fp16" if target.fmt.name in ("fp16", "bf16") else "auto"
        stats = _measured_stats(args, model, detail)
        planned = plan_check(args, model, target, stats)
        model, findings, plan, rewrites = planned.model, planned.findings, planned.plan, planned.notes
        if eight is not None:
            from npuprep.analyse.scale_clip import scale_clip_findings
            from npuprep.plan.layer_precision import decide

            plan = replace(plan, precision=eight.name,
                           eight_bit=decide(model.proto, stats, eight, plan.pinned_nodes()))
            findings = findings.merged(scale_clip_findings(
                model.proto, stats, eight, [x.node for x in plan.eight_bit
                                            if x.precision == eight.name],
                args.scale_rule, saturate=bool(profile.fp8_saturate)))
        if args.html:
            from npuprep.cli.report import tensor_order
            from npuprep.report.render_html import render

            # The plan rides along: the chart marks exactly its actions, as convert would take them.
            page = check_report(model, target, findings, fail_on) | {
                "profile": profile.to_dict(), "plan": plan.to_dict()}
            if eight is not None:
                page["precision"] = eight.name  # the chart draws FP8's 448 line
            if stats is not None:
                page["stats"] = stats.to_dict()
            files.text(args.html, render(page, order=tensor_order(model.proto)))
    failing = findings.reaching(fail_on)
    vendor = _vendor_build(args, model) if args.vendor else None
    if args.json:
        doc = check_report(model, target, findings, fail_on) | {"plan": plan.to_dict()}
        if vendor is not None:
            doc["vendor"] = vendor
        if stats is not None:
            # The ranges behind the measured findings: `npuprep report` draws them, as --html does.
            doc["stats"] = stats.to_dict()
        print_json(doc)
    else:
        _print(model, target, findings, fail_on)
        if stats is not None and stats.mapping_note:
            say(f"note: {stats.mapping_note}")
        for note in (widened, *rewrites) if widened else rewrites:
            say(f"note: {note}")
        _print_plan(plan, measured=stats is not None, recorded=not planned.planned_here)
        if eight is not None:
            _print_eight_bit(plan)
        for line in (vendor or {}).get("lines", ()):
            say(line)
    return 1 if failing or (vendor is not None and not vendor["built"]) else 0


def _vendor_build(args: argparse.Namespace, model: Model) -> dict[str, Any]:
    """MODEL built by the vendor tool on one sample (--data's first, else a synthetic one);
    a refusal or crash bisected to its nodes (npuprep.verify.vendor_bisect)."""
    from npuprep.cli.common import open_samples, synthetic_from_args
    from npuprep.vendors.bisection import Attempt
    from npuprep.vendors.rockchip import run_rknn
    from npuprep.verify.vendor_bisect import bisect_vendor, rknn_build

    samples = open_samples(args, model.proto) or synthetic_from_args(args, model.proto, 1)
    feed = next(iter(samples))
    platform = "rk3588"  # the platform `convert --verify-with rknn` builds for
    # The whole model first, where a vendor python that is not one is the user's error (exit 2).
    done = run_rknn(model.proto, [dict(feed)], python=args.vendor_python, target_platform=platform)
    if done:
        return {"built": True, "lines": [f"rknn-toolkit2 builds the model for {platform}"]}
    found = bisect_vendor(model.proto, feed, Attempt(False, done.stage, done.refusal),
                          rknn_build(args.vendor_python, platform))
    return {"built": False, **found.to_dict()}


def _eight_bit(args: argparse.Namespace) -> Any:
    """The 8-bit format --precision names (None otherwise); the 8-bit decision comes on top
    of the findings. FP8 findings keep the 448 line (a value the compiler does not scale);
    INT8 has no float range, so its findings and plan run in FP16, as its wider layers do."""
    from npuprep.numerics import eight_bit_format

    eight = eight_bit_format(getattr(args, "precision", None) or "")
    if eight is not None and not eight.is_float:
        args.precision = "fp16"
    return eight


def _print_eight_bit(plan: Plan) -> None:
    layers = plan.eight_bit
    wider = [x for x in layers if x.precision != plan.precision]
    if wider:
        print_table(f"Kept wider than {plan.precision} (the plan's eight_bit list)",
                    ["node", "runs in", "why"], [(x.node, x.precision, x.why) for x in wider],
                    wrap=("why",))
    say(f"{plan.precision}: {len(layers) - len(wider)} Conv/MatMul/Gemm layer(s) in 8 bits, "
        f"{len(wider)} node(s) kept wider")


def plan_check(args: argparse.Namespace, model: Model, target: ResolvedTarget,
               stats: RangeStats | None) -> Planned:
    """The graph convert plans (fusions a compiler makes, no control flow where the target
    takes none), its findings, and what convert would do with them (npuprep.plan.decide:
    one story for check and convert; verification rounds may add pins to it). A conversion's
    own FP32 islands and stored formats are its decision, not findings against it, and the
    plan it records (npuprep.provenance) is the plan: each finding says what convert did."""
    from npuprep.cli.common import open_samples
    from npuprep.plan.decide import plan_for
    from npuprep.plan.plan import Plan
    from npuprep.provenance import RECORD_KEY, read_conversion

    record = read_conversion(model.proto)
    recorded = None if record is None else Plan.from_dict(
        record.plan, f"{model.path}: metadata {RECORD_KEY}: plan")
    samples = open_samples(args, model.proto) if stats is not None else None
    return plan_for(model, target, stats, list(samples) if samples is not None else None,
                    plan=recorded, as_stored=True)


def _print_plan(plan: Plan, *, measured: bool, recorded: bool = False) -> None:
    """What convert would do, or (`recorded`: a conversion's own record) what it did."""
    from npuprep.cli.convert import _reason_code, _where

    basis = "measured ranges" if measured else "static rules only (give --data for measured ranges)"
    if recorded:
        basis = "the conversion's record"
    if plan.actions:
        title = "What convert did" if recorded else "What convert would do"
        print_table(f"{title} ({basis}; why: --json or convert --plan-only)",
                    ["#", "action", "where", "reason"],
                    [(i, a.action, _where(a), _reason_code(a.to_dict()))
                     for i, a in enumerate(plan.actions, 1)], cut_end=("reason",))
    pinned = len(plan.pinned_nodes())
    said = "convert planned" if recorded else "convert would plan"
    more = "verification pins included" if recorded else "verification may pin more"
    say(f"{said} {len(plan.actions)} action(s), {pinned} node(s) pinned to FP32, "
        f"{len(plan.declined)} remedy(ies) declined ({basis}); {more}")


def check_report(model: Model, target: ResolvedTarget, findings: Findings,
                 fail_on: Severity) -> dict[str, Any]:
    """The `--json` object: schema version, kind, fingerprint, model, target, findings, summary;
    `format` is the resolved one (`--precision bf16` says bf16)."""
    profile = target.profile
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "check",
        "fingerprint": model.fingerprint,
        "model": model.path,
        "target": profile.name,
        "target_path": profile.path,
        "format": target.fmt.name,
        "opset": model.opset,
        "fail_on": str(fail_on),
        "passed": not findings.reaching(fail_on),
        "findings": findings.to_dict(),
        "summary": _summary(findings),
    }


def _summary(findings: Findings) -> dict[str, int]:
    from npuprep.profiles import Severity

    counts = {str(s): 0 for s in Severity}
    for f in findings:
        counts[str(f.severity)] += 1
    counts["total"] = len(findings)
    return counts


def _evidence_text(evidence: dict[str, Any]) -> str:
    parts = []
    for key, value in evidence.items():
        if key in ("format", "output", "tensors") or value is None or value == {}:
            continue
        if key == "members":
            parts.append(f"{len(value)} nodes: {value[0]}..{value[-1]}")
        elif key == "covers":
            parts.append("covers " + ", ".join(sorted({r for rules in value.values() for r in rules})))
        elif isinstance(value, list):
            parts.append(f"{key}={len(value)}")
        elif isinstance(value, bool | int | float):
            parts.append(f"{key}={fmt(value)}")
        if len(parts) == _EVIDENCE_ITEMS:
            break
    return "; ".join(parts)


def _rows(findings: Findings) -> list[tuple[str, ...]]:
    """Table rows, most severe first, each with its sentence and how-to last; findings that
    read the same (say, one per layer) and that the plan remedies alike share a row. The
    remedy column is what the plan did (`Finding.planned`), never a pin it did not make."""
    groups: dict[tuple[str, ...], list[Any]] = {}
    for f in findings:
        key = (f.rule, str(f.severity), f.op_type, f.scope, f.message, f.shown_remedy_text, f.shown_remedy)
        groups.setdefault(key, []).append(f)
    rows = []
    for members in sorted(groups.values(), key=lambda g: -int(g[0].severity)):
        f = members[0]
        nodes = ", ".join(m.node for m in members[:_NODES_SHOWN])
        if len(members) > _NODES_SHOWN:
            nodes += f" (+{len(members) - _NODES_SHOWN})"
        where = nodes if f.scope == "main" else f"{nodes} [{f.scope}]"
        message = f.message if len(members) == 1 else f"{len(members)}x: {f.message}"
        rows.append((str(f.severity), f.rule, where, f.op_type, _evidence_text(f.evidence),
                     f.shown_remedy, message, f.shown_remedy_text))
    return rows


def _print(model: Model, target: ResolvedTarget, findings: Findings, fail_on: Severity) -> None:
    profile = target.profile
    say(f"model  {shown(model.path)}  (opset {model.opset}, fingerprint {model.fingerprint})")
    say(f"target {shown(profile.name)}  ({target.fmt.name}, overflow {profile.overflow})")
    if len(findings):
        rows = _rows(findings)
        columns = ["severity", "rule", "node", "op", "evidence", "remedy"]
        # The sentences stay in --json and the reports; --wide shows them as columns, and -v
        # whole under the table (a column would cut them to the width).
        if out().width is None:
            print_table("Findings", [*columns, "finding", "how"], rows,
                        cut_end=("evidence", "finding", "how"))
        else:
            print_table("Findings" if out().verbose else "Findings (sentences: -v, --json or --html)",
                        columns, [r[:6] for r in rows], cut_end=("evidence",))
            if out().verbose:
                for i, r in enumerate(rows, 1):
                    say(f"{i}. {r[1]} ({r[2]}): {r[6]}" + (f"; {r[7]}" if r[7] else ""))
    s = _summary(findings)
    verdict = "FAILED" if findings.reaching(fail_on) else "PASSED"
    say(f"{s['total']} finding(s): {s['error']} error, {s['warning']} warning, {s['info']} info"
        f" -- {verdict} (--fail-on {fail_on})", always=True)
