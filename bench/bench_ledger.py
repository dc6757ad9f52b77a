"""`npuprep ledger` on every built corpus model, per target: the table of BENCHMARKS.md.

    python bench/bench_ledger.py [--targets a2000 rk3588 a100 rtx5000ada] [--converted DIR]
                                 [--peak TARGET:FMT=TFLOPS ...] [--bandwidth TARGET=GBS ...]

Per model and target: estimated ms of all-FP32, all-FP16 and the 8-bit plan, FP16's speed-up
and memory-bound share, and with --converted DIR (holding NAME.TARGET.onnx from `npuprep
convert`) the converted row and what its pins and casts cost. Figures a profile leaves unknown
have no time unless set with --peak/--bandwidth (say where such a figure comes from); their
speed-ups are then the range the profile's known and assumed figures allow.
Samples: the model's first calib/*.npz (FLOPs at its shapes). Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CORPUS = Path(os.environ.get("NPUPREP_CORPUS_DIR", Path.home() / ".cache/npuprep/corpus"))


def _ms(v: float | None) -> str:
    return "unknown" if v is None else f"{v:.3g}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2g}x"


def _speedup(row: dict) -> str:
    """The row's speed-up over FP32, or the range its known and assumed figures allow."""
    span = row.get("speedup_range")
    if row.get("speedup_vs_fp32") is None and span:
        return f"{span[0]:.2g}-{span[1]:.2g}x"
    return _x(row.get("speedup_vs_fp32"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=["a2000", "rk3588", "a100", "rtx5000ada"])
    parser.add_argument("--converted", type=Path, help="folder of NAME.TARGET.onnx")
    parser.add_argument("--peak", action="append", default=[], metavar="TARGET:FMT=TFLOPS")
    parser.add_argument("--bandwidth", action="append", default=[], metavar="TARGET=GBS")
    parser.add_argument("--only", nargs="*", help="model names")
    args = parser.parse_args()
    models = sorted(p.parent for p in CORPUS.glob("*/entry.json"))
    if args.only:
        models = [m for m in models if m.name in args.only]
    print("| model | target | GFLOP | MB moved FP32 / FP16 | FP32 ms | FP16 ms | FP16 vs FP32 "
          "| FP16 vs TF32 | memory-bound (FP16) | 8-bit plan ms (vs FP32) | converted ms | "
          "pins+casts ms (share) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for folder in models:
        calib = sorted((folder / "calib").glob("*.npz"))
        for target in args.targets:
            cmd = [sys.executable, "-m", "npuprep", "ledger", str(folder / "model.onnx")]
            converted = args.converted / f"{folder.name}.{target}.onnx" if args.converted else None
            if converted is not None and converted.is_file():
                cmd.append(str(converted))
            cmd += ["--target", target, "--json"]
            if calib:
                cmd += ["--data", str(calib[0])]
            cmd += [f"--peak={p.split(':', 1)[1]}" for p in args.peak if p.startswith(f"{target}:")]
            cmd += [f"--bandwidth={b.split('=', 1)[1]}" for b in args.bandwidth
                    if b.startswith(f"{target}=")]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                print(f"| {folder.name} | {target} | failed: {run.stderr.strip()[:80]} |||||||||")
                continue
            doc = json.loads(run.stdout)
            rows = {r["format"]: r for r in doc["formats"]}
            fp16 = rows.get(doc["precision"], {})
            eight = next((r for k, r in rows.items() if k.endswith("plan")), {})
            conv = rows.get("converted")
            pins = doc.get("pins") or {}
            cost = (f"{_ms(pins.get('extra_ms'))} ({pins['extra_share']:.1%})"
                    if pins.get("extra_share") is not None else _ms(pins.get("extra_ms")) if pins else "-")
            moved = f"{rows['fp32']['bytes'] / 1e6:.3g} / {fp16.get('bytes', 0) / 1e6:.3g}"
            print(f"| {folder.name} | {target} | {rows['fp32']['flops'] / 1e9:.3g} | {moved} | "
                  f"{_ms(rows['fp32']['estimated_ms'])} | "
                  f"{_ms(fp16.get('estimated_ms'))} | {_speedup(fp16)} | "
                  f"{_x(fp16.get('speedup_vs_tf32')) if 'tf32' in rows else 'no TF32'} | "
                  f"{'-' if fp16.get('memory_bound_share') is None else format(fp16['memory_bound_share'], '.0%')} | "
                  f"{_ms(eight.get('estimated_ms'))} ({_speedup(eight) if eight else '-'}) | "
                  f"{_ms(conv['estimated_ms']) if conv else '-'} | "
                  f"{cost} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
