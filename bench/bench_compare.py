"""Benchmark: layer-by-layer compare of a >= 100 MB model with its FP16 emulation.

Side by side in one run, each phase in its own child process (so its peak RSS is its own):
  plain-ref   FP32 model: session + N samples
  plain-emu   its FP16 emulation: session + N samples
  compare     compare_models(ref, emulation): merged graph, session, N samples, result
  isolate     the same with isolate=True
  steady      per-sample time of the four sessions run round robin in one process (other
              load on a shared machine then hits them alike)
Reported: wall seconds (models in memory -> result, session creation included), per-sample
milliseconds (min and median after a warm-up round), peak RSS, and the ratios to
plain-ref + plain-emu.

    .venv/bin/python bench/bench_compare.py [--layers 4] [--samples 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

WORK = Path(__file__).resolve().parent / "_work"
SEQ, HIDDEN, HEADS, FFN = 128, 768, 12, 3072


def build_transformer(layers: int) -> onnx.ModelProto:
    """A BERT-base-like encoder (pre-LN, 12 heads, GELU FFN); 4 layers ~ 113 MB of weights."""
    rng = np.random.default_rng(0)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def w(name: str, *shape: int, scale: float = 0.02) -> str:
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def n(op: str, inputs: list[str], out: str, **attrs: object) -> str:
        nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    inits += [numpy_helper.from_array(np.array([1, SEQ, HEADS, HIDDEN // HEADS], np.int64), "heads_shape"),
              numpy_helper.from_array(np.array([1, SEQ, HIDDEN], np.int64), "model_shape"),
              numpy_helper.from_array(np.array(1 / np.sqrt(HIDDEN // HEADS), np.float32), "attn_scale")]
    x = "x"
    for i in range(layers):
        p = f"l{i}_"
        h = n("LayerNormalization", [x, w(p + "ln1_g", HIDDEN, scale=1.0), w(p + "ln1_b", HIDDEN)], p + "ln1",
              axis=-1)
        q, k, v = (n("Add", [n("MatMul", [h, w(p + f"w{c}", HIDDEN, HIDDEN)], p + f"{c}_mm"),
                             w(p + f"b{c}", HIDDEN)], p + c) for c in "qkv")
        qh, kh, vh = (n("Transpose", [n("Reshape", [t, "heads_shape"], t + "_r")], t + "_t", perm=perm)
                      for t, perm in ((q, [0, 2, 1, 3]), (k, [0, 2, 3, 1]), (v, [0, 2, 1, 3])))
        scores = n("Mul", [n("MatMul", [qh, kh], p + "scores_mm"), "attn_scale"], p + "scores")
        ctx = n("MatMul", [n("Softmax", [scores], p + "probs", axis=-1), vh], p + "ctx")
        ctx = n("Reshape", [n("Transpose", [ctx], p + "ctx_t", perm=[0, 2, 1, 3]), "model_shape"], p + "ctx_r")
        attn = n("Add", [n("MatMul", [ctx, w(p + "wo", HIDDEN, HIDDEN)], p + "o_mm"), w(p + "bo", HIDDEN)], p + "o")
        x = n("Add", [x, attn], p + "res1")
        h = n("LayerNormalization", [x, w(p + "ln2_g", HIDDEN, scale=1.0), w(p + "ln2_b", HIDDEN)], p + "ln2",
              axis=-1)
        f = n("Add", [n("MatMul", [h, w(p + "w1", HIDDEN, FFN)], p + "ff1_mm"), w(p + "b1", FFN)], p + "ff1")
        f = n("Gelu", [f], p + "gelu", domain="com.microsoft")
        f = n("Add", [n("MatMul", [f, w(p + "w2", FFN, HIDDEN)], p + "ff2_mm"), w(p + "b2", HIDDEN)], p + "ff2")
        x = n("Add", [x, f], p + "res2")
    n("Identity", [x], "y")
    graph = helper.make_graph(nodes, "encoder", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, HIDDEN])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ, HIDDEN])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=8)


def samples(count: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((1, SEQ, HIDDEN)).astype(np.float32)} for _ in range(count)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def phase(name: str, count: int, threads: int | None) -> dict[str, float]:
    """One measured phase, run in this (child) process: wall time from models in memory to
    result (session creation included) and the process's peak RSS."""
    from npuprep.numerics import get_format
    from npuprep.runtime.session import make_session, run
    from npuprep.verify.compare import compare_models

    ref = onnx.load(str(WORK / "ref.onnx"))
    emu = onnx.load(str(WORK / "emu.onnx"))
    feeds = samples(count)
    if name == "steady":
        return steady(ref, emu, feeds, threads)
    t0 = time.perf_counter()
    if name in ("plain-ref", "plain-emu"):
        session = make_session(ref if name == "plain-ref" else emu, threads=threads)
        for feed in feeds:
            run(session, feed)
        return {"wall_s": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}
    result = compare_models(ref, emu, feeds, rtol=1e-2, atol=1e-3, fmt=get_format("fp16"),
                            isolate=name == "isolate", threads=threads)
    return {"wall_s": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb(),
            "tensors": len(result.tensors), "passed": bool(result)}


