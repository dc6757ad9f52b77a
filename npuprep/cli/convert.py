"""`npuprep convert MODEL --target T --data D -o OUT.onnx`: plan, rewrite, lower, verify, report."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from npuprep.cli.common import (
    add_data,
    add_goal,
    add_jobs,
    add_json,
    add_target,
    parse_decisions,
    positive_float,
    positive_int,
    scale_rule,
)
from npuprep.errors import NpuprepError
from npuprep.scale_rules import DEFAULT_RULE, ScaleRule

if TYPE_CHECKING:
    from npuprep.calibrate.stats import CalibrationStats
    from npuprep.data import SampleSet
    from npuprep.model_io import Model
    from npuprep.output_files import OutputSet
    from npuprep.plan import Plan
    from npuprep.profiles import TargetProfile
    from npuprep.resources import MemoryWatch

help = "plan, rewrite and lower MODEL for the target, verify it under emulation, write reports"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?",
                   help="ONNX model (default: the bundled example planner and its samples)")
    add_target(p)
    add_data(p)
    p.add_argument("--stats", "-s", help="calibration statistics from `npuprep calibrate` (skips calibrating)")
    add_jobs(p)
    p.add_argument("--plan", "-p", help="apply this plan (YAML, edited or not) instead of planning")
    p.add_argument("--plan-only", action="store_true",
                   help="write the plan to -o (YAML) and stop; the model is not touched")
    p.add_argument("-o", "--output", help="output path (default: <model>.<target>.onnx here)")
    p.add_argument("--precision", help="compute format to target (default: the profile's); int8 "
                   "or fp8_e4m3 write a QDQ model (Conv/MatMul/Gemm in 8 bits, the rest wider)")
    p.add_argument("--scale-rule", type=scale_rule, choices=tuple(ScaleRule), default=DEFAULT_RULE,
                   help="8-bit activation scales from the calibration statistics (default "
                        "percentile)")
    p.add_argument("--min-8bit-share", type=_percent, default=50.0, metavar="PERCENT",
                   help="8-bit only: keep sensitive layers wider only while at least this share "
                        "of the Conv/MatMul/Gemm multiply-adds stays 8-bit; fail below it "
                        "(default 50%%)")
    p.add_argument("--search", choices=("auto", "always"),
                   help="8-bit only: auto (default) keeps the plain start (every layer 8-bit at "
                        "the default scale rule, weights rounded to nearest) where it errs under "
                        "half the gate; always balances, rounds and searches anyway (more margin, "
                        "minutes more)")
    p.add_argument("--io-types", choices=("fp32", "target"), default="fp32",
                   help="keep graph inputs/outputs FP32 (default) or give them the target type")
    p.add_argument("--opset", type=int,
                   help="write the converted model at this default-domain opset "
                        "(default: the model's own; some compilers need 11 or 12)")
    p.add_argument("--holdout", help="samples not used for calibration, to verify on (default: "
                                     "1 in 4 of --data, at least 1 of 2 or more, held out)")
    p.add_argument("--no-holdout", action="store_true",
                   help="calibrate and verify on every --data sample (no held-out check)")
    p.add_argument("--rtol", type=positive_float,
                   help="largest relative L2 error of each output (default 1e-2, or two units of "
                        "the format's rounding where coarser: bf16 1.56e-2; 5e-2 for int8 and "
                        "fp8_e4m3), compare's default too")
    add_goal(p)
    p.add_argument("--max-rounds", type=positive_int, default=3,
                   help="verification rounds; each pins the layers a precision error comes "
                        "from, or else the first divergent node (default 3)")
    p.add_argument("--verify-with", choices=("rknn", "openvino"),
                   help="also build the converted model with the vendor toolchain and run its "
                        "simulator on the samples (rknn: rknn-toolkit2, in its own venv; "
                        "openvino: OpenVINO's CPU plugin, npuprep[openvino])")
    p.add_argument("--vendor-python", metavar="PATH",
                   help="python of the vendor venv (default: $NPUPREP_RKNN_PYTHON, then "
                        "~/.cache/npuprep/rknn-venv)")
    p.add_argument("--max-fp32-share", type=_percent, default=10.0, metavar="PERCENT",
                   help="fail (exit 1) when more than this share of the FLOPs stays FP32 "
                        "(default 10%%)")
    p.add_argument("--max-memory", metavar="SIZE",
                   help="resident-memory budget, e.g. 8G: memory-for-speed trades stay off when "
                        "they would pass it, and a run that still does stops (exit 2) with "
                        "nothing written; the report states the peak either way")
    p.add_argument("--report-json", dest="report", metavar="OUT.json",
                   help="JSON report path (default: <output>.report.json)")
    # `--report` names an input (crosscheck's compiler report); the old output spelling still works.
    p.add_argument("--report", dest="report", help=argparse.SUPPRESS)
    p.add_argument("--html", help="also write a self-contained HTML report here")
    p.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                   help="run the 8-bit search's trials (rules, ranking, widening checks) as Ray "
                        "actors (pip install 'npuprep[ray]'): on a local Ray without ADDRESS, else "
                        "on the cluster at ADDRESS ('auto', 'ray://host:10001')")
    p.add_argument("--ray-cpus", type=positive_int, default=1, metavar="N",
                   help="CPUs per Ray actor with --ray (default 1)")
    p.add_argument("--export", metavar="LIST",
                   help="constraint files to write: trt, horizon, rknn, yaml (comma-separated) or none "
                        "(default: the target compiler's own)")
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from npuprep.cli.common import begin, check_rtol, into_folder, open_samples, print_json
    from npuprep.names import file_part
    from npuprep.pipeline.artefacts import declare, default_exports, parse_exports

    if args.model is None:
        from npuprep.examples import example_data_dir, example_model_path

        args.model = str(example_model_path())
        if not (args.data or args.synthetic or args.stats):
            args.data = str(example_data_dir())
    check_rtol(args.rtol, "--rtol")
    if args.plan and args.plan_only:
        raise NpuprepError("--plan and --plan-only together: the plan already exists")
    from npuprep.model_io import anchored

    # Weights stay in the user's files; each stage reads one as it needs it.
    run_ = begin(args, inputs=("data", "holdout", "stats", "plan"), weights="file")
    profile, model, outputs = run_.profile, anchored(run_.model), run_.outputs
    exports = parse_exports(args.export) if args.export else default_exports(profile.report_format)
    # Not `<stem>.<target>.plan.yaml`: convert writes the plan it applied there, over a draft.
    default_ext = ".draft.plan.yaml" if args.plan_only else ".onnx"
    # Default names come from the model's file name and the profile's name as data, never a path.
    default_name = f"{file_part(Path(args.model).stem, 'model')}.{file_part(profile.name, 'target')}{default_ext}"
    output = Path(into_folder(args.output, default_name) or default_name)
    args.report = into_folder(args.report, f"{output.with_suffix('').name}.report.json")
    args.html = into_folder(args.html, f"{output.with_suffix('').name}.report.html")
    paths = _artefact_paths(args, output, exports)
    declare(outputs, paths)
    from npuprep.resources import MemoryWatch, parse_size

    budget = parse_size(args.max_memory, "--max-memory") if args.max_memory else None
    try:
        with MemoryWatch(budget) as watch, outputs.open() as files:
            samples = open_samples(args, model.proto)
            if args.plan_only:
                plan = _plan_only(args, model, profile, samples, output, files)
            else:
                report, passed = _convert(args, model, profile, samples, paths, files, watch)
    except KeyboardInterrupt as exc:
        watch.check(exc)
        raise
    if args.plan_only:
        _print_plan(args, plan, output)
        return 0
    if args.json:
        print_json(report)
    else:
        _print_summary(report)
    return 0 if passed else 1


def _convert(args: argparse.Namespace, model: Model, profile: TargetProfile,
             samples: SampleSet | None, paths: dict[str, Path], files: OutputSet,
             watch: MemoryWatch) -> tuple[dict[str, Any], bool]:
    """The arguments handed to the pipeline (npuprep.pipeline), its result staged as one set."""
    from contextlib import ExitStack

    from npuprep.cli.common import progress_stages
    from npuprep.data import load_samples
    from npuprep.pipeline import CALIBRATE, SPLIT, convert
    from npuprep.pipeline.artefacts import stage_conversion
    from npuprep.plan import load_plan

    if samples is None:
        raise NpuprepError("convert verifies on samples: give --data D or --synthetic N")
    holdout = load_samples(args.holdout, model.proto, batched=args.batched) if args.holdout else \
        None if args.no_holdout else SPLIT
    with ExitStack() as spinning:
        shown: list[Callable[[str], None]] = []

        def stage(name: str) -> None:
            watch.stage(name)
            # Calibration draws its own progress bar; the spinner starts after it (one live
            # display at a time).
            if name != "calibrating":
                if not shown:
                    shown.append(spinning.enter_context(progress_stages("converting", not args.json)))
                shown[0](name)

        result = convert(
            model, profile, samples, stats=_stats(args, model) or CALIBRATE,
            plan=load_plan(args.plan, model) if args.plan else None, holdout=holdout,
            precision=args.precision, io_types=args.io_types, rtol=args.rtol,
            max_rounds=args.max_rounds, max_fp32_share=args.max_fp32_share / 100,
            min_8bit_share=args.min_8bit_share / 100, scale_rule=args.scale_rule,
            search=args.search, opset=args.opset, top_k=parse_decisions(args.top_k, args.detect),
            metric=args.metric,
            verify_with=args.verify_with,
            vendor_python=args.vendor_python, jobs=args.jobs, streams=args.streams,
            show_progress=not args.json, progress=stage, ray=args.ray, ray_cpus=args.ray_cpus)
    report = stage_conversion(result, paths, files, resources=watch.to_dict())
    return report, result.passed


def _percent(text: str) -> float:
    """`10`, `10%` or `2.5` -> a percentage in [0, 100]."""
    try:
        value = float(text.strip().removesuffix("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage like 10 or 10%, got {text!r}") from None
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"a percentage between 0 and 100, got {text!r}")
    return value


def _artefact_paths(args: argparse.Namespace, output: Path, exports: tuple[str, ...]) -> dict[str, Path]:
    """Every file this convert writes, by role: the model first."""
    from npuprep.pipeline.artefacts import artefact_paths

    if args.plan_only:
        if args.report or args.html:
            raise NpuprepError("--plan-only writes only the plan (-o); --report-json and --html need "
                               "a conversion")
        return {"plan": output}
    return artefact_paths(output, exports=exports, report_path=args.report, html=args.html,
                          vendor=args.verify_with)


def _stats(args: argparse.Namespace, model: Model) -> CalibrationStats | None:
    """The --stats given (mapped onto the model when they are its source's), else None."""
    from npuprep.calibrate import load_stats

    return load_stats(args.stats, model) if args.stats else None


def _plan_only(args: argparse.Namespace, model: Model, profile: TargetProfile,
               samples: SampleSet | None, output: Path, files: OutputSet) -> Plan:
    from npuprep.pipeline import CALIBRATE, draft_plan
    from npuprep.plan import dump_plan

    plan = draft_plan(model, profile, samples, stats=_stats(args, model) or CALIBRATE,
                      precision=args.precision, jobs=args.jobs, streams=args.streams,
                      show_progress=not args.json)
    files.text(output, dump_plan(plan))
    return plan


def _print_plan(args: argparse.Namespace, plan: Any, output: Path) -> None:
    from npuprep.cli.common import print_json, print_table, say

    if args.json:
        print_json(plan.to_dict() | {"written": str(output)})
        return
    rows = [(i, a.action, _where(a), _reason_code(a.to_dict())) for i, a in enumerate(plan.actions, 1)]
    print_table(f"Plan ({len(plan.actions)} actions; why: in the YAML)", ["#", "action", "where", "reason"],
                rows, cut_end=("reason",))
    say(f"plan: {len(plan.actions)} actions, {len(plan.declined)} declined -> {output}", always=True)


def _where(action: Any) -> str:
    from npuprep.report.render_md import action_target

    return action_target(action.to_dict())


def _print_vendor(vendor: dict[str, Any] | None) -> None:
    from npuprep.cli.common import print_table, say

    if vendor is None:
        return
    name = (f"OpenVINO ({vendor['target_platform']})" if vendor["vendor"] == "openvino"
            else f"rknn-toolkit2's simulator ({vendor['target_platform']})")
    if not vendor["built"]:
        # A rewrite that made it build is a note of the conversion instead.
        for line in (vendor.get("bisection") or {}).get("lines", ()):
            say(line)
        print(f"{name} refused the converted model in {vendor['stage']}: {vendor['refusal']}")
        return
    from npuprep.plan.host_scale import factor_words

    scales = vendor["host_scales"]
    print_table(f"Outputs in {name}", ["output", "Inf/NaN", "max abs err", "rel L2", "host scale"],
                [(k, o["nonfinite"], o["max_abs_error"], o["rel_l2"],
                  f"x{factor_words(scales[k])}" if k in scales else "")
                 for k, o in vendor["outputs"].items()])
    layers = vendor.get("layers")
    if layers and layers["non_finite"]:
        names = ", ".join(dict.fromkeys(x for v in layers["non_finite"] for x in v["layers"]))
        print(f"accuracy_analysis: non-finite layers {names}")
    if layers and vendor["vendor"] == "openvino":
        print(_openvino_layers(layers))
        for note in layers.get("notes", ()):
            if note.startswith("OpenVINO ran"):
                say(note)
    if vendor["range_warnings"]:
        print(f"the toolkit warns these tensors leave FP16: {', '.join(vendor['range_warnings'][:8])}")
    if vendor.get("eight_bit"):
        from npuprep.verify.vendor_8bit import paths_table

        print_table(*paths_table(vendor["eight_bit"]))


def _openvino_layers(layers: dict[str, Any]) -> str:
    """What OpenVINO ran against the plan, in one line."""
    counts = ", ".join(f"{k} {n}" for k, n in layers["counts"].items() if n)
    disagree = layers.get("disagree", [])
    said = "agree with the plan" if layers["passed"] else \
        "differ from the plan at " + ", ".join(disagree[:6]) + \
        (f" and {len(disagree) - 6} more" if len(disagree) > 6 else "")
    return f"OpenVINO's runtime precisions {said} ({counts})"


def _nodes(nodes: list[str]) -> str:
    return ", ".join(nodes[:3]) + (f" +{len(nodes) - 3}" if len(nodes) > 3 else "")


def _print_summary(report: dict[str, Any]) -> None:
    from npuprep.cli.common import out, print_table, say
    from npuprep.formatting import capped, number, percent
    from npuprep.report.output_verdicts import agreement_said, judged_by_decisions
    from npuprep.report.pin_count import pins_said
    from npuprep.report.render_md import action_target

    say(f"npuprep convert: {report['model']} -> {report['output']} "
        f"(target {report['target']}, {report['precision']})")
    if report["samples"]["synthetic"]:
        say("samples are synthetic: the ranges are not those of real data")
    if report["actions"]:
        full = out().verbose or out().width is None
        rows = [(i, a["action"], action_target(a), _reason_code(a), *([a.get("why", "")] if full else []))
                for i, a in enumerate(report["actions"], 1)]
        listed, left = capped(rows, 20, out().show_all)
        print_table(f"Actions ({len(rows)}; why: -v or the report)" if not full else "Actions",
                    ["#", "action", "where", "reason", *(["why"] if full else [])], listed,
                    cut_end=("reason",), wrap=("why",))
        if left:
            say(f"... and {left} more actions (--show-all)")
    for key, title in (("verification", "Outputs under emulated target numerics"),
                       ("holdout", "Outputs on held-out samples")):
        check = report.get(key) or {}
        if key == "holdout" and not check:
            continue
        outputs = check.get("outputs") or {}
        judged = any(judged_by_decisions(o) for o in outputs.values())
        rules = report.get("judged_by") or {}
        print_table(f"{title} ({check.get('samples', 0)} samples)" if check else title,
                    ["output", "Inf/NaN", "max abs err", "rel L2",
                     *(["decisions"] if judged else []), "judged by"],
                    [(k, o["nonfinite"], number(o["max_abs_error"]), number(o["rel_l2"]),
                      *([agreement_said(o)] if judged else []), rules.get(k, "rel L2"))
                     for k, o in outputs.items()], wrap=("decisions", "judged by"))
    _print_vendor(report.get("vendor"))
    share = report.get("fp32_share") or {}
    if share.get("islands"):
        print_table("FP32 islands, costliest first", ["nodes", "FLOPs", "share", "why"],
                    [(_nodes(i["nodes"]), number(i["flops"]),
                      percent(i["flops"] / max(share["total_flops"], 1)), i["why"])
                     for i in capped(share["islands"], 5, out().show_all)[0]], wrap=("why",))
        if (left := capped(share["islands"], 5, out().show_all)[1]):
            say(f"... and {left} more FP32 islands (--show-all, or the report)")
    eight = report.get("eight_bit")
    if eight:
        say("Conv/MatMul/Gemm multiply-adds: " + ", ".join(
            f"{percent(v)} {k}" for k, v in eight["mac_share"].items()) + f" (scales {eight['scale_rule']})")
        if eight["kept_wider"]:
            say(f"kept wider for sensitivity: {_nodes(eight['kept_wider'])} "
                f"({percent(eight['kept_wider_cost'])} of the multiply-adds)")
    say(f"FP32 FLOPs share {percent(report['flops_fp32_share'])} "
        f"(multiply-adds {percent(share.get('macs', 0.0))}), "
        f"{report['cast_count']} Casts, {pins_said(report)}, "
        f"{len(report['declined'])} declined remedies")
    if report.get("ledger"):
        from npuprep.report.ledger_md import pins_line

        say(pins_line(report["ledger"]))
    if report.get("resources"):
        from npuprep.report.render_md import longest_stages, resources_line

        line = resources_line(report["resources"])[2:]
        say(line[0].upper() + line[1:])
        if longest := longest_stages(report["resources"]):
            say(f"longest stages: {longest} (every stage: the report's Time by stage)")
    for note in report.get("notes", []):
        say(f"note: {note}")
    verdict = report["verdict"]
    if verdict["precision_limited"]:
        _say_where_the_error_sits(report)
    # A FAILED model is not written under -o (npuprep.pipeline.artefacts): said on the one line.
    written = "" if verdict["passed"] else f"; model: {report['artefacts']['model']}, not -o"
    say(f"{verdict['said']}; report: {report['artefacts']['report_md']}{written}", always=True)


def _say_where_the_error_sits(report: dict[str, Any]) -> None:
    """For each output that failed on FP16 precision alone: where its worst sample's error
    sits, so an error at a few undecided positions reads apart from one everywhere."""
    from npuprep.cli.common import say
    from npuprep.report.output_verdicts import judged_by_decisions, where_errors_sit

    for which, name, errors, where in where_errors_sit(report):
        say(f"note: {name} on the {which}: {where}")
        if errors.get("top1_agreement") == 1.0 and not judged_by_decisions(errors):
            say(f"note: every top-1 decision of {name} on the {which} holds; if its "
                f"decisions are what it is judged by: --top-k {name}:1")


def _reason_code(action: dict[str, Any]) -> str:
    """The rules behind an action, as codes (`range.overflow`); the sentence is in the report."""
    rules = list(dict.fromkeys(f.get("rule", "") for f in action.get("findings", []) if f.get("rule")))
    if rules:
        return ",".join(rules)
    return "request" if action.get("request") else "verify"
