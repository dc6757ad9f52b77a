"""`npuprep ledger` on every built corpus model, per target: the table of BENCHMARKS.md.

    python bench/bench_ledger.py [--targets a2000 rk3588 a100 rtx5000ada] [--converted DIR]
                                 [--peak TARGET:FMT=TFLOPS ...] [--bandwidth TARGET=GBS ...]
    python bench/bench_ledger.py --kit-fit DIR [--providers CPUExecutionProvider]

--kit-fit: a GEMM chain, a conv net and a transformer block (built here, converted to FP16 by
`npuprep convert --target generic --synthetic 8`), each timed with its kit on this machine's
onnxruntime (IO binding), fitted with `--measured ... --fitted-profile` on all three kits at
once and on each pair (the third held out), and each fitted profile then used on all three
models: the estimate beside the measured median (bold: more than 15% off). The nominal figures (--cpu-peak, --cpu-bandwidth) only seed the fit. On a GPU:
`--size gpu --target h200 --prepare-only` here, `time_models.py --backend torch` in each kit
there, then the same command again with the results.json files in place.

Per model and target: estimated ms of all-FP32, all-FP16 and the 8-bit plan, FP16's speed-up
and memory-bound share, and with --converted DIR (holding NAME.TARGET.onnx from `npuprep
convert`) the converted row and what its pins and casts cost. Figures a profile leaves unknown
have no time unless set with --peak/--bandwidth (say where such a figure comes from); their
speed-ups are then the range the profile's known and assumed figures allow.
Samples: the model's first calib/*.npz (FLOPs at its shapes). Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CORPUS = Path(os.environ.get("NPUPREP_CORPUS_DIR", Path.home() / ".cache/npuprep/corpus"))


def _ms(v: float | None) -> str:
    return "unknown" if v is None else f"{v:.3g}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2g}x"


def _speedup(row: dict) -> str:
    """The row's speed-up over FP32, or the range its known and assumed figures allow."""
    span = row.get("speedup_range")
    if row.get("speedup_vs_fp32") is None and span:
        return f"{span[0]:.2g}-{span[1]:.2g}x"
    return _x(row.get("speedup_vs_fp32"))


# x[M,1024] -> (MatMul 1024x1024 -> Relu) x 4 -> y
GEMM_CHAIN = """<ir_version: 8, opset_import: ["" : 17]>
g (float[{m},1024] x) => (float[{m},1024] y) {{
  a = MatMul(x, w1)  ar = Relu(a)  b = MatMul(ar, w2)  br = Relu(b)
  c = MatMul(br, w3)  cr = Relu(c)  y = MatMul(cr, w4) }}"""
# x[N,16,112,112] -> Conv3x3(32) -> Relu -> Conv3x3(32) -> Relu -> Conv3x3/2(64) -> Relu -> pool
CONV_NET = """<ir_version: 8, opset_import: ["" : 17]>
g (float[{n},16,112,112] x) => (float[{n},64,1,1] y) {{
  a = Conv<pads=[1,1,1,1]>(x, k1, c1)  ar = Relu(a)  b = Conv<pads=[1,1,1,1]>(ar, k2, c2)
  br = Relu(b)  c = Conv<pads=[1,1,1,1], strides=[2,2]>(br, k3, c3)  cr = Relu(c)
  y = GlobalAveragePool(cr) }}"""
# x[T,256] -> LN -> Q,K,V (4 heads of 64) -> softmax(QK^T/8) V -> proj -> +x -> LN -> FFN 1024
TRANSFORMER = """<ir_version: 8, opset_import: ["" : 17]>
g (float[{t},256] x) => (float[{t},256] y) {{
  n = LayerNormalization<axis=-1>(x, g1, b1)
  q = MatMul(n, wq)  k = MatMul(n, wk)  v = MatMul(n, wv)
  qh = Reshape(q, hs)  kh = Reshape(k, hs)  vh = Reshape(v, hs)
  qt = Transpose<perm=[1,0,2]>(qh)  kt = Transpose<perm=[1,2,0]>(kh)  vt = Transpose<perm=[1,0,2]>(vh)
  s = MatMul(qt, kt)  ss = Mul(s, scale)  p = Softmax<axis=-1>(ss)  o = MatMul(p, vt)
  ot = Transpose<perm=[1,0,2]>(o)  oc = Reshape(ot, flat)  pr = MatMul(oc, wo)  r = Add(x, pr)
  m = LayerNormalization<axis=-1>(r, g2, b2)  f = MatMul(m, w1)  fg = Gelu(f)  f2 = MatMul(fg, w2)
  y = Add(r, f2) }}"""


