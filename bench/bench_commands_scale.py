"""Every command on bench_convert_scale's models: wall time and peak RSS of each as a whole process.

Run: python bench/bench_commands_scale.py [--models 2.4GB,transformer] [--out bench/_work/scale]
     [--repeat 1]

The models are those bench/bench_convert_scale.py builds (run it first: OUT/<name>/model.onnx
with external data and OUT/<name>/calib). Each command runs as `python -m npuprep ...` in its
own process (PYTHONPATH picks the code measured, so a snapshot of older code can be measured
the same way), peak RSS = ru_maxrss of the child. Writes OUT/commands.md and OUT/commands.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHILD = HERE / "bench_convert_scale.py"  # its --child mode times one process


def commands(model: Path, calib: Path, work: Path) -> dict[str, list[str]]:
    kit, ledger_kit = work / "probe_kit", work / "ledger_kit"
    return {
        "check --data": ["check", str(model), "-t", "a2000", "--data", str(calib)],
        "compare --emulate": ["compare", str(model), "--emulate", "--target", "a2000", "--data", str(calib)],
        "probe": ["probe", str(model), "-t", "a2000", "--data", str(calib)],
        "probe --export-kit": ["probe", str(model), "-t", "a2000", "--data", str(calib), "--export-kit", str(kit)],
        "ledger": ["ledger", str(model), "-t", "a2000"],
        "ledger --export-kit": ["ledger", str(model), "-t", "a2000", "--export-kit", str(ledger_kit)],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="2.4GB,transformer")
    ap.add_argument("--out", default=str(HERE / "_work" / "scale"))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated command names (default: all)")
    args = ap.parse_args()
    out = Path(args.out)
    rows = []
    for name in args.models.split(","):
        model = out / name / "model.onnx"
        if not model.is_file():
            sys.exit(f"{model}: build it first with bench/bench_convert_scale.py")
        work = out / name / "commands"
        for what, argv in commands(model, out / name / "calib", work).items():
            if args.only and what not in args.only.split(","):
                continue
            runs = []
            for _ in range(args.repeat):
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                proc = subprocess.run([sys.executable, str(CHILD), "--child", sys.executable, "-m", "npuprep", *argv],
                                      capture_output=True, text=True)
                runs.append(json.loads(proc.stdout or "{}"))
            ok = [r for r in runs if "seconds" in r]
            row = {"model": name, "command": what, "runs": runs,
                   "seconds": statistics.median(r["seconds"] for r in ok) if ok else None,
                   "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in ok) if ok else None,
                   "rc": runs[-1].get("rc"), "tail": runs[-1].get("stderr_tail", "")}
            print(name, what, row["seconds"], row["peak_rss_mb"], row["rc"], row["tail"][:80], flush=True)
            rows.append(row)
    (out / "commands.json").write_text(json.dumps(rows, indent=1))
    lines = ["| model | command | s | peak MB | exit |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | `{r['command']}` | {r['seconds']} | {r['peak_rss_mb']} | {r['rc']} |" for r in rows]
    (out / "commands.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
