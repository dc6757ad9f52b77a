"""The corpus through OpenVINO 2026.4's CPU plugin: the source at hint f32 and bf16, npuprep's
conversion for `openvino-cpu` verified by OpenVINO, and (--int8) npuprep's INT8 QDQ on it.

Run: nice -n 10 python bench/bench_openvino.py [--only NAME ...] [--int8]
         [--out bench/_work/openvino]

Per corpus model (bench/corpus.py builds them), one at a time:
  source   the FP32 model compiled with INFERENCE_PRECISION_HINT f32, then bf16, run on the
           held-out samples: worst-output rel L2 against onnxruntime FP32, and how many of its
           compute layers the bf16 compile ran in bf16 / f32 (its runtime model)
  convert  `npuprep convert MODEL --target openvino-cpu --data calib --holdout heldout
           --verify-with openvino --json` (`--top-k OUT:1` for decided outputs): npuprep's
           verdict, its own held-out rel L2 (emulated BF16), OpenVINO's rel L2 on the converted
           graph, and the crosscheck of OpenVINO's runtime precisions against the plan
  int8     the same with `--precision int8`: the QDQ model on OpenVINO (i8/u8 layers counted)
  --qdq DIR  every DIR/NAME.TOOL.onnx (another quantizer's QDQ model, e.g. NNCF's from
           bench_eight_bit.py) on OpenVINO at the 8-bit hint: worst-output rel L2 against
           onnxruntime FP32 on the held-out samples and its runtime layers, beside npuprep's
Writes OUT.md and OUT.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import corpus  # noqa: E402

from npuprep.data import load_samples  # noqa: E402
from npuprep.errors import NpuprepError  # noqa: E402
from npuprep.model_io import load_model  # noqa: E402
from npuprep.vendors.openvino import run_openvino  # noqa: E402
from npuprep.verify.vendor import vendor_output_errors  # noqa: E402

_NOT_COMPUTE = ("Input", "Output", "Const", "Reorder", "Convert")


def precisions(report: dict) -> dict[str, int]:
    """Compute layers (those that name ONNX nodes) per runtime precision."""
    return dict(Counter(layer["runtime_precision"] for layer in report["layers"]
                        if layer["type"] not in _NOT_COMPUTE and layer["original_names"]))


def worst(errors: dict) -> float:
    return max((o["rel_l2"] for o in errors.values()), default=float("nan"))


def source_row(name: str) -> dict:
    entry = corpus.corpus_dir() / name
    model = load_model(entry / "model.onnx")
    held = list(load_samples(entry / "heldout", model.proto))
    row: dict = {}
    for precision in ("fp32", "bf16"):
        try:
            done = run_openvino(model.proto, held, precision)
        except NpuprepError as e:
            return {"refused": str(e)}
        errors = vendor_output_errors(model.proto, held, done.outputs, {}, 1e-2)
        row[precision] = {"rel_l2": worst(errors), "layers": precisions(done.report())}
    return row


def convert_row(name: str, out: Path, precision: str | None) -> dict:
    entry = corpus.corpus_dir() / name
    decided = tuple(corpus.SPECS[name].decided_by) if name in corpus.SPECS else ()
    suffix = precision or "default"
    cmd = [sys.executable, "-m", "npuprep", "convert", str(entry / "model.onnx"), "--target",
           "openvino-cpu", "--data", str(entry / "calib"), "--holdout", str(entry / "heldout"),
           "--verify-with", "openvino", "-o", str(out / f"{name}.{suffix}.onnx"), "--json",
           *(("--precision", precision) if precision else ()),
           *(a for o in decided for a in ("--top-k", f"{o}:1"))]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    row = {"seconds": round(time.perf_counter() - start, 1)}
    try:
        report = json.loads(done.stdout)
    except ValueError:
        return row | {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:160]}
    vendor = report.get("vendor") or {}
    held = (report.get("holdout") or {}).get("outputs") or {}
    row |= {"passed": report["passed"], "said": report["verdict"]["said"][:140],
            "npuprep_rel_l2": worst(held), "built": vendor.get("built", False),
            "refusal": vendor.get("refusal", "")[:160]}
    if vendor.get("built"):
        runtime = out / f"{name}.{suffix}.openvino_runtime.json"
        layers = vendor.get("layers") or {}
        row |= {"openvino_rel_l2": worst(vendor["outputs"]), "hint": vendor["target_platform"],
                "layers": precisions(json.loads(runtime.read_text())),
                "crosscheck": {k: n for k, n in (layers.get("counts") or {}).items() if n},
                "agrees": layers.get("passed"), "disagree": layers.get("disagree", [])}
    return row


def _layers(counts: dict) -> str:
    return " / ".join(f"{k} {n}" for k, n in sorted(counts.items())) or "-"


def markdown(rows: list[dict]) -> str:
    lines = ["| model | OV f32 rel L2 | OV bf16 rel L2 | bf16 compile: layers | npuprep convert "
             "(emulated rel L2) | OV on the conversion: rel L2 | its layers | crosscheck vs plan |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, c = r["source"], r["convert"]
        if "refused" in s:
            lines.append(f"| {r['model']} | refused: {s['refused'][:90]} | | | | | | |")
            continue
        conv = ("error: " + c["error"]) if "error" in c else \
            f"{'PASSED' if c['passed'] else 'FAILED'} ({c['npuprep_rel_l2']:.3g})"
        if c.get("built"):
            agrees = "agrees" if c["agrees"] else "differs: " + ", ".join(c["disagree"][:3])
            ov = (f"{c['openvino_rel_l2']:.3g}", _layers(c["layers"]),
                  f"{agrees} ({_layers(c['crosscheck'])})")
        else:
            ov = (c.get("refusal", "") or "-", "", "")
        lines.append(f"| {r['model']} | {s['fp32']['rel_l2']:.3g} | {s['bf16']['rel_l2']:.3g} | "
                     f"{_layers(s['bf16']['layers'])} | {conv} | {' | '.join(ov)} |")
        if "int8" in r:
            i = r["int8"]
            said = ("error: " + i["error"]) if "error" in i else \
                f"int8 {'PASSED' if i['passed'] else 'FAILED'} ({i['npuprep_rel_l2']:.3g})"
            if i.get("built"):
                said += (f" | OV {i['openvino_rel_l2']:.3g} | {_layers(i['layers'])} | "
                         f"{_layers(i['crosscheck'])}")
            lines.append(f"| {r['model']} (int8 QDQ) | | | | {said} |")
    return "\n".join(lines) + "\n"


def qdq_rows(names: list[str], folder: Path) -> list[dict]:
    """Other quantizers' QDQ models of `names` run by OpenVINO (hint fp16 beside the 8-bit
    layers, as npuprep's INT8 models are run)."""
    rows = []
    for name in names:
        entry = corpus.corpus_dir() / name
        source = load_model(entry / "model.onnx")
        held = list(load_samples(entry / "heldout", source.proto))
        for path in sorted(folder.glob(f"{name}.*.onnx")):
            tool = path.name.removeprefix(f"{name}.").removesuffix(".onnx")
            start = time.perf_counter()
            try:
                done = run_openvino(load_model(path).proto, held, "int8", default="fp16")
            except NpuprepError as e:
                rows.append({"model": name, "tool": tool, "refused": str(e)})
                continue
            errors = vendor_output_errors(source.proto, held, done.outputs, {}, 5e-2)
            rows.append({"model": name, "tool": tool, "rel_l2": worst(errors),
                         "layers": precisions(done.report()), "s": time.perf_counter() - start})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def qdq_markdown(rows: list[dict]) -> str:
    lines = ["| model | QDQ model | OpenVINO rel L2 | runtime layers |", "|---|---|---|---|"]
    for r in rows:
        said = f"refused: {r['refused']}" if "refused" in r else f"{r['rel_l2']:.3g}"
        lines.append(f"| {r['model']} | {r['tool']} | {said} | {_layers(r.get('layers', {}))} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--int8", action="store_true", help="also convert --precision int8")
    ap.add_argument("--out", default="bench/_work/openvino")
    ap.add_argument("--qdq", type=Path, metavar="DIR", help="run DIR/NAME.TOOL.onnx QDQ models only")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only or sorted(p.name for p in corpus.corpus_dir().iterdir()
                                if (p / "model.onnx").is_file())
    if args.qdq:
        rows = qdq_rows(names, args.qdq)
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
        out.with_suffix(".md").write_text(qdq_markdown(rows))
        return
    rows = []
    for name in names:
        row = {"model": name, "source": source_row(name)}
        if "refused" not in row["source"]:
            row["convert"] = convert_row(name, out, None)
            if args.int8:
                row["int8"] = convert_row(name, out, "int8")
        else:
            row["convert"] = {}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out.with_suffix(".json")).write_text(json.dumps(rows, indent=1))
        (out.with_suffix(".md")).write_text(markdown(rows))


if __name__ == "__main__":
    main()
