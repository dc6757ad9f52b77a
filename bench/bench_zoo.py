"""Zoo results: naive FP16 conversion (onnxconverter-common) against `npuprep convert`.

Run: python bench/bench_zoo.py [--target generic] [--out bench/_work/zoo.md]

Both conversions are judged the same way: the converted model is widened back to FP32
with explicit rounding wherever it stores FP16 (npuprep.verify.emulate_lowered), which reproduces a
target that honours the model's types; onnxruntime's CPU run of the FP16 model is shown
beside it, because that run computes partly in FP32 and hides overflow.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.data import load_samples
from npuprep.examples import example_data_dir, example_model_path
from npuprep.examples.zoo import ZOO
from npuprep.model_io import load_model
from npuprep.numerics import get_format
from npuprep.profiles import load_profile
from npuprep.runtime.session import make_session, run
from npuprep.verify.emulate_lowered import emulate_lowered


def judge(reference: onnx.ModelProto, candidate: onnx.ModelProto, samples, *, emulate: bool) -> dict:
    """Inf/NaN count and worst relative L2 error of the outputs over the samples."""
    ref = make_session(reference)
    model = emulate_lowered(candidate, get_format("fp16"), saturate=False).model if emulate else candidate
    cand = make_session(model)
    kinds = {i.name: i.type for i in cand.get_inputs()}
    nonfinite, worst = 0, 0.0
    for feed in samples:
        r = run(ref, feed)
        c = run(cand, {k: v.astype(np.float16) if kinds.get(k) == "tensor(float16)" else v
                       for k, v in feed.items()})
        for name, rv in r.items():
            cv = np.asarray(c[name], np.float64)
            bad = ~np.isfinite(cv)
            nonfinite += int(bad.sum())
            if not bad.any():
                err = np.linalg.norm(cv - rv) / max(np.linalg.norm(rv), 1e-30)
                worst = max(worst, float(err))
    return {"nonfinite": nonfinite, "rel_l2": worst}


def naive(model: onnx.ModelProto, samples) -> dict:
    from onnxconverter_common.float16 import convert_float_to_float16

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fp16 = convert_float_to_float16(model, keep_io_types=True)
            emulated = judge(model, fp16, samples, emulate=True)
            ort = judge(model, fp16, samples, emulate=False)
        except Exception as exc:  # noqa: BLE001 - a broken naive conversion is a result
            return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"}
    return {"emulated": emulated, "ort": ort}


def cell(res: dict) -> str:
    if "error" in res:
        return f"invalid model ({res['error'][:60]})"
    e = res["emulated"]
    return f"{e['nonfinite']} Inf/NaN, rel L2 {e['rel_l2']:.2g}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="generic")
    ap.add_argument("--out", default="bench/_work/zoo.md")
    args = ap.parse_args()
    profile = load_profile(args.target)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(name, b()) for name, b in ZOO.items()]
        for name, z in cases:
            path = Path(tmp) / f"{name}.onnx"
            onnx.save(z.model, path)
            data = Path(tmp) / name
            data.mkdir()
            for i, feed in enumerate(z.samples):
                np.savez(data / f"sample_{i:03d}.npz", **feed)
            model = load_model(path)
            rows.append((name, z.hazard, model, load_samples(data, model.proto)))
        planner = load_model(example_model_path())
        rows.append(("planner (bundled)", "the README example", planner,
                     load_samples(example_data_dir(), planner.proto)))
        lines = [
            f"Target profile: `{args.target}` (FP16, overflow gives Inf). Naive = onnxconverter-common "
            "`convert_float_to_float16(keep_io_types=True)`; both judged under emulated FP16 "
            "(explicit Cast pairs); `ORT fp16` is onnxruntime's CPU run of the naive model.",
            "",
            "| model | hazard | naive FP16 (emulated) | naive on ORT CPU | npuprep convert | rescales | pinned nodes | FP32 FLOPs | Casts | time (s) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, hazard, model, samples in rows:
            nv = naive(model.proto, samples)
            t0 = time.perf_counter()
            stats = calibrate(model, samples)
            result = convert(model, profile, list(samples), stats=stats)
            seconds = time.perf_counter() - t0
            ours = judge(model.proto, result.lowered.model, samples, emulate=True)
            ort = "error" if "error" in nv else (
                f"{nv['ort']['nonfinite']} Inf/NaN, rel L2 {nv['ort']['rel_l2']:.2g}")
            lines.append(
                f"| {name} | {hazard} | {cell(nv)} | {ort} | "
                f"{ours['nonfinite']} Inf/NaN, rel L2 {ours['rel_l2']:.2g}"
                f"{'' if result.passed else ' (FAILED)'} | {len(result.plan.rescales())} | "
                f"{len(result.pinned_nodes)} | {100 * result.flops_fp32_share:.2f}% | "
                f"{result.lowered.cast_count} | {seconds:.1f} |")
            print(lines[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
