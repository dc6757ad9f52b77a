"""A detector's decided scores under 8-bit error, calibration against held-out (part e8new2).

    python bench/bench_score_margin_eaten.py MODEL_DIR SCORES [QDQ_MODEL ...] [--precision int8]

MODEL_DIR holds model.onnx, calib/ and heldout/ (the corpus layout); SCORES is the score output
judged at a threshold of 0 (logits; BlazeFace's `classificators`). For each model compared
with the FP32 one (each QDQ_MODEL given, a convert output, and the whole model in 8 bits built
here: absmax / percentile scales, with and without the cross-layer equalisation, every Conv
8-bit), per sample: "eaten", how far the error moves each decided score (further than the
judge's band, 0.05, from the threshold) toward the threshold as a share of its distance (> 1
flips it), its maximum over the calibration and the held-out samples, and the rms error of
the scores within 3 of the threshold. Then the held-out peak over the calibration clip of
each equalised tensor, equalised and not (the headroom equalisation spends).
"""

from __future__ import annotations

import argparse
import glob
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from npuprep.calibrate import calibrate
from npuprep.calibrate.channels import channel_absmax
from npuprep.graph import node_label
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import eight_bit_format
from npuprep.opsets import upgrade_opset
from npuprep.rewrite.equalise import chains, factors
from npuprep.scale_rules import ScaleRule
from npuprep.verify.qdq_model import equalise_channels, quantise

BAND = 0.05
NEAR = 3.0


def _feeds(folder: Path) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(f)) for f in sorted(glob.glob(str(folder / "*.npz")))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("scores")
    p.add_argument("models", nargs="*", type=Path)
    p.add_argument("--precision", default="int8")
    args = p.parse_args()
    fmt = eight_bit_format(args.precision)
    assert fmt is not None, args.precision
    calib, held = _feeds(args.folder / "calib"), _feeds(args.folder / "heldout")
    proto = upgrade_opset(onnx.load(args.folder / "model.onnx"), 19, why="QDQ")
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # Basic optimisations, as npuprep verifies: onnxruntime 1.32's ReluQuantRewrite (extended
    # level) drops a Relu before an FP8 QuantizeLinear.
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    every = calib + held
    ref = ort.InferenceSession(proto.SerializeToString(), opts)
    refs = [ref.run([args.scores], f)[0].ravel() for f in every]

    def judged(name: str, model: onnx.ModelProto) -> None:
        session = ort.InferenceSession(model.SerializeToString(), opts)
        eaten, near = [], []
        for feed, a in zip(every, refs, strict=True):
            b = session.run([args.scores], feed)[0].ravel()
            d = np.abs(a) > BAND
            eaten.append(float((-(b - a)[d] * np.sign(a[d]) / np.abs(a[d])).max()))
            near.append(float(np.mean((b - a)[np.abs(a) < NEAR] ** 2)))
        n = len(calib)
        print(f"{name:<28} eaten calib {max(eaten[:n]):5.2f} held {max(eaten[n:]):5.2f}   "
              f"rms near calib {np.sqrt(np.mean(near[:n])):.3f} held {np.sqrt(np.mean(near[n:])):.3f}"
              f"   per sample {[round(x, 2) for x in eaten]}")

    for path in args.models:
        judged(path.name, onnx.load(path))
    convs = [node_label(n) for n in proto.graph.node if n.op_type == "Conv"]
    stats = calibrate(Model(proto, str(args.folder), fingerprint(proto)), calib, detail="all")
    int8 = eight_bit_format("int8")
    assert int8 is not None
    eq = equalise_channels(proto, proto, convs, stats, int8, calib, rules=(ScaleRule.ABSMAX,),
                           tensor_scales={})
    for label, model, found in (("", proto, stats), ("equalised ", eq.model, eq.stats)):
        for rule in (ScaleRule.ABSMAX, ScaleRule.PERCENTILE):
            judged(f"{label}100% {fmt.name} {rule.value}",
                   quantise(model, convs, found, fmt, saturate=True, rule=rule).model)
    found_chains = chains(proto.graph, convs)
    tensors = [c.tensor for c in found_chains]
    seen, unseen = (channel_absmax(proto, tensors, f, axis=1) for f in (calib, held))
    print("held-out peak / calibration clip per equalisable tensor (not equalised, equalised):")
    for t in tensors:
        s = factors(seen[t].max(axis=0))
        print(f"  {t:<28} {unseen[t].max() / seen[t].max():5.2f} "
              f"{(unseen[t] * s).max() / (seen[t] * s).max():5.2f}")


if __name__ == "__main__":
    main()
