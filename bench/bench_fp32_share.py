"""FP32 share of the converted zoo: FLOPs and Conv/MatMul/Gemm multiply-adds left in FP32.

Run: python bench/bench_fp32_share.py [--target generic] [--out bench/_work/fp32_share.md]

Each model of `examples/zoo.py`, the bundled planner and the hazard shapes of the FP16-share
issue (built here, 64 x 256) is calibrated on its samples and converted; the outputs of the lowered model are judged under emulated FP16 (explicit Cast
pairs, npuprep.verify.emulate_lowered). The shares are computed here from the pinned nodes and the
per-node FLOPs, so the same script measures any version of `convert`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.data import load_samples
from npuprep.examples import example_data_dir, example_model_path
from npuprep.examples.zoo import ZOO
from npuprep.flops import node_flops
from npuprep.graph import node_label, walk_graphs
from npuprep.model_io import load_model
from npuprep.profiles import load_profile

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


def _parsed(text: str, **weights: np.ndarray) -> onnx.ModelProto:
    proto = parser.parse_model(text)
    for name, value in weights.items():
        proto.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    return proto


def issue_cases() -> dict[str, tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]]:
    """The hazard shapes of the FP16-share issue, at the sizes of a small transformer block."""
    rng = np.random.default_rng(0)
    d, n = 256, 64
    head = '<ir_version: 8, opset_import: ["" : 17]>'
    w = (rng.standard_normal((d, d)) / 16).astype(np.float32)
    w[:, 3] = rng.standard_normal(d).astype(np.float32) * 2e3  # an outlier column
    residual = _parsed(head + f"""
    g (float[{n}, {d}] x) => (float[{n}, {d}] y) {{
        [proj] p = MatMul (x, W)
        [bias] pb = Add (p, b)
        [res] h = Add (pb, x)
        [ln] m = LayerNormalization <axis = -1> (h, gamma, beta)
        [out] y = MatMul (m, W2)
    }}""", W=w, b=rng.standard_normal(d).astype(np.float32),
        W2=(rng.standard_normal((d, d)) / 16).astype(np.float32),
        gamma=np.ones(d, np.float32), beta=np.zeros(d, np.float32))
    softmax = _parsed(head + f"""
    g (float[{n}, {d}] x) => (float[{n}, {d}] y) <int64[1] ax = {{1}}> {{
        [fc] l = MatMul (x, W)
        [exp] e = Exp (l)
        [sum] s = ReduceSum <keepdims = 1> (e, ax)
        [div] y = Div (e, s)
    }}""", W=(rng.standard_normal((d, d)) * 2.5 / 16).astype(np.float32))
    headroom = _parsed(head + f"""
    g (float[{n}, {d}] x) => (float[{n}, {d}] y, float[{n}, {d}] g) <float c = {{0.56}}> {{
        [sq] q = Mul (x, x)
        [mulc] z = Mul (q, c)
        [mm] y = MatMul (z, W)
        [sig] g = Sigmoid (x)
    }}""", W=(rng.standard_normal((d, d)) * 1e-3).astype(np.float32))
    classifier = _parsed(head + f"""
    g (float[{n}, {d}] x) => (float[{n}, 10] y) {{
        [fc] y = Gemm (x, W, b)
    }}""", W=(rng.standard_normal((d, 10)) * 3e-10 / 4).astype(np.float32),
        b=(rng.standard_normal(10) * 1e-9).astype(np.float32))

    then_branch = parser.parse_graph(f"""thenb () => (float[{n}, {d}] t) <float three = {{3.0}}> {{
        [m3] x3 = Mul (x, three)
        [exp3] t = Exp (x3)
    }}""")
    else_branch = parser.parse_graph(f"elseb () => (float[{n}, {d}] e) {{ [neg] e = Neg (x) }}")
    branch = parser.parse_model(head + f"""
    g (float[{n}, {d}] x, bool c) => (float[{n}, {d}] y) {{ [branch] y = If (c) }}""")
    branch.graph.node[0].attribute.extend([helper.make_attribute("then_branch", then_branch),
                                           helper.make_attribute("else_branch", else_branch)])
    branch_feeds = [{"x": rng.uniform(-5, 5, (n, d)).astype(np.float32), "c": np.array(True)}
                    for _ in range(4)]

    def feeds(scale: float, spike: float = 0.0) -> list[dict[str, np.ndarray]]:
        out = [{"x": (rng.standard_normal((n, d)) * scale).astype(np.float32)} for _ in range(4)]
        if spike:
            out[0]["x"][0, 0] = spike
        return out

    return {"issue: residual domain": (residual, feeds(2.0)),
            "issue: softmax, MatMul logits ~30": (softmax, feeds(1.0)),
            "issue: 3.8e4 next to a MatMul": (headroom, feeds(1.0, 260.0)),
            "issue: logits ~1e-9": (classifier, feeds(1.0)),
            "issue: If branch Exp(3x), x up to 5": (branch, branch_feeds)}


def cases(tmp: Path) -> list[tuple[str, object, object]]:
    rows = []
    built = {name: (z.model, z.samples) for name, z in ((n, b()) for n, b in ZOO.items())}
    for i, (name, (proto, feeds)) in enumerate({**built, **issue_cases()}.items()):
        path = tmp / f"model_{i}.onnx"
        onnx.save(proto, path)
        data = tmp / f"data_{i}"
        data.mkdir()
        for j, feed in enumerate(feeds):
            np.savez(data / f"sample_{j:03d}.npz", **feed)
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
            try:
                result = convert(model, profile, list(samples), stats=calibrate(model, samples))
            except Exception as exc:  # noqa: BLE001 - a crash of an older version is a result
                lines.append(f"| {name} | error: {type(exc).__name__}: {str(exc)[:60]} | | | | |")
                print(lines[-1], flush=True)
                continue
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
