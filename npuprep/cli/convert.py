"""`npuprep convert MODEL --target T --data D -o OUT.onnx`: plan, rewrite, lower, verify, report."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from npuprep.cli.common import add_data, add_jobs, add_json, add_target

help = "plan, rewrite and lower MODEL for the target, verify it under emulation, write reports"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?",
                   help="ONNX model (default: the bundled example planner and its samples)")
    add_target(p)
    add_data(p)
    p.add_argument("--stats", help="calibration statistics from `npuprep calibrate` (skips calibrating)")
    add_jobs(p)
    p.add_argument("--plan", help="apply this plan (YAML, edited or not) instead of planning")
    p.add_argument("--plan-only", action="store_true",
                   help="write the plan to -o (YAML) and stop; the model is not touched")
    p.add_argument("-o", "--output", help="output path (default: <model>.<target>.onnx here)")
    p.add_argument("--precision", help="compute format to target (default: the profile's)")
    p.add_argument("--io-types", choices=("fp32", "target"), default="fp32",
                   help="keep graph inputs/outputs FP32 (default) or give them the target type")
    p.add_argument("--opset", type=int,
                   help="write the converted model at this default-domain opset "
                        "(default: the model's own; some compilers need 11 or 12)")
    p.add_argument("--holdout", help="samples not used for calibration, to verify on")
    p.add_argument("--rtol", type=float, default=1e-2,
                   help="largest relative L2 error of each output (default 1e-2)")
    p.add_argument("--max-rounds", type=int, default=3,
                   help="verification rounds; each pins the first divergent node (default 3)")
    p.add_argument("--report-json", dest="report", metavar="OUT.json",
                   help="JSON report path (default: <output>.report.json)")
    # `--report` names an input (crosscheck's compiler report); the old output spelling still works.
    p.add_argument("--report", dest="report", help=argparse.SUPPRESS)
    p.add_argument("--html", help="also write a self-contained HTML report here")
    p.add_argument("--export", metavar="LIST",
                   help="constraint files to write: trt, horizon, rknn, yaml (comma-separated) or none "
                        "(default: the target compiler's own)")
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from npuprep.cli.common import open_samples, print_json
    from npuprep.data import load_samples
    from npuprep.errors import NpuprepError
    from npuprep.model_io import load_model
    from npuprep.profiles import load_profile
    from npuprep.report.artefacts import parse_exports

    profile = load_profile(args.target)
    exports = parse_exports(args.export) if args.export else None
    if args.model is None:
        from npuprep.examples import example_data_dir, example_model_path

        args.model = str(example_model_path())
        if not (args.data or args.synthetic or args.stats):
            args.data = str(example_data_dir())
    model = load_model(args.model)
    stem = Path(args.model).stem
    # Not `<stem>.<target>.plan.yaml`: convert writes the plan it applied there, over a draft.
    default_ext = ".draft.plan.yaml" if args.plan_only else ".onnx"
    output = Path(args.output or f"{stem}.{profile.name}{default_ext}")
    if output.exists() and output.resolve() == Path(args.model).resolve():
        raise NpuprepError(f"{output}: refusing to overwrite the input model; choose another -o")
    if args.plan and args.plan_only:
        raise NpuprepError("--plan and --plan-only together: the plan already exists")

    samples = open_samples(args, model.proto)
    stats = _stats(args, model, samples)
    if args.plan_only:
        return _plan_only(args, model, profile, stats, output)
    if samples is None:
        raise NpuprepError("convert verifies on samples: give --data D or --synthetic N")

    from npuprep.convert import convert
    from npuprep.plan import load_plan

    plan = load_plan(args.plan, model) if args.plan else None
    holdout = load_samples(args.holdout, model.proto, batched=args.batched) if args.holdout else None
    from npuprep.cli.common import progress_stages

    with progress_stages("converting", not args.json) as stage:
        result = convert(
            model, profile, list(samples), stats=stats, plan=plan, precision=args.precision,
            io_types=args.io_types, rtol=args.rtol, holdout=list(holdout) if holdout else None,
            samples_description=samples.describe(), synthetic=samples.synthetic,
            max_rounds=max(1, args.max_rounds), opset=args.opset, progress=stage,
        )
    report = result.save(output, exports=exports, report_path=args.report, html=args.html,
                         protected=(args.model,))
    if args.json:
        print_json(report)
    else:
        _print_summary(report)
    return 0 if result.passed else 1


def _stats(args: argparse.Namespace, model: Any, samples: Any) -> Any:
    from npuprep.calibrate import calibrate, load_stats

    if args.stats:
        return load_stats(args.stats, model)
    if samples is None:
        return None
    return calibrate(model, samples, jobs=args.jobs, streams=args.streams, show_progress=not args.json)


def _plan_only(args: argparse.Namespace, model: Any, profile: Any, stats: Any, output: Path) -> int:
    from npuprep.analyse import static_findings
    from npuprep.analyse.measured import measured_findings
    from npuprep.cli.common import print_json
    from npuprep.plan import save_plan
    from npuprep.plan.planner import make_plan

    findings = static_findings(model, profile)
    if stats is not None:
        findings = findings.merged(measured_findings(model, profile, stats, args.precision))
    plan = make_plan(model, profile, stats, findings, precision=args.precision)
    save_plan(plan, output)
    if args.json:
        print_json(plan.to_dict() | {"written": str(output)})
    else:
        from npuprep.cli.common import print_table, say

        rows = [(i, a.action, _where(a), _reason_code(a.to_dict())) for i, a in enumerate(plan.actions, 1)]
        print_table(f"Plan ({len(plan.actions)} actions; why: in the YAML)", ["#", "action", "where", "reason"],
                    rows, cut_end=("reason",))
        say(f"plan: {len(plan.actions)} actions, {len(plan.declined)} declined -> {output}", always=True)
    return 0


def _where(action: Any) -> str:
    from npuprep.report.render_md import action_target

    return action_target(action.to_dict())


def _print_summary(report: dict[str, Any]) -> None:
    from npuprep.cli.common import out, print_table, say
    from npuprep.report.render_md import action_target
    from npuprep.report.terminal import capped, number, percent

    say(f"npuprep convert: {report['model']} -> {report['output']} "
        f"(target {report['target']}, {report['precision']})")
    if report["samples"]["synthetic"]:
        say("samples are synthetic: the ranges are not those of real data")
    if report["actions"]:
        full = out().verbose or out().width is None
        rows = [(i, a["action"], action_target(a), _reason_code(a), *([a.get("why", "")] if full else []))
                for i, a in enumerate(report["actions"], 1)]
        shown, left = capped(rows, 20, out().show_all)
        print_table(f"Actions ({len(rows)}; why: -v or the report)" if not full else "Actions",
                    ["#", "action", "where", "reason", *(["why"] if full else [])], shown,
                    cut_end=("reason", "why"))
        if left:
            say(f"... and {left} more actions (--show-all)")
    ver = report.get("verification") or {}
    print_table("Outputs under emulated target numerics", ["output", "Inf/NaN", "max abs err", "rel L2"],
                [(k, o["nonfinite"], number(o["max_abs_error"]), number(o["rel_l2"]))
                 for k, o in (ver.get("outputs") or {}).items()])
    say(f"FP32 FLOPs share {percent(report['flops_fp32_share'])}, "
        f"{report['cast_count']} Casts, {len(report['pinned_nodes'])} pinned nodes, "
        f"{len(report['declined'])} declined remedies")
    for note in report.get("notes", []):
        say(f"note: {note}")
    first = report.get("first_divergent")
    verdict = "PASSED" if report["passed"] else (
        f"FAILED: first divergent node '{first['node']}' ({first['op_type']})" if first else "FAILED")
    say(f"{verdict}; report: {report['artefacts']['report_md']}", always=True)


def _reason_code(action: dict[str, Any]) -> str:
    """The rules behind an action, as codes (`range.overflow`); the sentence is in the report."""
    rules = list(dict.fromkeys(f.get("rule", "") for f in action.get("findings", []) if f.get("rule")))
    if rules:
        return ",".join(rules)
    return "request" if action.get("request") else "verify"
