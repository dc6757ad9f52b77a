"""One story across the commands: do check, convert, crosscheck --plan, checklist and the HTML
agree on which nodes need FP32 (and why), and does any default output pass 100 columns?

Run: python bench/bench_story.py [NAME ...] [--target a2000] [--out DIR]
     (NAME: corpus models, default minilm_l6 convnext_t; build them with bench/corpus.py)

Per model, as subprocesses of the installed CLI, on the corpus model's calib/ samples:
  calibrate -o stats.json; check --data (default output); check --stats --json --html;
  convert --plan-only --stats --json; convert --stats --data -o model.onnx; crosscheck --plan
  against a generic CSV report synthesised from the conversion (the nodes convert keeps FP32
  as fp32, every other node fp16), and a variant with one pinned node reported fp16, which
  must fail as pin-ignored (a lowering-forced node is never the one flipped); crosscheck
  --stats without --plan on a report running every node in fp16; checklist --stats (the
  planner's decision) and --plan (convert's).
Prints a Markdown table: per command the FP32 node set, whether it equals the plan's (check
--json), the why-codes where --json exposes them, the widest line of the default output.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from corpus import corpus_dir  # noqa: E402

WIDTH = 100


@dataclass
class Run:
    command: str
    rc: int
    seconds: float
    widest: int
    stdout: str
    stderr: str


@dataclass
class Row:
    command: str
    fp32: set[str] | None = None
    why: dict[str, tuple[str, ...]] = field(default_factory=dict)
    widest: int | None = None
    rc: int | None = None
    seconds: float = 0.0
    note: str = ""


def cli(*args: object, cwd: Path | None = None) -> Run:
    """Run `npuprep ARGS` as a user would, output piped (so no terminal width is known)."""
    argv = [sys.executable, "-m", "npuprep", *map(str, args)]
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=cwd,
                          env={k: v for k, v in __import__("os").environ.items() if k != "COLUMNS"})
    seconds = time.perf_counter() - start
    lines = (proc.stdout + "\n" + proc.stderr).splitlines()
    # Progress bars redraw with \r: the widest visible piece counts, not the joined line.
    widest = max((len(piece) for line in lines for piece in line.split("\r")), default=0)
    shown = " ".join(str(a) for a in args)
    return Run(f"npuprep {shown}", proc.returncode, seconds, widest, proc.stdout, proc.stderr)


def plan_pins(plan: dict) -> tuple[set[str], dict[str, tuple[str, ...]]]:
    """Nodes a plan pins (less forbid_pin) and the rules behind each pin."""
    nodes: set[str] = set()
    why: dict[str, tuple[str, ...]] = {}
    for a in plan.get("actions", []):
        if a.get("action") != "pin_fp32":
            continue
        rules = tuple(sorted({f["rule"] for f in a.get("findings", [])})) or ("verify",)
        for n in a["nodes"]:
            nodes.add(n)
            why[n] = rules
    forbidden = set(plan.get("forbid_pin", []))
    return nodes - forbidden, {n: r for n, r in why.items() if n not in forbidden}


def model_nodes(path: Path) -> list[str]:
    import onnx

    from npuprep.graph import node_label

    proto = onnx.load(str(path), load_external_data=False)
    return [node_label(n) for n in proto.graph.node]


def write_report(path: Path, nodes: list[str], fp32: set[str], flip: str = "") -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["node", "precision"])
        for n in nodes:
            w.writerow([n, "fp32" if n in fp32 and n != flip else "fp16"])


def remedy_marks(page: str) -> list[str]:
    return re.findall(r'<g id="headroom-remedy-\d+"><title>([^<]*)</title>', page)


def bench(name: str, root: Path, out: Path, target: str) -> list[Row]:
    src = root / name
    model, calib = src / "model.onnx", src / "calib"
    work = out / name
    work.mkdir(parents=True, exist_ok=True)
    stats = work / "stats.json"
    rows: list[Row] = []

    r = cli("calibrate", model, "--data", calib, "-o", stats)
    rows.append(Row("calibrate --data", widest=r.widest, rc=r.rc, seconds=r.seconds))

    r = cli("check", model, "--target", target, "--data", calib)
    check_default = Row("check --data", widest=r.widest, rc=r.rc, seconds=r.seconds)
    html = work / "check.html"
    j = cli("check", model, "--target", target, "--stats", stats, "--json", "--html", html)
    plan = json.loads(j.stdout)["plan"]
    pins, why = plan_pins(plan)
    check_default.fp32, check_default.why = pins, why
    check_default.note = f"{len(plan['actions'])} actions"
    rows.append(check_default)

    marks = remedy_marks(html.read_text())
    kinds = sorted(m.split(":")[0] for m in marks)
    wanted = sorted(a["action"] for a in plan["actions"])
    rows.append(Row("check --html", fp32=pins if kinds == wanted else None, seconds=j.seconds,
                    note=f"{len(marks)} remedy marks for {len(wanted)} actions"
                         + ("" if kinds == wanted else f" MISMATCH {kinds} vs {wanted}")))

    draft = work / "draft.plan.yaml"
    p = cli("convert", model, "--target", target, "--stats", stats, "--plan-only", "-o", draft, "--json")
    drafted = json.loads(p.stdout)
    d_pins, d_why = plan_pins(drafted)
    pd = cli("convert", model, "--target", target, "--stats", stats, "--plan-only", "-o", draft)
    rows.append(Row("convert --plan-only", fp32=d_pins, why=d_why, widest=pd.widest, rc=pd.rc,
                    seconds=pd.seconds, note=f"{len(drafted['actions'])} actions"))

    converted = work / "model.onnx"
    c = cli("convert", model, "--target", target, "--stats", stats, "--data", calib, "-o", converted)
    report = json.loads((work / "model.report.json").read_text()) if c.rc in (0, 1) else {}
    applied = work / "model.plan.yaml"
    conv_pins = set(report.get("pinned_nodes", []))
    # FP32 that lowering forces (shape computations, type-fixed ops) is no precision decision.
    lowering = {n for i in (report.get("fp32_share") or {}).get("islands", [])
                if str(i.get("why", "")).startswith("lowering:") for n in i["nodes"]}
    a_pins, a_why = plan_pins(_yaml(applied)) if applied.exists() else (set(), {})
    rows.append(Row("convert", fp32=conv_pins - lowering, why=a_why, widest=c.widest, rc=c.rc,
                    seconds=c.seconds,
                    note=f"plan.yaml pins {len(a_pins)}; report pins {len(conv_pins)}, of which "
                         f"{len(lowering & conv_pins)} lowering-forced; "
                         f"FP32 FLOPs {report.get('flops_fp32_share', 0):.2%}"))

    source_nodes = set(model_nodes(model))
    listed = [n for n in model_nodes(converted) if n in source_nodes] if converted.exists() else []
    csv_ok, csv_bad = work / "compiler.csv", work / "compiler_ignored.csv"
    write_report(csv_ok, listed, conv_pins)
    # The conversion's .precision.yaml holds every FP32 node with its reason; a crosscheck that
    # does not read it yet gets the plan.yaml.
    decision = work / "model.precision.yaml"
    args = ("--target", target, "--report-format", "generic", "--plan", decision)
    x = cli("crosscheck", model, "--report", csv_ok, *args)
    if x.rc == 2:
        decision = applied
        args = ("--target", target, "--report-format", "generic", "--plan", decision)
        x = cli("crosscheck", model, "--report", csv_ok, *args)
    xj = cli("crosscheck", model, "--report", csv_ok, *args, "--json")
    verdicts = json.loads(xj.stdout).get("verdicts", []) if xj.stdout.strip().startswith("{") else []
    needs = {v["node"] for v in verdicts if "fp32" in str(v.get("needs", ""))}
    failing = [v["node"] for v in verdicts if v["verdict"] in ("mismatch", "pin-ignored", "non-finite")]
    # A pin of the plan's own if it has one, else a node the conversion's .precision.yaml keeps FP32.
    # Lowering-forced FP32 (a shape computation, an integer lookup) is no request: never flipped.
    kept = {e["node"] for e in (_yaml(work / "model.precision.yaml") or {}).get("nodes", [])
            if e.get("precision") == "fp32" and "by lowering" not in str(e.get("reason", ""))} \
        if (work / "model.precision.yaml").exists() else set()
    flip = next(iter(sorted(a_pins & set(listed))), "") or next(iter(sorted(kept & set(listed))), "")
    write_report(csv_bad, listed, conv_pins, flip)
    rows.append(Row("crosscheck --plan", fp32=needs - lowering,
                    why={v["node"]: _verdict_rules(v) for v in verdicts if v["node"] in needs},
                    widest=x.widest, rc=x.rc, seconds=x.seconds,
                    note=f"--plan {decision.name}: {len(needs & lowering)} lowering-forced FP32 "
                         f"besides; {len(failing)} failing"
                         + (f" ({', '.join(failing[:3])})" if failing else "")))
    if flip:
        y = cli("crosscheck", model, "--report", csv_bad, *args, "--json")
        flagged = [v["node"] for v in json.loads(y.stdout)["verdicts"]
                   if v["verdict"] == "pin-ignored"]
        rows.append(Row("crosscheck --plan (1 pin reported fp16)", rc=y.rc, seconds=y.seconds,
                        note=f"{flip} reported fp16: " + ("flagged pin-ignored" if flip in flagged
                                                          else "NOT flagged")))
    else:
        rows.append(Row("crosscheck --plan (1 pin reported fp16)",
                        note="no variant: neither the plan nor the conversion pins a node"))

    # Without --plan, on a report that runs every node in FP16 (the issue-28 case): the planner's
    # decision on the same stats decides, so the FP32 set is the plan's pins, nothing else.
    csv_fp16 = work / "compiler_all_fp16.csv"
    write_report(csv_fp16, model_nodes(model), set())
    n = cli("crosscheck", model, "--report", csv_fp16, "--target", target, "--report-format", "generic",
            "--stats", stats)
    nj = cli("crosscheck", model, "--report", csv_fp16, "--target", target, "--report-format", "generic",
             "--stats", stats, "--json")
    nv = json.loads(nj.stdout).get("verdicts", []) if nj.stdout.strip().startswith("{") else []
    # Its pins: nodes it says need FP32 (fp32-range, a measured range a rescale answers in the
    # conversion only, is counted among the failing, not as a pin).
    n_needs = {v["node"] for v in nv if v.get("needs") == "fp32"}
    n_failing = [v["node"] for v in nv if v["verdict"] in ("mismatch", "pin-ignored", "non-finite")]
    rows.append(Row("crosscheck --stats (no --plan, all fp16)", fp32=n_needs - lowering,
                    widest=n.widest, rc=n.rc, seconds=n.seconds,
                    note=f"{len(n_failing)} failing" + (f" ({', '.join(n_failing[:3])})" if n_failing else "")
                         + f"; {len(n.stdout.splitlines())} lines"))

    k = cli("checklist", model, "--target", target, "--stats", stats)
    kj = cli("checklist", model, "--target", target, "--stats", stats, "--json")
    story = json.loads(kj.stdout)["story"]
    rows.append(Row("checklist --stats", fp32=set(story["pinned_nodes"]),
                    why={s["node"]: _pin_rules(s["detail"]) for s in story["nodes"] if s["needs_fp32"]},
                    widest=k.widest, rc=k.rc, seconds=k.seconds,
                    note=", ".join(f"{n} {f}" for f, n in story["counts"].items())))
    if applied.exists():
        kp = cli("checklist", model, "--target", target, "--stats", stats, "--plan", applied)
        kpj = cli("checklist", model, "--target", target, "--stats", stats, "--plan", applied, "--json")
        story = json.loads(kpj.stdout)["story"]
        rows.append(Row("checklist --plan (convert's)", fp32=set(story["pinned_nodes"]),
                        widest=kp.widest, rc=kp.rc, seconds=kp.seconds,
                        note=", ".join(f"{n} {f}" for f, n in story["counts"].items())))
    (work / "rows.json").write_text(json.dumps([_row_dict(r) for r in rows], indent=1))
    return rows


def _verdict_rules(verdict: dict) -> tuple[str, ...]:
    """The rules behind a crosscheck verdict's pin (`... FP32: rule at t, rule at t`), else its own."""
    pin = str((verdict.get("evidence") or {}).get("pin", ""))
    said = sorted(set(re.findall(r"([a-z0-9_]+\.[a-z0-9_]+) at ", pin)))
    return tuple(said) if said else tuple(sorted(verdict.get("rules", [])))


