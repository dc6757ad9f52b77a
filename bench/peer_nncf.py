"""NNCF's post-training quantization of one ONNX model, run under NNCF's own venv (bench-only).

Run: NNCF_PYTHON bench/peer_nncf.py MODEL CALIB_DIR OUT.onnx [--accuracy-aware DECIDED,...]

Defaults: `nncf.quantize(model, nncf.Dataset(samples))` (ONNX backend, its own preset, MinMax
statistics, per-channel weights). `--accuracy-aware`: `nncf.quantize_with_accuracy_control`,
validated on the calibration samples against the FP32 model (never the held-out ones, which
bench_eight_bit.py judges on): the metric is 1 - the worst output's rel L2 (top-1 agreement
for the decided outputs named), and at most 0.04 of it may drop (0.8 x the 5e-2 gate, what
npuprep's widening aims at). Imports nothing of npuprep: NNCF's venv does not hold it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx


def feeds(folder: Path) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(f)) for f in sorted(folder.glob("*.npz"))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("calib")
    ap.add_argument("out")
    ap.add_argument("--accuracy-aware", metavar="DECIDED", nargs="?", const="")
    args = ap.parse_args()
    import nncf
    import onnxruntime as ort

    model = onnx.load(args.model)
    samples = feeds(Path(args.calib))
    calibration = nncf.Dataset(samples)
    if args.accuracy_aware is None:
        quantized = nncf.quantize(model, calibration)
    else:
        decided = {d for d in args.accuracy_aware.split(",") if d}
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        ref = ort.InferenceSession(args.model, opts, providers=["CPUExecutionProvider"])
        names = [o.name for o in ref.get_outputs()]
        expected = [dict(zip(names, ref.run(None, f), strict=True)) for f in samples]

        def validate(candidate: onnx.ModelProto, data: object) -> float:
            sess = ort.InferenceSession(candidate.SerializeToString(), opts,
                                        providers=["CPUExecutionProvider"])
            got = [dict(zip(names, sess.run(None, f), strict=True)) for f in samples]
            worst = 0.0
            for name in names:
                r = [np.asarray(e[name], np.float64) for e in expected]
                c = [np.asarray(g[name], np.float64) for g in got]
                if not np.issubdtype(expected[0][name].dtype, np.floating):
                    continue
                if name in decided:
                    held = np.mean([np.mean(np.argmax(a, -1) == np.argmax(b, -1)) for a, b in zip(r, c, strict=True)])
                    worst = max(worst, 1.0 - float(held))
                    continue
                num = sum(float(np.sum((b - a) ** 2)) for a, b in zip(r, c, strict=True))
                den = sum(float(np.sum(a ** 2)) for a in r)
                worst = max(worst, min(1.0, (num / den) ** 0.5 if den else num ** 0.5))
            return 1.0 - worst

        quantized = nncf.quantize_with_accuracy_control(
            model, calibration, nncf.Dataset(samples), validate, max_drop=0.04,
            drop_type=nncf.DropType.ABSOLUTE)
    onnx.save(quantized, args.out)


if __name__ == "__main__":
    sys.exit(main())
