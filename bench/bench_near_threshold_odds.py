"""A detector's scores near its threshold under 8-bit error: each layer's share of it, calibration
against held-out, and the flips a set of unseen samples should expect (part e8blaze).

    python bench/bench_near_threshold_odds.py MODEL_DIR SCORES [QDQ_MODEL ...]
        [--threshold T] [--near W] [--no-layers]

MODEL_DIR holds model.onnx, calib/ and heldout/ (the corpus layout); SCORES is the score output
judged at T (default 0: logits). "Near" positions are those whose FP32 score lies within W
(default 1) of T; their error's rms is the noise a decided score close to the threshold meets.

1. Per Conv alone in INT8 and alone in FP8 E4M3 (every other node FP32; plain abs-max scales
   from the calibration samples, FP8 with the A2000's 2x NaN headroom, per-channel weights
   rounded to nearest): the near rms on the calibration and on the held-out samples.
2. Per QDQ_MODEL (a convert output) and per set: the near rms, the decided scores (further than
   the judge's band, 0.05 x max(1, |T|), from T) that flip, and the flips the set should
   expect with that rms: sum over its decided scores of P(a N(0, rms) error moves the score
   past T), which does not depend on which score met which error.
3. Per set: the expected flips at a given rms, and the decided scores within 0.25 of T.

The search picks a point whose calibration scores hold; with ~100 trials at similar shares,
one whose errors happened to miss the nearest scores passes (the winner's curse): expected
flips say what an unseen set of the same size will see.
"""

from __future__ import annotations

import argparse
import glob
from math import erf, sqrt
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from npuprep.calibrate import calibrate
from npuprep.calibrate.scales import FP8_NAN_HEADROOM
from npuprep.graph import node_label
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import eight_bit_format
from npuprep.opsets import upgrade_opset
from npuprep.scale_rules import ScaleRule
from npuprep.verify.qdq_model import quantise

BAND = 0.05


def _feeds(folder: Path) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(f)) for f in sorted(glob.glob(str(folder / "*.npz")))]


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # Basic optimisations, as npuprep verifies (ReluQuantRewrite drops a Relu before FP8 Q).
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(model.SerializeToString(), opts)


def expected_flips(distances: np.ndarray, rms: float) -> float:
    """Decided scores at `distances` from the threshold, each met by an N(0, rms) error."""
    if rms <= 0:
        return 0.0
    return float(sum(0.5 * (1.0 - erf(d / rms / sqrt(2.0))) for d in distances))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("scores")
    p.add_argument("models", nargs="*", type=Path)
    p.add_argument("--threshold", type=float, default=0.0)
    p.add_argument("--near", type=float, default=1.0)
    p.add_argument("--no-layers", action="store_true")
    args = p.parse_args()
    t, band = args.threshold, BAND * max(1.0, abs(args.threshold))
    sets = {"calib": _feeds(args.folder / "calib"), "held": _feeds(args.folder / "heldout")}
    proto = upgrade_opset(onnx.load(args.folder / "model.onnx"), 19, why="QDQ")
    reference = _session(proto)
    refs = {k: [reference.run([args.scores], f)[0].ravel().astype(np.float64) for f in v]
            for k, v in sets.items()}

    def near_rms(model: onnx.ModelProto) -> dict[str, tuple[float, int, float]]:
        """Per set: (near rms, decided scores flipped, expected flips at that rms)."""
        session = _session(model)
        found = {}
        for name, feeds in sets.items():
            errors, flipped, decided = [], 0, []
            for feed, a in zip(feeds, refs[name], strict=True):
                b = session.run([args.scores], feed)[0].ravel().astype(np.float64)
                errors.append((b - a)[np.abs(a - t) < args.near])
                d = np.abs(a - t) > band
                flipped += int(((a[d] > t) != (b[d] > t)).sum())
                decided.append(np.abs(a[d] - t))
            rms = float(np.sqrt(np.mean(np.concatenate(errors) ** 2)))
            found[name] = (rms, flipped, expected_flips(np.concatenate(decided), rms))
        return found

    if not args.no_layers:
        stats = calibrate(Model(proto, str(args.folder), fingerprint(proto)), sets["calib"],
                          detail="all")
        convs = [node_label(n) for n in proto.graph.node if n.op_type == "Conv"]
        formats = [(f, headroom) for f, headroom in ((eight_bit_format("int8"), 1.0),
                                                      (eight_bit_format("fp8_e4m3"),
                                                       FP8_NAN_HEADROOM)) if f is not None]
        print(f"near rms (FP32 score within {args.near} of {t}) with one layer in 8 bits, "
              "calibration / held out:")
        for label in [None, *convs]:
            cells = []
            for fmt, headroom in formats:
                model = quantise(proto, convs if label is None else [label], stats, fmt,
                                 saturate=True, rule=ScaleRule.ABSMAX, headroom=headroom).model
                r = near_rms(model)
                cells.append(f"{fmt.name} {r['calib'][0]:.3f} / {r['held'][0]:.3f}")
            print(f"  {label or 'every Conv':<24} " + "   ".join(cells))
    for path in args.models:
        r = near_rms(onnx.load(path))
        print(f"{path.name}: " + "; ".join(f"{k} near rms {v[0]:.3f}, {v[1]} flipped, "
                                            f"{v[2]:.2f} expected" for k, v in r.items()))
    for name, feeds in sets.items():
        d = np.concatenate([np.abs(a - t)[np.abs(a - t) > band] for a in refs[name]])
        odds = ", ".join(f"{s:g}: {expected_flips(d, s):.2f}" for s in (0.02, 0.04, 0.06, 0.08, 0.1))
        print(f"{name}: {len(feeds)} samples, {d.size} decided scores, within 0.25 of the "
              f"threshold {np.sort(d[d < 0.25]).round(3).tolist()}; expected flips at rms {odds}")


if __name__ == "__main__":
    main()