def steady(ref: onnx.ModelProto, emu: onnx.ModelProto, feeds: list, threads: int | None) -> dict[str, float]:
    """Per-sample time of the four sessions, run round robin on the same samples so that
    load from other processes hits all of them alike; min and median over the runs."""
    from npuprep.runtime.session import make_session, run
    from npuprep.verify.compare import _layout_aliases, _pairs, _session
    from npuprep.verify.compare_graph import merged_graph

    pairs = _layout_aliases(ref, emu, _pairs(ref, emu, {})[0], {})[0]
    sessions = {"plain-ref": (make_session(ref, threads=threads), None),
                "plain-emu": (make_session(emu, threads=threads), None)}
    for name, isolate in (("compare", False), ("isolate", True)):
        model, layout = merged_graph(ref, emu, pairs, limit=65504.0, isolate=isolate)
        sessions[name] = (_session(model, threads), list(layout.stats))
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for i, feed in enumerate(feeds):
        for name, (session, outputs) in sessions.items():
            t = time.perf_counter()
            run(session, feed, outputs)
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - t)
    out = {}
    for name, ts in times.items():
        ts.sort()
        out[name + "_min_s"], out[name + "_median_s"] = ts[0], ts[len(ts) // 2]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: its default)")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase, args.samples, args.threads or None)))
        return 0

    from npuprep.numerics import get_format
    from npuprep.verify.emulate import emulate

    WORK.mkdir(parents=True, exist_ok=True)
    ref = build_transformer(args.layers)
    onnx.save(ref, str(WORK / "ref.onnx"))
    emu = emulate(ref, get_format("fp16"), saturate=False).model
    onnx.save(emu, str(WORK / "emu.onnx"))
    size_mb = (WORK / "ref.onnx").stat().st_size / 1e6
    import onnxruntime

    print(f"onnxruntime {onnxruntime.__version__}, {os.cpu_count()} CPUs, threads "
          f"{args.threads or 'default'}")
    print(f"model: {args.layers}-layer encoder, {size_mb:.0f} MB, {len(ref.graph.node)} nodes; "
          f"emulation {len(emu.graph.node)} nodes; {args.samples} samples of [1, {SEQ}, {HIDDEN}]")
    results: dict[str, dict] = {}
    for name in ("plain-ref", "plain-emu", "compare", "isolate", "steady"):
        proc = subprocess.run([sys.executable, __file__, "--phase", name, "--samples", str(args.samples),
                               "--threads", str(args.threads)],
                              capture_output=True, text=True, check=True)
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(name, results[name], flush=True)
    wall = {k: results[k]["wall_s"] for k in ("plain-ref", "plain-emu", "compare", "isolate")}
    rss = {k: results[k]["peak_rss_mb"] for k in wall}
    st = results["steady"]
    plain_wall = wall["plain-ref"] + wall["plain-emu"]
    print("| phase | wall (s) | x plain ref+emu | per sample min / median (ms) | x plain ref+emu (min) | peak RSS (MB) |")
    print("|---|---|---|---|---|---|")
    plain_min = st["plain-ref_min_s"] + st["plain-emu_min_s"]
    for name in wall:
        ratio = f"{wall[name] / plain_wall:.2f}" if name in ("compare", "isolate") else ""
        step = f"{st[name + '_min_s'] * 1e3:.0f} / {st[name + '_median_s'] * 1e3:.0f}"
        sratio = f"{st[name + '_min_s'] / plain_min:.2f}" if name in ("compare", "isolate") else ""
        print(f"| {name} | {wall[name]:.2f} | {ratio} | {step} | {sratio} | {rss[name]:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
