"""The hazard-class models (bench/hazard_models.py) through convert on a2000 and rk3588, beside AutoCast.

Run: python bench/bench_hazards.py [--dir DIR] [--no-rknn] [--no-autocast]
(AutoCast: nvidia-modelopt 0.47 in its own venv, $NPUPREP_MODELOPT_PYTHON, default
~/.cache/npuprep/modelopt-venv/bin/python; rknn-toolkit2: $NPUPREP_RKNN_PYTHON)

Per model: `npuprep convert --target T --data calib/ --holdout heldout/ --json` on a2000 and
on rk3588 (rk3588 with `--verify-with rknn`: the vendor's simulator runs the converted model
on the calibration samples), and `python -m modelopt.onnx.autocast --low_precision_type fp16
--keep_io_types --providers cpu --calibration_data calib/` judged like npuprep's output:
emulated FP16 (bench/bench_corpus.py's widening) on heldout/. Cells: held-out worst rel L2,
Inf/NaN count, FP32 share of the multiply-adds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_corpus  # noqa: E402 - the sibling script: its FP16 judge
import hazard_models  # noqa: E402

MODELOPT = Path(os.environ.get("NPUPREP_MODELOPT_PYTHON",
                               Path.home() / ".cache/npuprep/modelopt-venv/bin/python"))


def npuprep_cell(folder: Path, target: str, out: Path, rknn: bool) -> tuple[str, str]:
    """(convert's cell, the simulator's cell) for one target."""
    args = [str(Path(sys.executable).parent / "npuprep"), "convert", str(folder / "model.onnx"),
            "--target", target, "--data", str(folder / "calib"), "--holdout",
            str(folder / "heldout"), "-o", str(out), "--json",
            *(a for o in hazard_models.MODELS[folder.name][2] for a in ("--top-k", f"{o}:1"))]
    if rknn:
        args += ["--verify-with", "rknn"]
    proc = subprocess.run(args, capture_output=True, text=True)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return f"error: {proc.stderr.strip().splitlines()[-1][:120]}", "-"
    held = report["holdout"]["outputs"]
    bad = sum(o["nonfinite"] for o in held.values())
    worst = max(o["rel_l2"] for o in held.values())
    share = (report.get("fp32_share") or {}).get("macs", 0.0)
    verdict = "PASSED" if report["passed"] else "FAILED"
    cell = f"{verdict}: rel L2 {worst:.2g}, {bad} Inf/NaN, FP32 MACs {100 * share:.1f}%"
    vendor = report.get("vendor")
    sim = "-"
    if vendor:
        if not vendor["built"]:
            sim = f"refused in {vendor['stage']}"
        else:
            outs = vendor["outputs"].values()
            sim = (f"rel L2 {max(o['rel_l2'] for o in outs):.2g}, "
                   f"{sum(o['nonfinite'] for o in outs)} Inf/NaN")
    return cell, sim


def autocast_cell(folder: Path, out: Path) -> str:
    if not MODELOPT.is_file():
        return "not run (no modelopt venv)"
    proc = subprocess.run(
        [str(MODELOPT), "-m", "modelopt.onnx.autocast", "--onnx_path", str(folder / "model.onnx"),
         "--output_path", str(out), "--low_precision_type", "fp16", "--calibration_data",
         str(folder / "calib"), "--keep_io_types", "--providers", "cpu"],
        capture_output=True, text=True)
    if proc.returncode or not out.exists():
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"failed: {last[:120]}"
    reference = bench_corpus.session(str(folder / "model.onnx"))
    judged = bench_corpus.try_judge(reference, onnx.load(str(out)),
                                    bench_corpus.load_samples(folder / "heldout"))
    if isinstance(judged, str):
        return judged
    return f"rel L2 {judged.rel_l2:.2g}, {judged.nonfinite} Inf/NaN, FP32 layer weights {_macs(out):.1f}%"


def _macs(path: Path) -> float:
    """Share (%) of Conv/MatMul/Gemm weights AutoCast left FP32, by weight count."""
    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    total = wide = 0
    for node in model.graph.node:
        if node.op_type in ("Conv", "MatMul", "Gemm"):
            for name in node.input[1:2]:
                if name in inits:
                    size = int(np.prod(inits[name].dims))
                    total += size
                    wide += size if inits[name].data_type == onnx.TensorProto.FLOAT else 0
    return 100.0 * wide / total if total else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("bench/_work/hazards"))
    ap.add_argument("--no-rknn", action="store_true")
    ap.add_argument("--no-autocast", action="store_true")
    args = ap.parse_args()
    names = hazard_models.build(args.dir)
    head = ("model", "convert --target a2000 (held out)", "convert --target rk3588 (held out)",
            "rk3588 simulator after convert", "AutoCast (held out)")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in names:
        folder = args.dir / name
        a2000, _ = npuprep_cell(folder, "a2000", folder / "a2000.onnx", False)
        rk, sim = npuprep_cell(folder, "rk3588", folder / "rk3588.onnx", not args.no_rknn)
        auto = "-" if args.no_autocast else autocast_cell(folder, folder / "autocast.onnx")
        print(f"| {name} | {a2000} | {rk} | {sim} | {auto} |", flush=True)


if __name__ == "__main__":
    main()
