"""convert at scale: a chain of width x width MatMul+Relu layers stored as external data.

Run: python bench/bench_convert_scale.py [--sizes 0.2,1,2.4] [--samples 4] [--out bench/_work/scale]

Per size (GB of weights): builds the model (bench/_work/scale/GB/model.onnx + model.onnx.data,
kept between runs) and its samples, then times three whole processes, each with its peak RSS
(ru_maxrss of the child): plain onnxruntime inference of the model on the samples, `npuprep
calibrate`, and `npuprep convert --target a2000`. Writes OUT.md (the table for BENCHMARKS.md)
and OUT.json. The machine must have the weights' size free on disk per model.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="0.2,1,2.4")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--out", default=str(HERE / "_work" / "scale"))
    ap.add_argument("--only", default="plain,calibrate,convert")
    args = ap.parse_args()
    out = Path(args.out)
    exe = Path(sys.executable).parent / "npuprep"
    rows = []
    for size in (float(s) for s in args.sizes.split(",")):
        folder = out / f"{size:g}GB"
        model = build_chain(folder, size, args.samples)
        weights = (folder / "model.onnx.data").stat().st_size / 1e9
        row: dict[str, object] = {"size_gb": round(weights, 2)}
        # Each measurement in its own python so ru_maxrss is that process's alone.
        for what in args.only.split(","):
            if what == "plain":
                cmd = [sys.executable, "-c", PLAIN, str(model), str(folder / "calib")]
            elif what == "calibrate":
                cmd = [str(exe), "calibrate", str(model), "--data", str(folder / "calib"),
                       "-o", str(folder / "stats.json")]
            else:
                cmd = [str(exe), "convert", str(model), "-t", "a2000", "--data", str(folder / "calib"),
                       "-o", str(folder / "out" / "model.a2000.onnx"), "--export", "none"]
            wrapper = [sys.executable, str(Path(__file__).resolve()), "--child", *cmd]
            row[what] = json.loads(subprocess.run(wrapper, capture_output=True, text=True).stdout or "{}")
            print(size, what, row[what], flush=True)
        rows.append(row)
    (out / "result.json").write_text(json.dumps(rows, indent=1))
    lines = ["| weights GB | plain s / MB | calibrate s / MB | convert s / MB (exit) |", "|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[w]['seconds']} / {r[w]['peak_rss_mb']}" + (f" ({r[w]['rc']})" if w == "convert" else "")
                 if isinstance(r.get(w), dict) and r[w] else "-" for w in ("plain", "calibrate", "convert")]
        lines.append(f"| {r['size_gb']} | " + " | ".join(cells) + " |")
    (out / "result.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def child(cmd: list[str]) -> None:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    tail = (proc.stderr.strip().splitlines() or [""])[-1][:160]
    print(json.dumps({"seconds": round(wall, 1), "rc": proc.returncode, "peak_rss_mb": round(peak / 1024),
                      "stderr_tail": tail}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        main()
