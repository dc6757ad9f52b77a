"""Benchmark: layer-by-layer compare of a >= 100 MB model with its FP16 emulation.

Side by side in one run, each phase in its own child process (so its peak RSS is its own):
  plain-ref   FP32 model: session + N samples
  plain-emu   its emulation: session + N samples
  compare     compare_models(ref, emulation): merged graph, session, N samples
  isolate     the same with --isolate
Reported: wall seconds per phase (model in memory -> result, session creation included),
per-sample seconds after a warm-up run (median and min), peak RSS, and the ratio
compare / (plain-ref + plain-emu).

    .venv/bin/python bench/bench_compare.py [--layers 4] [--samples 8] [--threads 2] [--rounds 3]
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
    """One measured phase, run in this (child) process."""
    from npuprep.numerics import get_format
    from npuprep.runtime.session import make_session, run
    from npuprep.verify.compare import compare_models
    from npuprep.verify.merge import merged_graph

    ref = onnx.load(str(WORK / "ref.onnx"))
    feeds = samples(count)
    if name in ("plain-ref", "plain-emu"):
        model = ref if name == "plain-ref" else onnx.load(str(WORK / "emu.onnx"))
        t_load = time.perf_counter()
        session = make_session(model, threads=threads)
        t_session = time.perf_counter()
        steps = []
        for feed in feeds:
            t = time.perf_counter()
            run(session, feed)
            steps.append(time.perf_counter() - t)
        return {"wall_s": time.perf_counter() - t_load, "session_s": t_session - t_load,
                **_steady(steps), "peak_rss_mb": peak_rss_mb()}
    emu = onnx.load(str(WORK / "emu.onnx"))
    t_load = time.perf_counter()
    isolate = name == "isolate"
    result = compare_models(ref, emu, feeds, rtol=1e-2, atol=1e-3, fmt=get_format("fp16"), isolate=isolate,
                            threads=threads)
    wall = time.perf_counter() - t_load
    # Steady state of the merged graph alone (the part that scales with the samples).
    from npuprep.verify.compare import _pairs

    pairs = _pairs(ref, emu, {})[0]
    model, layout = merged_graph(ref, emu, pairs, limit=65504.0, isolate=isolate)
    session = make_session(model, threads=threads)
    steps = []
    for feed in feeds:
        t = time.perf_counter()
        run(session, feed, list(layout.stats))
        steps.append(time.perf_counter() - t)
    return {"wall_s": wall, **_steady(steps), "peak_rss_mb": peak_rss_mb(),
            "tensors": len(result.tensors), "passed": bool(result)}


def _steady(steps: list[float]) -> dict[str, float]:
    """Per-sample time after the first (warm-up) run: median and min (least disturbed)."""
    rest = sorted(steps[1:]) or steps
    return {"per_sample_s": rest[len(rest) // 2], "per_sample_min_s": rest[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; best of each phase kept")
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
    # Phases interleave over rounds; each keeps its best round (least disturbed by neighbours).
    results: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name in ("plain-ref", "plain-emu", "compare", "isolate"):
            proc = subprocess.run([sys.executable, __file__, "--phase", name, "--samples", str(args.samples),
                                   "--threads", str(args.threads)],
                                  capture_output=True, text=True, check=True)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(name, r, flush=True)
            best = results.setdefault(name, r)
            for key in ("wall_s", "per_sample_s", "per_sample_min_s", "peak_rss_mb"):
                best[key] = min(best[key], r[key]) if key != "peak_rss_mb" else max(best[key], r[key])
    plain_wall = results["plain-ref"]["wall_s"] + results["plain-emu"]["wall_s"]
    plain_step = results["plain-ref"]["per_sample_s"] + results["plain-emu"]["per_sample_s"]
    plain_min = results["plain-ref"]["per_sample_min_s"] + results["plain-emu"]["per_sample_min_s"]
    for name in ("compare", "isolate"):
        r = results[name]
        print(f"{name}: wall {r['wall_s']:.2f} s vs plain ref+emu {plain_wall:.2f} s = "
              f"{r['wall_s'] / plain_wall:.2f}x; per sample {r['per_sample_s'] * 1e3:.0f} ms vs "
              f"{plain_step * 1e3:.0f} ms = {r['per_sample_s'] / plain_step:.2f}x (min: "
              f"{r['per_sample_min_s'] / plain_min:.2f}x); peak RSS "
              f"{r['peak_rss_mb']:.0f} MB (plain ref {results['plain-ref']['peak_rss_mb']:.0f}, "
              f"emu {results['plain-emu']['peak_rss_mb']:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
