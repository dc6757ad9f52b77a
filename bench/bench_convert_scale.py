"""convert at scale: a chain of width x width MatMul+Relu layers stored as external data, and the
227 MB-weight transformer of bench_calibrate, beside plain inference, calibration and AutoCast.

Run: python bench/bench_convert_scale.py [--sizes 0.2,1,2.4] [--transformer] [--samples 4]
     [--repeat 3] [--cpus 0,1] [--only plain,calibrate,convert,autocast] [--out bench/_work/scale]
     [--precision fp16,int8,fp8_e4m3]

Per model: builds it once (OUT/<name>/model.onnx + model.onnx.data, kept between runs) and its
samples, then times whole processes, each with its peak RSS (ru_maxrss of the child), the
median of --repeat runs: plain onnxruntime inference of the model on the samples, `npuprep
calibrate`, `npuprep convert --target a2000` once per --precision (`convert` for fp16,
`convert_int8` / `convert_fp8_e4m3` for the 8-bit ones, with --data), and NVIDIA's AutoCast (nvidia-modelopt in its own
venv, $NPUPREP_MODELOPT_PYTHON, default ~/.cache/npuprep/modelopt-venv; FP16 with the same
samples as calibration data, keep_io_types, CPU). --cpus pins every process to those cores
(taskset). Writes OUT/result.md (the table for BENCHMARKS.md) and OUT/result.json. The machine
must have the weights' size free on disk per model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
MODELOPT = Path(os.environ.get("NPUPREP_MODELOPT_PYTHON",
                               Path.home() / ".cache/npuprep/modelopt-venv/bin/python"))
PLAIN = """
import sys, glob, numpy as np, onnxruntime as ort
s = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
for f in sorted(glob.glob(sys.argv[2] + "/*.npz")):
    s.run(None, dict(np.load(f)))
