"""8-bit convert, stage by stage: where the time of `convert --precision int8|fp8_e4m3` goes.

    python bench/bench_eight_bit_search.py MODEL_DIR [MODEL_DIR ...] --precision int8
        [--top-k OUTPUT:K | OUTPUT:ctc] [--detect SCORES[=BOXES],...:THRESHOLD]

Each MODEL_DIR holds model.onnx, calib/ and heldout/ (the corpus layout), or is an extra2
model's folder (DIR/NAME/calib/, DIR/NAME/holdout/ beside DIR/NAME.onnx). Prints, per model,
the wall and CPU seconds of each stage (as convert reports them to its progress callback), the
machine's load average before and after (it may be shared), the 8-bit share
of the multiply-adds, the outputs' rel L2 on the calibration and held-out samples, the layers
kept wider, the trial runs, the share/error curve the search tried and convert's notes;
each output's judge where a rule other than rel L2 judged it (its decisions, a detector's
detections per sample). Each
stage is also printed to stderr as it starts (a large model's convert runs for many minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from npuprep.cli.common import parse_decisions
from npuprep.data import load_samples
from npuprep.detections import Decision
from npuprep.model_io import load_model
from npuprep.pipeline.stages import CALIBRATE, convert
from npuprep.profiles import load_profile


def _worst(check: object) -> float:
    outputs = getattr(check, "outputs", {}) or {}
    return max((o.get("rel_l2", 0.0) for o in outputs.values()), default=float("nan"))


# The keys of an output's row that say how its decisions were judged.
JUDGE_KEYS = ("top_k", "top_k_agreement", "top_k_agreement_at_margin", "detect",
              "detections", "detect_agreement", "detect_agreement_at_margin", "detect_entries",
              "detect_ties", "detect_ties_flipped", "detect_near_rms", "detect_expected_flips",
              "detect_held_by_chance", "rel_l2_at_detections",
              "max_abs_error_at_detections", "detect_fallback")


def _judged(check: object) -> dict[str, dict[str, object]]:
    """Per output judged by a rule of its decisions: its rel L2 and that rule's numbers."""
    outputs = getattr(check, "outputs", {}) or {}
    return {name: {"rel_l2": o["rel_l2"], **{k: o[k] for k in JUDGE_KEYS if k in o}}
            for name, o in outputs.items() if "top_k" in o or "detect" in o}


def bench(folder: Path, precision: str, target: str,
          top_k: dict[str, Decision] | None = None) -> dict[str, object]:
    extra2 = folder.with_suffix(".onnx")
    path, held_out = ((folder / "model.onnx", "heldout") if (folder / "model.onnx").exists()
                      else (extra2, "holdout"))
    model = load_model(path)
    calib = load_samples(folder / "calib", model.proto)
    held = load_samples(folder / held_out, model.proto)
    # (stage, wall seconds, CPU seconds of every thread): the CPU time holds on a shared machine.
    stages: list[tuple[str, float, float]] = []
    # The machine may be shared: the 1-minute load average before and after, beside the times.
    load = [round(os.getloadavg()[0], 1)]
    start = last = time.perf_counter()
    start_cpu = last_cpu = time.process_time()

    def progress(name: str) -> None:
        nonlocal last, last_cpu
        now, cpu = time.perf_counter(), time.process_time()
        if stages:
            stages[-1] = (stages[-1][0], now - last, cpu - last_cpu)
        stages.append((name, 0.0, 0.0))
        last, last_cpu = now, cpu
        print(f"[{now - start:7.1f} s, {cpu - start_cpu:7.1f} CPU s, load "
              f"{os.getloadavg()[0]:.1f}] {name}", file=sys.stderr, flush=True)

    result = convert(model, load_profile(target), calib, holdout=held, stats=CALIBRATE,
                     precision=precision, progress=progress, top_k=top_k)
    end, end_cpu = time.perf_counter(), time.process_time()
    if stages:
        stages[-1] = (stages[-1][0], end - last, end_cpu - last_cpu)
    eight = result.eight_bit
    assert eight is not None
    load.append(round(os.getloadavg()[0], 1))
    return {"model": folder.name, "precision": precision, "seconds": round(end - start, 1),
            "cpu_seconds": round(end_cpu - start_cpu, 1), "load": load,
            "passed": bool(result.output_check) and (result.holdout is None or bool(result.holdout)),
            "share": round(eight.eight_bit_share, 4), "mac_share": eight.mac_share,
            "rel_l2": _worst(result.output_check), "heldout_rel_l2": _worst(result.holdout),
            "judged": _judged(result.output_check), "heldout_judged": _judged(result.holdout),
            "kept_wider": len(eight.kept_wider), "rank_runs": eight.rank_runs,
            "curve": [p.to_dict() for p in eight.curve],
            # What each measured choice decided (equalisation, balancing, rounding, bias
            # correction): a faster run must decide as the slower one did.
            "notes": list(result.notes),
            "stages": [(n, round(w, 1), round(c, 1)) for n, w, c in stages if w >= 0.05]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--precision", default="int8")
    parser.add_argument("--target", default="a2000")
    parser.add_argument("--top-k", action="append", default=[], metavar="OUTPUT:K",
                        help="as convert's (OUTPUT:ctc: a CTC recogniser judged by its text)")
    parser.add_argument("--detect", action="append", default=[],
                        metavar="SCORES[=BOXES],...:THRESHOLD", help="as convert's")
    args = parser.parse_args()
    for folder in args.folders:
        print(json.dumps(bench(folder, args.precision, args.target, parse_decisions(args.top_k, args.detect))),
              flush=True)


if __name__ == "__main__":
    main()