# Sizes: "cpu" for this machine, "gpu" large enough for a die (kits under 64 MiB in all).
SIZES = {"cpu": {"m": 256, "n": 1, "t": 128}, "gpu": {"m": 2048, "n": 8, "t": 1024},
         # every run shorter than a scheduler slice on a shared machine: a run's minimum is then
         # one nobody else interrupted (the GEMM chain at m=256 takes 25 ms)
         "cpu-short": {"m": 32, "n": 1, "t": 128}}


def _kit_models(folder: Path, size: str) -> dict[str, Path]:
    import numpy as np
    import onnx
    from onnx import numpy_helper, parser

    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]) or 1)).astype(np.float32)

    weights = {
        "gemm_chain": {f"w{i}": w(1024, 1024) for i in range(1, 5)},
        "conv_net": {"k1": w(32, 16, 3, 3), "c1": w(32), "k2": w(32, 32, 3, 3), "c2": w(32),
                     "k3": w(64, 32, 3, 3), "c3": w(64)},
        "transformer": {"g1": np.ones(256, np.float32), "b1": np.zeros(256, np.float32),
                        "g2": np.ones(256, np.float32), "b2": np.zeros(256, np.float32),
                        "wq": w(256, 256), "wk": w(256, 256), "wv": w(256, 256), "wo": w(256, 256),
                        "w1": w(256, 1024), "w2": w(1024, 256),
                        "hs": np.array([SIZES[size]["t"], 4, 64], np.int64),
                        "flat": np.array([SIZES[size]["t"], 256], np.int64),
                        "scale": np.array(0.125, np.float32)},
    }
    texts = {"gemm_chain": GEMM_CHAIN, "conv_net": CONV_NET, "transformer": TRANSFORMER}
    paths = {}
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        model = parser.parse_model(text.format(**SIZES[size]))
        model.opset_import[0].version = 20  # Gelu
        model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in weights[name].items())
        onnx.checker.check_model(model)
        paths[name] = folder / f"{name}.onnx"
        onnx.save(model, paths[name])
    return paths


def _npuprep(*argv: str) -> subprocess.CompletedProcess[str]:
    run = subprocess.run([sys.executable, "-m", "npuprep", *argv], capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"npuprep {' '.join(argv)}: {run.stderr.strip()}")
    return run


def _fit(folder: Path, models: dict[str, Path], names: list[str], target: list[str], fit_on: str,
         label: str) -> Path:
    """Fit the profile on the kits of `names` at once (`--measured` once per kit); its path."""
    fitted = folder / f"fitted_{label.replace(' ', '_')}.yaml"
    first = names[0]
    measured = [a for name in names for a in ("--measured", str(folder / f"kit_{name}" / "results.json"))]
    doc = json.loads(_npuprep("ledger", str(models[first]), str(folder / f"{first}.fp16.onnx"), *target,
                              "--fit-on", fit_on, *measured, "--fitted-profile", str(fitted),
                              "--json").stdout)
    fit = doc["measured"]["fit"]
    scales = ", ".join(f"{f} x{v:.3g}" for f, v in fit["efficiency_scale"].items())
    launches = ", ".join(f"{c} {v:.3g}" for c, v in fit["launch_us_by_class"].items())
    print(f"| {label} | {scales} | {launches} | {fit['run_us']:.3g} |")
    return fitted


