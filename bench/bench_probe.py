"""`npuprep probe MODEL` vs `npuprep compare MODEL --emulate` on the same transformer.

The probe amplifies one layer and runs the model three times (FP32 reference while raising
the gain, FP32 reference with every float tensor exposed, the emulation with every float
tensor exposed); compare runs the merged reference + emulation graph once. Both are timed
from a loaded model to the result, in this process, one sample, after a warm-up of neither
(a person waits for the first run). Also counted: shape-inference passes during the probe.

Model: bench_calibrate.py's transformer builder (768 hidden, 12 heads, 4 layers by default).

    .venv/bin/python bench/bench_probe.py [--layers 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_calibrate import build_transformer  # noqa: E402

from npuprep.data import synthetic_samples  # noqa: E402
from npuprep.numerics import get_format  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    model = build_transformer(layers=args.layers)
    feeds = next(iter(synthetic_samples(model, 1, seed=0)))
    fmt = get_format("fp16")
    floats = sum(1 for n in model.graph.node for _ in n.output)
    print(f"transformer: {args.layers} layers, {len(model.graph.node)} nodes, {floats} node outputs, "
          f"{model.ByteSize() / 1e6:.0f} MB")

    calls = [0]
    infer = onnx.shape_inference.infer_shapes

    def counting(*a, **k):
        calls[0] += 1
        return infer(*a, **k)

    onnx.shape_inference.infer_shapes = counting
    from npuprep.probe.backends import EmulateBackend
    from npuprep.probe.layer import probe_layer

    t0 = time.perf_counter()
    layer = probe_layer(model, feeds, fmt, EmulateBackend(fmt, saturate=False))
    probe_s = time.perf_counter() - t0
    probe_calls = calls[0]
    onnx.shape_inference.infer_shapes = infer

    from npuprep.verify.compare import compare_models
    from npuprep.verify.emulate import emulate

    t0 = time.perf_counter()
    compare_models(model, emulate(model, fmt, saturate=False).model, [feeds], rtol=1e-2, atol=1e-3)
    compare_s = time.perf_counter() - t0
    print(f"probe   {probe_s:7.2f} s  ({probe_calls} calls into onnx shape inference; verdict {layer.verdict})")
    print(f"compare {compare_s:7.2f} s  (--emulate)")
    print(f"ratio   {probe_s / compare_s:7.2f}x")


if __name__ == "__main__":
    main()
