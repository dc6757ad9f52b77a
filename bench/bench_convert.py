"""Convert time on a >= 100 MB transformer, beside onnxconverter-common, in one run.

Run: python bench/bench_convert.py [--layers 4] [--samples 4]

The model is bench_calibrate's pre-LN encoder (decomposed LayerNorm and GELU) fed with a
residual stream of magnitude ~300, so every LayerNorm's variance (300^2 = 9e4) overflows
FP16. Timed phases: onnxconverter-common's convert_float_to_float16(keep_io_types=True);
npuprep calibrate; npuprep convert given the statistics (plan, rewrite, lower, verify on
the samples); and the total of the two.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
from bench_calibrate import build_transformer

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.data import load_samples
from npuprep.model_io import load_model
from npuprep.numerics import get_format
from npuprep.profiles import load_profile
from npuprep.runtime.session import make_session, run
from npuprep.verify.emulate_lowered import emulate_lowered


def nonfinite(reference: onnx.ModelProto, lowered: onnx.ModelProto, feeds) -> tuple[int, float]:
    ref = make_session(reference)
    emu = make_session(emulate_lowered(lowered, get_format("fp16"), saturate=False).model)
    bad, worst = 0, 0.0
    for f in feeds:
        r, c = run(ref, f), run(emu, f)
        for k, rv in r.items():
            cv = c[k]
            bad += int((~np.isfinite(cv)).sum())
            if np.isfinite(cv).all():
                worst = max(worst, float(np.linalg.norm(cv - rv) / np.linalg.norm(rv)))
    return bad, worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    args = ap.parse_args()
    from onnxconverter_common.float16 import convert_float_to_float16

    with tempfile.TemporaryDirectory() as tmp:
        proto = build_transformer(layers=args.layers)
        path = Path(tmp) / "encoder.onnx"
        onnx.save(proto, path)
        size_mb = path.stat().st_size / 2**20
        data = Path(tmp) / "data"
        data.mkdir()
        rng = np.random.default_rng(0)
        for i in range(args.samples):
            np.savez(data / f"s{i}.npz", x=(rng.standard_normal((1, 128, 768)) * 300).astype(np.float32))
        model = load_model(path)
        samples = load_samples(data, model.proto)
        feeds = list(samples)

        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            naive = convert_float_to_float16(model.proto, keep_io_types=True)
        t_naive = time.perf_counter() - t0

        t0 = time.perf_counter()
        stats = calibrate(model, samples)
        t_cal = time.perf_counter() - t0
        t0 = time.perf_counter()
        result = convert(model, load_profile("generic"), feeds, stats=stats)
        t_conv = time.perf_counter() - t0

        naive_bad, naive_err = nonfinite(model.proto, naive, feeds)
        ours_bad, ours_err = nonfinite(model.proto, result.lowered.model, feeds)
        rows = [
            "| step | seconds | result on the samples (emulated FP16) |",
            "|---|---|---|",
            f"| onnxconverter-common convert_float_to_float16 | {t_naive:.2f} | "
            f"{naive_bad} Inf/NaN, rel L2 {naive_err:.3g} |",
            f"| npuprep calibrate ({args.samples} samples) | {t_cal:.2f} | |",
            f"| npuprep convert, calibration excluded (plan, rewrite, lower, verify) | {t_conv:.2f} | "
            f"{ours_bad} Inf/NaN, rel L2 {ours_err:.3g}; {len(result.plan.rescales())} rescales, "
            f"{len(result.pinned_nodes)} pinned nodes, FP32 FLOPs {100 * result.flops_fp32_share:.2f}%, "
            f"{'PASSED' if result.passed else 'FAILED'} |",
            f"| npuprep convert, calibration included | {t_cal + t_conv:.2f} | |",
        ]
        print(f"model: {size_mb:.0f} MB, {len(proto.graph.node)} nodes, {args.samples} samples of [1,128,768]")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
