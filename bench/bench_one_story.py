"""Issue 36's six checks of what a user does after `convert`, on real models, through the CLI.

Run: python bench/bench_one_story.py [--only example minilm_l6 ppocr_det] [--out bench/_work/story]

Each check is the user's command line and whether its verdict agrees with convert's:
1. crosscheck CONVERTED --report R --stats S (no --plan), R = every node in the precision the
   conversion wrote: PASSES.
2. after convert -t orin into a workspace, checklist sends the user to the converted model, and
   crosscheck of the source with the conversion's plan does not PASS when the plan rescales.
3. --holdout equal to --data is refused (exit 2).
4. compare SOURCE CONVERTED on the held-out samples gives convert's verdict (exit codes agree).
5. check --json: no finding says remedy pin_fp32 for a node the plan does not pin.
6. convert --precision bf16 on a100 says bf16 in every line (no "fp16"); its verdict is shown
   (BF16's 8-bit significand against a 1e-2 gate: a pass is not guaranteed).
Writes OUT.md (the table) and OUT.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import onnx

# Unnamed nodes (ppocr_det's) as crosscheck names them.
from npuprep.graph import node_label

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from conversion_util import as_stored_report  # noqa: E402 - the tests' own report builder

CORPUS = Path.home() / ".cache/npuprep/corpus"


def models() -> dict[str, tuple[Path, Path, Path, str]]:
    """name -> (model, calibration samples, held-out samples, target for check 4)."""
    ex = HERE.parent / "examples"
    return {
        "example": (ex / "planner.onnx", ex / "data", ex / "data", "a2000"),
        "minilm_l6": (CORPUS / "minilm_l6/model.onnx", CORPUS / "minilm_l6/calib",
                      CORPUS / "minilm_l6/heldout", "a2000"),
        "ppocr_det": (CORPUS / "ppocr_det/model.onnx", CORPUS / "ppocr_det/calib",
                      CORPUS / "ppocr_det/heldout", "rk3588"),
    }


def npuprep(*args: str) -> tuple[int, str]:
    exe = Path(sys.executable).parent / "npuprep"
    proc = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def all_fp16_report(model: Path, out: Path) -> Path:
    m = onnx.load(str(model), load_external_data=False)
    out.write_text("node,precision\n" + "".join(f"{node_label(n)},fp16\n" for n in m.graph.node))
    return out


def checks(name: str, model: Path, calib: Path, held: Path, target4: str, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, dict] = {}
    conv = work / f"{name}.a2000.onnx"
    holdout = ["--holdout", str(held)] if held != calib else []
    rc, _ = npuprep("calibrate", model, "--data", calib, "-o", work / "stats.json")
    rc, text = npuprep("convert", model, "-t", "a2000", "--data", calib, *holdout, "-o", conv,
                       "--json")
    a2000 = json.loads(text[text.index("{"):]) if "{" in text else {}
    # 1
    report = as_stored_report(conv, work / "as_converted.csv")
    rc1, out1 = npuprep("crosscheck", conv, "--report", report, "--stats", work / "stats.json",
                        "-t", "a2000", "--json")
    doc = json.loads(out1[out1.index("{"):]) if "{" in out1 else {}
    mism = sum(1 for v in doc.get("verdicts", []) if v.get("verdict") == "mismatch")
    res["1 crosscheck w/o --plan"] = {"holds": rc1 == 0, "exit": rc1, "mismatches": mism}
    # 2
    ws = work / "orin_ws"
    ws.mkdir(exist_ok=True)
    orin = ws / f"{name}.orin.onnx"
    rc, _ = npuprep("convert", model, "-t", "orin", "--data", calib, *holdout, "-o", orin)
    rc2, out2 = npuprep("checklist", model, "-t", "orin", "--workspace", ws, "--stats",
                        work / "stats.json")
    trt = [ln for ln in out2.splitlines() if "trtexec" in ln]
    onnx_lines = [ln for ln in trt if "--onnx=" in ln]
    to_converted = bool(onnx_lines) and all(orin.name in ln for ln in onnx_lines)
    plan = ws / f"{name}.orin.plan.yaml"
    rc2b, _ = npuprep("crosscheck", model, "--report", all_fp16_report(model, work / "src.csv"),
                      "-t", "orin", "--plan", plan)
    rescales = "action: rescale" in plan.read_text() if plan.exists() else False
    res["2 checklist/crosscheck after orin"] = {
        "holds": to_converted and (rc2b != 0 or not rescales), "trtexec_lines": trt[:2],
        "source_crosscheck_exit": rc2b, "plan_rescales": rescales}
    # 3
    rc3, out3 = npuprep("convert", model, "-t", "a2000", "--data", calib, "--holdout", calib,
                        "-o", work / "same.onnx")
    res["3 --holdout == --data"] = {"holds": rc3 == 2, "exit": rc3,
                                    "line": out3.strip().splitlines()[-1][:120] if out3 else ""}
    # 4
    conv4 = work / f"{name}.{target4}.onnx"
    rc4c, _ = npuprep("convert", model, "-t", target4, "--data", calib, *holdout, "-o", conv4)
    rc4, out4 = npuprep("compare", model, conv4, "-t", target4, "--data", held)
    res["4 compare == convert"] = {"holds": (rc4 == 0) == (rc4c == 0), "convert_exit": rc4c,
                                   "compare_exit": rc4}
    # 5
    rc5, out5 = npuprep("check", model, "-t", "a2000", "--data", calib, "--json")
    doc5 = json.loads(out5[out5.index("{"):]) if "{" in out5 else {}
    pinned = set(a2000.get("pinned_nodes", []))
    wrong = [f["node"] for f in doc5.get("findings", [])
             if f.get("remedy") == "pin_fp32" and f.get("node") not in pinned]
    res["5 check remedies = plan"] = {"holds": not wrong, "pin_fp32_not_pinned": len(wrong)}
    # 6
    rc6, out6 = npuprep("convert", model, "-t", "a100", "--precision", "bf16", "--data", calib,
                        *holdout, "-o", work / f"{name}.bf16.onnx")
    says_fp16 = [ln for ln in out6.splitlines() if "fp16" in ln.lower()]
    last = out6.strip().splitlines()[-1][:90] if out6.strip() else ""
    res["6 bf16 is bf16"] = {"holds": rc6 in (0, 1) and not says_fp16, "exit": rc6,
                             "fp16_lines": says_fp16[:3], "verdict": last}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+")
    ap.add_argument("--out", type=Path, default=Path("bench/_work/story"))
    args = ap.parse_args()
    results = {}
    for name, (model, calib, held, t4) in models().items():
        if args.only and name not in args.only:
            continue
        results[name] = checks(name, model, calib, held, t4, args.out / name)
        print(name, {k: v["holds"] for k, v in results[name].items()}, flush=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    names = list(results)
    rows = ["| check | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for check in next(iter(results.values())):
        cells = []
        for n in names:
            r = results[n][check]
            detail = ", ".join(f"{k} {v}" for k, v in r.items() if k != "holds")
            cells.append(f"{'holds' if r['holds'] else 'FAILS'} ({detail})")
        rows.append(f"| {check} | " + " | ".join(cells) + " |")
    args.out.with_suffix(".md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
