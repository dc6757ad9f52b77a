"""FP32 share of the converted zoo: FLOPs and Conv/MatMul/Gemm multiply-adds left in FP32.

Run: python bench/bench_fp32_share.py [--target generic] [--out bench/_work/fp32_share.md]

Each model of `examples/zoo.py` and the bundled planner is calibrated on its samples and
converted; the outputs of the lowered model are judged under emulated FP16 (explicit Cast
pairs, npuprep.verify.widen). The shares are computed here from the pinned nodes and the
per-node FLOPs, so the same script measures any version of `convert`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnx

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.data import load_samples
from npuprep.examples import example_data_dir, example_model_path
from npuprep.examples.zoo import ZOO
from npuprep.graph import node_label, walk_graphs
from npuprep.model_io import load_model
from npuprep.profiles import load_profile
from npuprep.report.flops import node_flops

LINEAR = ("Conv", "ConvTranspose", "MatMul", "Gemm")


def shares(model: onnx.ModelProto, pinned: set[str]) -> tuple[float, float]:
    """(FP32 share of FLOPs, FP32 share of Conv/MatMul/Gemm multiply-adds)."""
    flops = node_flops(model)
    ops = {node_label(n): n.op_type for s in walk_graphs(model.graph) for n in s.graph.node}
    total = sum(flops.values()) or 1
    macs = {k: v for k, v in flops.items() if ops.get(k) in LINEAR}
    total_macs = sum(macs.values()) or 1
    return (sum(v for k, v in flops.items() if k in pinned) / total,
            sum(v for k, v in macs.items() if k in pinned) / total_macs)


def cases(tmp: Path) -> list[tuple[str, object, object]]:
    rows = []
    for name, build in ZOO.items():
        z = build()
        path = tmp / f"{name}.onnx"
        onnx.save(z.model, path)
        data = tmp / name
        data.mkdir()
        for i, feed in enumerate(z.samples):
            np.savez(data / f"sample_{i:03d}.npz", **feed)
        model = load_model(path)
        rows.append((name, model, load_samples(data, model.proto)))
    planner = load_model(example_model_path())
    rows.append(("planner (bundled)", planner, load_samples(example_data_dir(), planner.proto)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="generic")
    ap.add_argument("--out", default="bench/_work/fp32_share.md")
    args = ap.parse_args()
    profile = load_profile(args.target)
    lines = ["| model | outputs under emulated FP16 | FP32 FLOPs | FP32 MACs | pinned nodes | actions |",
             "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, samples in cases(Path(tmp)):
            result = convert(model, profile, list(samples), stats=calibrate(model, samples))
            check = result.output_check
            worst = max((o["rel_l2"] for o in check.outputs.values()), default=0.0)
            bad = sum(int(o["nonfinite"]) for o in check.outputs.values())
            flops, macs = shares(result.rewritten, set(result.pinned_nodes))
            kinds = [a.action for a in result.plan.actions]
            summary = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds)) or "none"
            lines.append(f"| {name} | {'ok' if check else 'FAILED'}: {bad} Inf/NaN, rel L2 "
                         f"{worst:.2g} | {100 * flops:.1f}% | {100 * macs:.1f}% | "
                         f"{len(result.pinned_nodes)} | {summary} |")
            print(lines[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
