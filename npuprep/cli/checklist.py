"""`npuprep checklist MODEL --target T [--workspace W]`: the first-week bring-up checklist."""

from __future__ import annotations

import argparse

from npuprep.cli.common import add_json, add_target, positive_int

help = "write the first-week bring-up checklist (Markdown), ticked from the artefacts in a workspace"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the ONNX model being brought up")
    add_target(p)
    p.add_argument("--stats", "-s", help="calibration stats JSON: names the riskiest tensors")
    p.add_argument("--plan", "-p", metavar="PLAN.yaml",
                   help="the plan convert applies (--plan-only's or convert's): the precision item "
                        "says what it does per flagged node (default: W's plan, else the planner's "
                        "own decision)")
    p.add_argument("--workspace", "-w", metavar="W",
                   help="folder of artefacts (W/*.json by kind, W/plan.yaml) that tick items")
    p.add_argument("--top", type=positive_int, default=10, help="riskiest tensors to name (default 10)")
    p.add_argument("-o", "--output", metavar="OUT.md", help="write the Markdown here (default: print)")
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from npuprep.cli.common import begin, dump_json
    from npuprep.crosscheck.checklist import build_checklist, scan_workspace, to_markdown

    run_ = begin(args, inputs=("stats", "plan", "workspace"))
    profile, model, outputs = run_.profile, run_.model, run_.outputs
    if args.output:
        outputs.writes(args.output, "-o")
        outputs.check()
    workspace = scan_workspace(args.workspace) if args.workspace else None
    stats_arg = args.stats or ""
    family = workspace.family(model) if workspace else frozenset()
    found = workspace.latest("stats", family) if workspace and not stats_arg else None
    if found and found[1].get("fingerprint") in family:
        stats_arg = found[0]
    stats = None
    if stats_arg:
        from npuprep.calibrate import load_stats

        stats = load_stats(stats_arg, model)
    plan = None
    if args.plan:
        from npuprep.plan import load_plan

        plan = load_plan(args.plan, model)
    checklist = build_checklist(model, profile, model_arg=args.model, target_arg=args.target,
                                stats=stats, stats_arg=stats_arg, workspace=workspace,
                                top_n=args.top, plan=plan, plan_arg=args.plan or "")
    text = dump_json(checklist.to_dict()) if args.json else to_markdown(checklist)
    if args.output:
        with outputs.open() as files:
            files.text(args.output, text)
    elif args.json:
        print(text, end="")
    else:
        from npuprep.cli.common import out
        from npuprep.formatting import wrap_markdown

        print(wrap_markdown(text, out().width), end="")
    return 0
