"""Time crosscheck on a deep model: TensorRT layer JSON read, ForeignNode expansion, verdicts.

    .venv/bin/python bench/bench_crosscheck.py [--blocks 400]

Builds a chain of BLOCKS blocks (MatMul, then a decomposed LayerNorm: ReduceMean, Sub, Pow,
ReduceMean, Add, Sqrt, Div), and two TensorRT reports for it: one with a
`{ForeignNode[first...last]}` range per block and no Metadata (TensorRT < 8.6), one with
Metadata listing every node. Prints seconds per stage (one run each, no warm-up).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npuprep.analyse import static_findings  # noqa: E402
from npuprep.crosscheck.check import crosscheck  # noqa: E402
from npuprep.crosscheck.names import NodeIndex  # noqa: E402
from npuprep.crosscheck.readers import read_report  # noqa: E402
from npuprep.model_io import load_model  # noqa: E402
from npuprep.profiles import load_profile  # noqa: E402

WIDTH = 16
LN_OPS = ("ReduceMean", "Sub", "Pow", "ReduceMean", "Add", "Sqrt", "Div")


def build(blocks: int) -> tuple[onnx.ModelProto, list[list[str]]]:
    nodes, inits, names = [], [], []
    inits.append(numpy_helper.from_array(np.eye(WIDTH, dtype=np.float32), "W"))
    inits.append(numpy_helper.from_array(np.array(2.0, np.float32), "two"))
    inits.append(numpy_helper.from_array(np.array(1e-5, np.float32), "eps"))
    x = "x"
    for b in range(blocks):
        p = f"/b{b}"
        block = [f"{p}/MatMul", f"{p}/ln/mean", f"{p}/ln/sub", f"{p}/ln/pow", f"{p}/ln/var",
                 f"{p}/ln/add", f"{p}/ln/sqrt", f"{p}/ln/div"]
        nodes += [
            helper.make_node("MatMul", [x, "W"], [f"{p}/h"], name=block[0]),
            helper.make_node("ReduceMean", [f"{p}/h"], [f"{p}/m"], name=block[1], axes=[-1]),
            helper.make_node("Sub", [f"{p}/h", f"{p}/m"], [f"{p}/c"], name=block[2]),
            helper.make_node("Pow", [f"{p}/c", "two"], [f"{p}/sq"], name=block[3]),
            helper.make_node("ReduceMean", [f"{p}/sq"], [f"{p}/v"], name=block[4], axes=[-1]),
            helper.make_node("Add", [f"{p}/v", "eps"], [f"{p}/ve"], name=block[5]),
            helper.make_node("Sqrt", [f"{p}/ve"], [f"{p}/sd"], name=block[6]),
            helper.make_node("Div", [f"{p}/c", f"{p}/sd"], [f"{p}/y"], name=block[7]),
        ]
        names.append(block)
        x = f"{p}/y"
    graph = helper.make_graph(
        nodes, "deep", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, WIDTH])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), names


def reports(names: list[list[str]]) -> tuple[dict, dict]:
    def io(fmt: str) -> dict:
        return {"Inputs": [{"Name": "t", "Format/Datatype": fmt}],
                "Outputs": [{"Name": "t", "Format/Datatype": fmt}]}

    ranges = {"Layers": []}
    metadata = {"Layers": []}
    for block in names:
        ranges["Layers"].append({"Name": block[0], "LayerType": "gemm", **io("Row major linear FP16 format")})
        ranges["Layers"].append({"Name": f"{{ForeignNode[{block[1]}...{block[-1]}]}}",
                                 "LayerType": "Myelin", **io("Half")})
        metadata["Layers"].append({"Name": f"__myl_{block[0]}", "LayerType": "kgen", **io("Half"),
                                   "Metadata": "\x1f".join(f"[ONNX Layer: {n}]" for n in block)})
    return ranges, metadata


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=400)
    args = parser.parse_args()
    model_proto, names = build(args.blocks)
    profile = load_profile("orin")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "deep.onnx"
        onnx.save(model_proto, path)
        model = load_model(path)
        t0 = time.perf_counter()
        index = NodeIndex(model)
        t_index = time.perf_counter() - t0
        t0 = time.perf_counter()
        findings = static_findings(model, profile.resolve())
        t_findings = time.perf_counter() - t0
        print(f"model: {len(model.graph.node)} nodes; NodeIndex {t_index:.3f} s; "
              f"static_findings {t_findings:.3f} s ({len(findings)} findings)")
        for label, report in zip(("ForeignNode ranges", "Metadata"), reports(names), strict=True):
            rpath = Path(tmp) / "layers.json"
            rpath.write_text(json.dumps(report))
            t0 = time.perf_counter()
            parsed = read_report(rpath, index)
            t_read = time.perf_counter() - t0
            t0 = time.perf_counter()
            result = crosscheck(model, parsed, profile.resolve(), findings=findings, index=index)
            t_check = time.perf_counter() - t0
            print(f"{label}: {len(parsed.records)} layers read in {t_read:.3f} s; verdicts in "
                  f"{t_check:.3f} s; counts {result.counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
