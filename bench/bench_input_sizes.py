"""What a sample's size costs convert: peak resident memory over the largest node's activations.

Run: nice python bench/bench_input_sizes.py [--det-side 640]

For an elementwise chain (x[1,n] -> Mul -> Exp -> Add) and the corpus's DBNet text detector
(ppocr_det, x[1,3,S,S]) it runs `npuprep convert --synthetic 2 --input-shape ...` at a small
and a large size and prints, per model, the largest node's inputs + outputs (npuprep.sample_size)
and (peak at the large size - peak at the small one) / that: the multiple RUN_FACTOR stands for.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.sample_size import sample_size

CORPUS = Path.home() / ".cache/npuprep/corpus"


def chain(path: Path) -> Path:
    """x[1,n] -> Mul(2) -> Exp -> Add(2) -> y."""
    k = numpy_helper.from_array(np.array(2, np.float32), "k")
    g = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["a"]), helper.make_node("Exp", ["a"], ["e"]),
         helper.make_node("Add", ["e", "k"], ["y"])], "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "n"])], [k])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def peak_mb(model: Path, shape: str, work: Path) -> tuple[float, float]:
    out = work / "out.onnx"
    subprocess.run([sys.executable, "-m", "npuprep", "convert", str(model), "-t", "a2000",
                    "--synthetic", "2", "--input-shape", shape, "-o", str(out), "--json"],
                   capture_output=True, text=True, cwd=work, check=False)
    res = json.loads(out.with_suffix(".report.json").read_text())["resources"]
    return res["peak_rss_mb"], res["wall_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--det-side", type=int, default=640)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cases = [("chain", chain(work / "chain.onnx"), "x", (1, 1000), (1, 10_000_000))]
        det = CORPUS / "ppocr_det/model.onnx"
        if det.exists():
            cases.append(("ppocr_det", det, "x", (1, 3, 32, 32), (1, 3, args.det_side, args.det_side)))
        print("model      large shape      largest node MB  peak small MB  peak large MB  wall s  factor")
        for name, path, inp, small, large in cases:
            model = onnx.load(path)
            node_mb = sample_size(model, {inp: large}).node_bytes / 2**20
            lo, _ = peak_mb(path, f"{inp}:{'x'.join(map(str, small))}", work)
            hi, wall = peak_mb(path, f"{inp}:{'x'.join(map(str, large))}", work)
            print(f"{name:<10} {'x'.join(map(str, large)):<16} {node_mb:>15.1f}  {lo:>13.0f}  "
                  f"{hi:>13.0f}  {wall:>6.1f}  {(hi - lo) / node_mb:>5.1f}x")


if __name__ == "__main__":
    main()
