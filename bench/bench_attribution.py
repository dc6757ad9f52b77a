"""How stable a corpus model's FP16 error is, and what pinning its worst layers buys.

Run: python bench/bench_attribution.py [--model ppocr_rec] [--target generic]

On the graph convert plans (npuprep.rewrite.passes.prepare_for_target), emulated in FP16 (every node but the
pinned ones rounded), per sample of calib + heldout:
- rel L2 of the first output under onnxruntime's basic and full graph optimisations: the same
  arithmetic in another FP32 summation order, so any difference is how much the model
  amplifies the last bit of an FP16 rounding (a knife-edge sample);
- npuprep.verify.attribution's ranking of the Conv/MatMul/Gemm layers (each alone rounded);
- the errors again with the top-ranked layers kept FP32, greedily within 2%, 5% and 10% of
  the FLOPs: whether the error falls as the layers' shares predict.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402 - the sibling script, run from anywhere

from npuprep.flops import node_flops  # noqa: E402
from npuprep.graph import node_label  # noqa: E402
from npuprep.model_io import load_model  # noqa: E402
from npuprep.numerics import get_format  # noqa: E402
from npuprep.ops import MAC_OPS  # noqa: E402
from npuprep.profiles import load_profile  # noqa: E402
from npuprep.rewrite.passes import prepare_for_target  # noqa: E402
from npuprep.verify.attribution import attribute_error  # noqa: E402
from npuprep.verify.emulate import emulate  # noqa: E402

LEVELS = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
          "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}


def session(proto, level: str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = LEVELS[level]
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def per_sample(model, fmt, pinned: set[str], samples, level: str) -> np.ndarray:
    ref = session(model, level)
    emu = session(emulate(model, fmt, saturate=False, pinned_nodes=pinned).model, level)
    errors = []
    for feed in samples:
        r, c = ref.run(None, feed)[0], emu.run(None, feed)[0]
        errors.append(np.linalg.norm(c - r) / np.linalg.norm(r))
    return np.array(errors)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ppocr_rec")
    ap.add_argument("--target", default="generic")
    args = ap.parse_args()
    root = corpus.corpus_dir()
    entry = corpus.build_one(corpus.SPECS[args.model], root)
    folder = root / args.model
    samples = [dict(np.load(p)) for sub in ("calib", "heldout")
               for p in sorted((folder / sub).glob("*.npz"))]
    work = prepare_for_target(load_model(str(root / entry["path"])),
                              load_profile(args.target).resolve()).model
    model, fmt = work.proto, get_format("fp16")
    shapes = {k: tuple(v.shape) for k, v in samples[0].items()}
    flops = node_flops(model, shapes)
    total = sum(flops.values())
    linear = [node_label(n) for n in model.graph.node if n.op_type in MAC_OPS]
    print(f"{args.model}: {len(samples)} samples (calib then heldout), {len(linear)} "
          f"Conv/MatMul/Gemm, {total:.3g} FLOPs")
    for level in LEVELS:
        print(f"all FP16, ORT {level:5}: {np.round(per_sample(model, fmt, set(), samples, level), 4)}")
    ranked = attribute_error(model, fmt, samples, saturate=False, candidates=linear, flops=flops)
    print("layers by their own FP16 error (share of the summed squared error, share of FLOPs):")
    for x in ranked.layers[:8]:
        print(f"  {x.node:24} {x.rel_l2:.4f}  {100 * x.share:5.1f}%  {100 * x.flops / total:.3f}%")
    for budget in (0.02, 0.05, 0.10):
        pins, spent, held = [], 0, 0.0
        for x in ranked.layers:
            if spent + x.flops <= budget * total:
                pins.append(x.node)
                spent, held = spent + x.flops, held + x.share
        for level in LEVELS:
            errors = per_sample(model, fmt, set(pins), samples, level)
            print(f"{len(pins):3} pinned ({100 * spent / total:4.1f}% FLOPs, {100 * held:3.0f}% "
                  f"of the squared error), ORT {level:5}: {np.round(errors, 4)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