def kit_fit(folder: Path, args: argparse.Namespace) -> int:
    """Build, convert and export the three kits; time them here (unless --prepare-only or the
    kit already holds results.json from the device); fit on all three at once and on each pair
    (leave one out), and put every fit's estimate beside every measured row. Prints Markdown."""
    import time

    import yaml

    from npuprep.profiles import load_profile

    figures = [f"--peak={p}" for p in args.cpu_peak.split(",")] + [f"--bandwidth={args.cpu_bandwidth}"]
    target = ["--target", "generic", *figures]
    if args.target != "generic":
        # Eager torch launches one kernel per node (no fusion) and makes a Transpose a strided
        # view (permute launches nothing).
        doc = load_profile(args.target).to_dict()
        doc["throughput"].pop("fuses_elementwise", None)
        doc["throughput"]["view_ops"] = ["Transpose"]
        doc["name"] = f"{args.target}-eager"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "eager.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        target = ["--target", str(folder / "eager.yaml")]
    models = _kit_models(folder, args.size)
    for name, path in models.items():
        converted = folder / f"{name}.fp16.onnx"
        if not converted.exists():
            _npuprep("convert", str(path), "--target", "generic", "--synthetic", "8", "-o", str(converted))
        kit = folder / f"kit_{name}"
        if not kit.exists():
            _npuprep("ledger", str(path), str(converted), *target, "--export-kit", str(kit))
        if not (kit / "results.json").exists():
            if args.prepare_only:
                continue
            start = time.perf_counter()
            run = subprocess.run([sys.executable, str(kit / "time_models.py"), "--providers", args.providers,
                                  "--warmup", "20", "--runs", "100"], capture_output=True, text=True)
            if run.returncode != 0:
                raise SystemExit(f"{name}: time_models.py: {run.stderr.strip()}")
            print(f"{name}: timed in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if args.prepare_only:
        return 0
    stat = f"{args.fit_on}_ms"
    measured = {name: {row: m[stat] for row, m in json.loads(
        (folder / f"kit_{name}" / "results.json").read_text())["models"].items()} for name in models}
    names = list(models)
    sets = {"all three": names, **{f"without {left}": [n for n in names if n != left] for left in names}}
    print("| fitted on | efficiency (x profile) | launch us per node | us per run |")
    print("|---|---|---|---|")
    fitted = {label: _fit(folder, models, kits, target, args.fit_on, label) for label, kits in sets.items()}
    print()
    print("| fitted on | model | row | measured ms | estimated ms (fitted profile) | estimated / measured |")
    print("|---|---|---|---|---|---|")
    for label, profile in fitted.items():
        for name, path in models.items():
            doc = json.loads(_npuprep("ledger", str(path), str(folder / f"{name}.fp16.onnx"),
                                      "--target", str(profile), "--json").stdout)
            rows = {r["format"]: r for r in doc["formats"]}
            held = "" if name in sets[label] else " (held out)"
            for row in ("fp32", "converted"):
                est, got = rows[row]["estimated_ms"], measured[name][row]
                ratio = f"{est / got:.2f}" if abs(est / got - 1) <= 0.15 else f"**{est / got:.2f}**"
                print(f"| {label} | {name}{held} | {row} | {got:.3g} | {est:.3g} | {ratio} |")
    return 0


def kit_sensitivity(folder: Path, args: argparse.Namespace) -> int:
    """The held-out rows of the three leave-one-out fits (kits timed and fitted by --kit-fit
    first), with one ingredient of the fit changed at a time. Prints Markdown."""
    from dataclasses import replace

    from npuprep.ledger.fit import CLASS_SHRINK, fit_points, fit_throughput
    from npuprep.ledger.kit import read_kit, read_results
    from npuprep.ledger.ledger import build_ledger
    from npuprep.profiles import load_profile

    if args.target != "generic":
        profile = load_profile(str(folder / "eager.yaml"))
        base = profile.throughput
    else:
        profile = load_profile("generic")
        peaks = {f: float(v) for f, v in (p.split("=") for p in args.cpu_peak.split(","))}
        base = replace(profile.throughput, peak_tflops=peaks, bandwidth_gbs=float(args.cpu_bandwidth))
    names = ["gemm_chain", "conv_net", "transformer"]
    stat = f"{args.fit_on}_ms"

    def points(throughput):  # noqa: ANN001, ANN202 - a bench helper
        out = {}
        for name in names:
            path = folder / f"kit_{name}" / "results.json"
            results = read_results(path)
            kit = read_kit(path, results)
            ledger = build_ledger(kit.models["fp32"], profile.resolve("fp16"), throughput=throughput,
                                  input_shapes=kit.input_shapes, converted=kit.models["converted"])
            out[name] = fit_points(name, ledger, results, stat)
        return out

    charged = replace(base, view_ops=frozenset())
    variants = [("this fit", base, {}),
                ("Transpose charged as a copy", charged if base.view_ops else None, {}),
                ("one launch cost for every class", base, {"class_shrink": 1e6}),
                ("no per-run cost", base, {"per_run": False}),
                *((f"class costs pulled together at {w:g} (default {CLASS_SHRINK:g})", base,
                   {"class_shrink": w}) for w in (1e-3, 1e-2))]
    print("| fit | " + " | ".join(f"{n} held out" for n in names) + " |")
    print("|---|---|---|---|")
    for label, throughput, options in variants:
        if throughput is None:
            continue
        pts = points(throughput)
        cells = []
        for held in names:
            fit = fit_throughput([p for n in names if n != held for p in pts[n]], throughput, stat,
                                 **options)
            ratios = {p.row: fit.fitted_ms(p) / p.measured_ms for p in pts[held]} if fit else {}
            cells.append(" / ".join(f"{ratios[r]:.2f}" if abs(ratios[r] - 1) <= 0.15 else
                                    f"**{ratios[r]:.2f}**" for r in ("fp32", "converted")))
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit-fit", type=Path, metavar="DIR", help="time, fit and cross-check the "
                                                                      "three kit models in DIR")
    parser.add_argument("--kit-sensitivity", type=Path, metavar="DIR",
                        help="the leave-one-out fits of --kit-fit DIR with one ingredient changed")
    parser.add_argument("--providers", default="CPUExecutionProvider")
    parser.add_argument("--cpu-peak", default="fp32=0.1,fp16=0.1", help="nominal seeds of the fit")
    parser.add_argument("--cpu-bandwidth", default="10")
    parser.add_argument("--fit-on", choices=("median", "min"), default="median")
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--target", default="generic", help="--kit-fit: the profile to fit (a GPU's, "
                                                            "timed with the torch backend)")
    parser.add_argument("--prepare-only", action="store_true",
                        help="--kit-fit: build and export the kits only (time them on the device)")
    parser.add_argument("--targets", nargs="+", default=["a2000", "rk3588", "a100", "rtx5000ada"])
    parser.add_argument("--converted", type=Path, help="folder of NAME.TARGET.onnx")
    parser.add_argument("--peak", action="append", default=[], metavar="TARGET:FMT=TFLOPS")
    parser.add_argument("--bandwidth", action="append", default=[], metavar="TARGET=GBS")
    parser.add_argument("--only", nargs="*", help="model names")
    args = parser.parse_args()
    if args.kit_fit:
        return kit_fit(args.kit_fit, args)
    if args.kit_sensitivity:
        return kit_sensitivity(args.kit_sensitivity, args)
    models = sorted(p.parent for p in CORPUS.glob("*/entry.json"))
    if args.only:
        models = [m for m in models if m.name in args.only]
    print("| model | target | GFLOP | MB moved FP32 / FP16 | FP32 ms | FP16 ms | FP16 vs FP32 "
          "| FP16 vs TF32 | memory-bound (FP16) | 8-bit plan ms (vs FP32) | converted ms | "
          "pins+casts ms (share) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for folder in models:
        calib = sorted((folder / "calib").glob("*.npz"))
        for target in args.targets:
            cmd = [sys.executable, "-m", "npuprep", "ledger", str(folder / "model.onnx")]
            converted = args.converted / f"{folder.name}.{target}.onnx" if args.converted else None
            if converted is not None and converted.is_file():
                cmd.append(str(converted))
            cmd += ["--target", target, "--json"]
            if calib:
                cmd += ["--data", str(calib[0])]
            cmd += [f"--peak={p.split(':', 1)[1]}" for p in args.peak if p.startswith(f"{target}:")]
            cmd += [f"--bandwidth={b.split('=', 1)[1]}" for b in args.bandwidth
                    if b.startswith(f"{target}=")]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                print(f"| {folder.name} | {target} | failed: {run.stderr.strip()[:80]} |||||||||")
                continue
            doc = json.loads(run.stdout)
            rows = {r["format"]: r for r in doc["formats"]}
            fp16 = rows.get(doc["precision"], {})
            eight = next((r for k, r in rows.items() if k.endswith("plan")), {})
            conv = rows.get("converted")
            pins = doc.get("pins") or {}
            cost = (f"{_ms(pins.get('extra_ms'))} ({pins['extra_share']:.1%})"
                    if pins.get("extra_share") is not None else _ms(pins.get("extra_ms")) if pins else "-")
            moved = f"{rows['fp32']['bytes'] / 1e6:.3g} / {fp16.get('bytes', 0) / 1e6:.3g}"
            print(f"| {folder.name} | {target} | {rows['fp32']['flops'] / 1e9:.3g} | {moved} | "
                  f"{_ms(rows['fp32']['estimated_ms'])} | "
                  f"{_ms(fp16.get('estimated_ms'))} | {_speedup(fp16)} | "
                  f"{_x(fp16.get('speedup_vs_tf32')) if 'tf32' in rows else 'no TF32'} | "
                  f"{'-' if fp16.get('memory_bound_share') is None else format(fp16['memory_bound_share'], '.0%')} | "
                  f"{_ms(eight.get('estimated_ms'))} ({_speedup(eight) if eight else '-'}) | "
                  f"{_ms(conv['estimated_ms']) if conv else '-'} | "
                  f"{cost} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