def _pin_rules(detail: str) -> tuple[str, ...]:
    """The rules of a pinned node's story detail (`rule,rule; request`)."""
    return tuple(sorted(detail.split(";")[0].split(",")))


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def _row_dict(r: Row) -> dict:
    return {"command": r.command, "fp32": sorted(r.fp32) if r.fp32 is not None else None,
            "why": {k: list(v) for k, v in r.why.items()}, "widest": r.widest, "rc": r.rc,
            "seconds": round(r.seconds, 1), "note": r.note}


def table(name: str, rows: list[Row]) -> str:
    plan = next(r.fp32 for r in rows if r.command == "check --data")
    plan_why = next(r.why for r in rows if r.command == "check --data")
    lines = [f"**{name}**", "",
             "| command | FP32 nodes | = check's plan | why-codes = | widest line | exit | s | notes |",
             "|---|---:|---|---|---:|---:|---:|---|"]
    for r in rows:
        same = "" if r.fp32 is None or plan is None else ("yes" if r.fp32 == plan else
                                                          f"no (+{len(r.fp32 - plan)} -{len(plan - r.fp32)})")
        common = set(r.why) & set(plan_why)
        whys = "" if not r.why or r.command == "check --data" else (
            "yes" if all(r.why[n] == plan_why[n] for n in common) and common else
            "n/a" if not common else "no")
        wide = "" if r.widest is None else (f"{r.widest}" + (" **>100**" if r.widest > WIDTH else ""))
        lines.append(f"| {r.command} | {'' if r.fp32 is None else len(r.fp32)} | {same} | {whys} | "
                     f"{wide} | {'' if r.rc is None else r.rc} | {r.seconds:.1f} | {r.note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=["minilm_l6", "convnext_t"])
    ap.add_argument("--target", default="a2000")
    ap.add_argument("--dir", type=Path, default=None, help="corpus folder (default: $NPUPREP_CORPUS_DIR)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/npuprep-bench-story"))
    args = ap.parse_args(argv)
    root = (args.dir or corpus_dir()).expanduser()
    missing = [n for n in args.names if not (root / n / "entry.json").exists()]
    if missing:
        print(f"not built: {', '.join(missing)} (python bench/corpus.py --only ...)", file=sys.stderr)
        return 2
    for name in args.names:
        print(table(name, bench(name, root, args.out, args.target)), "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