"""


def build_chain(folder: Path, gigabytes: float, samples: int, batch: int = 1) -> Path:
    """A MatMul+Relu chain of 8192-wide layers (4096 below 0.5 GB) holding `gigabytes` of
    FP32 weights as external data, and `samples` random inputs; returns the model path."""
    path = folder / "model.onnx"
    if path.is_file() and (folder / "calib").is_dir():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    width = 8192 if gigabytes >= 0.5 else 4096
    layers = max(1, round(gigabytes * 1e9 / (width * width * 4)))
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((width, width), dtype=np.float32) * (2.0 / width) ** 0.5)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"], name=f"mm{i}"))
        nodes.append(helper.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}"))
        x = f"r{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [batch, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024)
    calib = folder / "calib"
    calib.mkdir(exist_ok=True)
    for i in range(samples):
        np.savez(calib / f"{i:03d}.npz", x=rng.standard_normal((batch, width)).astype(np.float32))
    return path


def build_transformer_model(folder: Path, samples: int) -> Path:
    """bench_calibrate's transformer (8 layers, d=768: 227 MB of FP32 weights) as external data,
    and `samples` random inputs of shape [1, 128, 768]."""
    path = folder / "model.onnx"
    if path.is_file() and (folder / "calib").is_dir():
        return path
    sys.path.insert(0, str(HERE))
    from bench_calibrate import build_transformer

    folder.mkdir(parents=True, exist_ok=True)
    onnx.save_model(build_transformer(layers=8), str(path), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)
    rng = np.random.default_rng(0)
    (folder / "calib").mkdir(exist_ok=True)
    for i in range(samples):
        np.savez(folder / "calib" / f"{i:03d}.npz", x=rng.standard_normal((1, 128, 768)).astype(np.float32))
    return path


def commands(what: str, model: Path, folder: Path) -> list[str] | None:
    exe = Path(sys.executable).parent / "npuprep"
    if what.startswith("convert_"):
        precision = what.removeprefix("convert_")
        return [str(exe), "convert", str(model), "-t", "a2000", "--precision", precision, "--data",
                str(folder / "calib"), "-o", str(folder / "out" / f"model.a2000.{precision}.onnx"),
                "--export", "none"]
    if what == "plain":
        return [sys.executable, "-c", PLAIN, str(model), str(folder / "calib")]
    if what == "calibrate":
        return [str(exe), "calibrate", str(model), "--data", str(folder / "calib"), "-o", str(folder / "stats.json")]
    if what == "convert":
        return [str(exe), "convert", str(model), "-t", "a2000", "--data", str(folder / "calib"),
                "-o", str(folder / "out" / "model.a2000.onnx"), "--export", "none"]
    if what == "autocast" and MODELOPT.is_file():
        return [str(MODELOPT), "-m", "modelopt.onnx.autocast", "--onnx_path", str(model),
                "--output_path", str(folder / "out" / "model.autocast.onnx"), "--low_precision_type",
                "fp16", "--calibration_data", str(folder / "calib"), "--keep_io_types", "--providers", "cpu"]
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="0.2,1,2.4", help="chain models, GB of weights ('' for none)")
    ap.add_argument("--transformer", action="store_true", help="also the 227 MB transformer (16 samples)")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--cpus", default="", help="taskset CPU list for every process, e.g. 0,1")
    ap.add_argument("--out", default=str(HERE / "_work" / "scale"))
    ap.add_argument("--only", default="plain,calibrate,convert,autocast")
    ap.add_argument("--max-rss-mb", type=int, default=0,
                    help="kill a run whose resident memory passes this (0: never)")
    ap.add_argument("--precision", default="fp16",
                    help="convert's precisions, e.g. fp16,int8,fp8_e4m3 (fp16 is `convert`)")
    args = ap.parse_args()
    converts = [p if p == "fp16" else f"convert_{p}" for p in args.precision.split(",") if p]
    only = [w for x in args.only.split(",")
            for w in ([c.replace("fp16", "convert") for c in converts] if x == "convert" else [x])]
    out = Path(args.out)
    models = [(f"{size:g}GB", build_chain(out / f"{size:g}GB", size, args.samples))
              for size in (float(s) for s in args.sizes.split(",") if s)]
    if args.transformer:
        models.append(("transformer", build_transformer_model(out / "transformer", 16)))
    pin = ["taskset", "-c", args.cpus] if args.cpus else []
    rows = []
    for name, model in models:
        folder = model.parent
        weights = (folder / "model.onnx.data").stat().st_size / 1e9
        row: dict[str, object] = {"model": name, "size_gb": round(weights, 3)}
        for what in only:
            cmd = commands(what, model, folder)
            if cmd is None:
                row[what] = {"skipped": "no modelopt venv"}
                continue
            runs = []
            # Each measurement in its own python so ru_maxrss is that process's alone.
            for _ in range(args.repeat):
                wrapper = [sys.executable, str(Path(__file__).resolve()), "--child", str(args.max_rss_mb),
                           *pin, *cmd]
                runs.append(json.loads(subprocess.run(wrapper, capture_output=True, text=True).stdout or "{}"))
            if not all("seconds" in r for r in runs):
                row[what] = {"skipped": "killed (out of memory?)"}
                continue
            row[what] = {"seconds": statistics.median(r["seconds"] for r in runs),
                         "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
                         "rc": runs[-1]["rc"], "stderr_tail": runs[-1]["stderr_tail"], "runs": runs}
            print(name, what, {k: v for k, v in row[what].items() if k != "runs"}, flush=True)
        rows.append(row)
    (out / "result.json").write_text(json.dumps(rows, indent=1))
    whats = only
    converted = [w for w in whats if w.startswith("convert")]
    lines = ["| model | weights GB | " + " | ".join(f"{w} s / MB" for w in whats)
             + "".join(f" | {w} peak / plain | {w} time / calibrate" for w in converted) + " |",
             "|---|---|" + "---|" * len(whats) + "---|---|" * len(converted)]
    for r in rows:
        cells = []
        for w in whats:
            m = r.get(w) or {}
            cells.append(f"{m['seconds']:g} / {m['peak_rss_mb']:g}" + (f" (exit {m['rc']})" if m.get("rc") else "")
                         if "seconds" in m else m.get("skipped", "-"))
        lines.append(f"| {r['model']} | {r['size_gb']} | " + " | ".join(cells)
                     + "".join(f" | {_ratio(r, w, 'plain', 'peak_rss_mb')} | {_ratio(r, w, 'calibrate', 'seconds')}"
                               for w in converted) + " |")
    (out / "result.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _ratio(row: dict, a: str, b: str, key: str) -> str:
    if "seconds" in (row.get(a) or {}) and "seconds" in (row.get(b) or {}):
        return f"{row[a][key] / row[b][key]:.2f}x"
    return "-"


def child(max_rss_mb: int, cmd: list[str]) -> None:
    """Run `cmd`, killed once its resident memory passes `max_rss_mb` (0: never) so that a
    run that would take the shared machine's memory ends as a row instead."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
        killed = ""
        while proc.poll() is None:
            time.sleep(0.2)
            if max_rss_mb and _rss_mb(proc.pid) > max_rss_mb:
                proc.kill()
                killed = f"killed past {max_rss_mb} MB resident"
        proc.wait()
        err.seek(0)
        lines = err.read().strip().splitlines()
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"seconds": round(wall, 1), "rc": proc.returncode, "peak_rss_mb": round(peak / 1024),
                      "stderr_tail": killed or (lines or [""])[-1][:160]}))


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3:])
    else:
        main()
