"""Calibration in one process vs as Ray tasks on a local Ray with 2 workers: wall time, peak
memory, and what Ray's start-up costs.

The transformer of bench_calibrate.py (113 MB, 4 layers, d=768, seq 128) over N synthetic
samples written as .npz files. Each method runs in its own process, from interpreter start
to stats written:

- one process: `npuprep calibrate MODEL --data DIR -o stats.json` (its default: one stream
  per core on one shared session);
- jobs 2: the same with `--jobs 2` (two forked processes), for reference;
- Ray 2 workers: `ray.init(num_cpus=2)`, then `calibrate_on_ray` (two tasks, one CPU each:
  each loads the model, builds its session and calibrates its half), then `ray.shutdown()`;
  the phases are timed apart.

Peak memory: the largest sum of PSS over the process and all its descendants (Ray's GCS,
raylet, workers, ...), sampled every 20 ms. The stats files of all methods must be equal
byte for byte. Rounds alternate the methods.

    .venv/bin/python bench/bench_calibrate_ray.py --samples 256 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_calibrate import WORK, _tree_pss_mb, sample_dir  # noqa: E402

METHODS = ("one-process", "jobs-2", "ray-2")


def child(method: str, model: Path, folder: Path, out: Path) -> dict[str, float]:
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], _tree_pss_mb(os.getpid()))

    threading.Thread(target=sample, daemon=True).start()
    phases: dict[str, float] = {}
    if method == "ray-2":
        import ray

        from npuprep.calibrate import save_stats
        from npuprep.calibrate.on_ray import calibrate_on_ray
        from npuprep.data import load_samples
        from npuprep.model_io import load_model

        t0 = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        t1 = time.perf_counter()
        # Ray alone, before any task: its daemons and the idle workers it starts (the pause
        # is left out of the wall time).
        time.sleep(1.0)
        phases["ray_idle_pss_mb"] = _tree_pss_mb(os.getpid())
        phases["paused_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        m = load_model(model, weights="file")
        save_stats(calibrate_on_ray(m, load_samples(folder, m.proto)), out)
        t2 = time.perf_counter()
        ray.shutdown()
        t3 = time.perf_counter()
        phases |= {"ray_init_s": t1 - t0, "tasks_s": t2 - t1, "ray_shutdown_s": t3 - t2}
    else:
        from npuprep.cli.main import main as cli

        extra = ["--jobs", "2"] if method == "jobs-2" else []
        if cli(["calibrate", str(model), "--data", str(folder), *extra, "-o", str(out)]) != 0:
            raise SystemExit(1)
    done.set()
    return {"pss_peak_mb": max(peak[0], _tree_pss_mb(os.getpid()))} | phases


def run(method: str, model: Path, folder: Path) -> dict[str, float]:
    out = WORK / f"ray_bench_{method}.json"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", method, str(model), str(folder), str(out)],
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{method} failed: {proc.stderr.strip()[-500:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result | {"wall_s": wall - result.get("paused_s", 0.0), "stats": out.read_text()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=4, metavar=("METHOD", "MODEL", "DIR", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build:
        import onnx
        from bench_calibrate import build_transformer, write_samples

        WORK.mkdir(parents=True, exist_ok=True)
        if not (WORK / "transformer.onnx").exists():
            onnx.save_model(build_transformer(), str(WORK / "transformer.onnx"))
        write_samples("transformer", args.samples)
        return
    if args.child:
        method, model, folder, out = args.child
        print(json.dumps(child(method, Path(model), Path(folder), Path(out))))
        return
    model, folder = WORK / "transformer.onnx", sample_dir("transformer", args.samples)
    if not (model.exists() and folder.exists()):
        # In a child, so this process stays small; only the transformer and its samples.
        subprocess.run([sys.executable, __file__, "--build", "--samples", str(args.samples)], check=True)
    # npuprep's bytecode, as a regular install has it (see bench_calibrate.py).
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(WORK.parent.parent / "npuprep")], check=True)
    results: dict[str, list[dict]] = {m: [] for m in METHODS}
    for _ in range(args.rounds):
        for method in METHODS:
            results[method].append(run(method, model, folder))
    stats = {r.pop("stats") for rounds in results.values() for r in rounds}
    print(f"{args.samples} samples, {args.rounds} rounds, load average "
          f"{', '.join(f'{v:.1f}' for v in os.getloadavg())}; stats files identical: {len(stats) == 1}")
    print("| method | wall s (median) | wall s (rounds) | s / sample | peak PSS MB | Ray idle PSS MB | Ray init s "
          "| tasks s | Ray shutdown s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method, rounds in results.items():
        walls = [r["wall_s"] for r in rounds]
        med = statistics.median(walls)

        def phase(key: str, rounds: list[dict] = rounds) -> str:
            return f"{statistics.median(r[key] for r in rounds):.2f}" if key in rounds[0] else "-"

        print(f"| {method} | {med:.1f} | {', '.join(f'{w:.1f}' for w in walls)} | {med / args.samples:.4f} | "
              f"{max(r['pss_peak_mb'] for r in rounds):.0f} | {phase('ray_idle_pss_mb')} | {phase('ray_init_s')} | "
              f"{phase('tasks_s')} | "
              f"{phase('ray_shutdown_s')} |")
    (WORK / "bench_calibrate_ray.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
