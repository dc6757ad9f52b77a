"""`npuprep ledger`: table and JSON, the kit run here on the CPU feeding --measured, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_cli

# x[1,8,64,64] -> Conv(w 8x8x3x3) -> Relu -> y
WEIGHTS = ",".join(["0.01"] * 576)
CONV = ("""<ir_version: 8, opset_import: ["" : 17]>
g (float[1,8,64,64] x) => (float[1,8,64,64] y)
<float[8,8,3,3] w = {""" + WEIGHTS + """}> { c = Conv<pads=[1,1,1,1]>(x, w)  y = Relu(c) }""")


def test_ledger_prints_every_format_and_json_lists_them(save):
    path = save(CONV)
    r = run_cli("ledger", path, "--target", "a100")
    assert r.returncode == 0, r.stderr
    assert all(len(line) <= 100 for line in r.stdout.splitlines())
    for word in ("fp32", "fp16", "bf16", "int8 plan", "Ten costliest nodes", "estimate"):
        assert word in r.stdout
    doc = json.loads(run_cli("ledger", path, "--target", "a100", "--json").stdout)
    formats = {f["format"]: f for f in doc["formats"]}
    assert set(formats) == {"fp32", "tf32", "fp16", "bf16", "int8 plan"}
    for f in formats.values():
        assert {"format", "estimated_ms", "speedup_vs_fp32", "memory_bound_share"} <= set(f)
    assert formats["fp32"]["speedup_vs_fp32"] == 1.0 and formats["fp16"]["speedup_vs_fp32"] > 1.5


def test_unknown_figures_are_settable_on_the_command_line(save):
    path = save(CONV)
    doc = json.loads(run_cli("ledger", path, "--target", "rk3588", "--json").stdout)
    assert next(f for f in doc["formats"] if f["format"] == "fp16")["estimated_ms"] is None
    doc = json.loads(run_cli("ledger", path, "--target", "rk3588", "--peak", "fp16=3",
                             "--bandwidth", "30", "--json").stdout)
    assert next(f for f in doc["formats"] if f["format"] == "fp16")["estimated_ms"] > 0


def test_the_kit_runs_here_on_cpu_and_measured_reads_its_results(save, tmp_path: Path):
    model = save(CONV)
    converted = save(CONV, "converted.onnx")
    kit = tmp_path / "kit"
    r = run_cli("ledger", model, converted, "--target", "a100", "--export-kit", kit)
    assert r.returncode == 0, r.stderr
    assert (kit / "models" / "converted.onnx").is_file() and (kit / "inputs" / "x.npy").is_file()
    assert "trtexec --onnx=models/converted.onnx --fp16" in (kit / "README.md").read_text()
    run = subprocess.run([sys.executable, str(kit / "time_models.py"), "--warmup", "2", "--runs", "5",
                          "--warm-max-s", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    results = json.loads((kit / "results.json").read_text())
    assert set(results["models"]) == {"fp32", "converted"}
    fp32 = results["models"]["fp32"]
    assert fp32["runs"] == 5 and fp32["peak_memory_mb"] > 0
    # warmed for at least 0.3 s of work (an idle clock ramps up) before the timed runs
    assert fp32["warmup"] > 2 and fp32["warmup_s"] >= 0.3 and "clock_after" in fp32
    assert "loadavg" in results["device"]
    doc = json.loads(run_cli("ledger", model, converted, "--target", "a100",
                             "--measured", kit / "results.json", "--json").stdout)
    rows = {row["model"]: row for row in doc["measured"]["rows"]}
    fp32 = rows["fp32"]
    assert fp32["median_ms"] == results["models"]["fp32"]["median_ms"]
    assert fp32["measured_vs_estimated"] == fp32["median_ms"] / fp32["estimated_ms"]
    # a 2-core CPU against an A100's peaks: far more than 2x off, and flagged
    assert fp32["gap_over_2x"] is True
    table = run_cli("ledger", model, converted, "--target", "a100", "--measured", kit / "results.json")
    assert "over 2x" in table.stdout


def test_bad_input_is_one_line_exit_2_and_writes_nothing(save, tmp_path: Path):
    path = save(CONV)
    bad = tmp_path / "results.json"
    bad.write_text(json.dumps({"kind": "other"}))
    r = run_cli("ledger", path, "--target", "a100", "--measured", bad)
    assert r.returncode == 2 and "key 'kind'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("ledger", path, "--target", "a100", "--peak", "fp99=3")
    assert r.returncode == 2
    kit = tmp_path / "kit"
    r = run_cli("ledger", path, "--target", "nosuch", "--export-kit", kit)
    assert r.returncode == 2 and "nosuch" in r.stderr and not kit.exists()
    # the kit may not overwrite the model it times
    (tmp_path / "models").mkdir()
    inside = save(CONV, "models/fp32.onnx")
    before = inside.read_bytes()
    r = run_cli("ledger", inside, "--target", "a100", "--export-kit", tmp_path)
    assert r.returncode == 2 and "refusing to overwrite" in r.stderr
    assert inside.read_bytes() == before and not (tmp_path / "manifest.json").exists()


def test_convert_reports_carry_the_pins_cost_and_the_chart(tmp_path: Path):
    from npuprep.examples import example_data_dir, example_model_path
    from npuprep.report import plots

    out = tmp_path / "p.onnx"
    r = run_cli("convert", example_model_path(), "-t", "a100", "--data", example_data_dir(),
                "-o", out, "--html", tmp_path / "p.html")
    assert r.returncode == 0, r.stderr
    assert "pins and casts cost" in r.stdout
    ledger = json.loads((tmp_path / "p.report.json").read_text())["ledger"]
    pins = ledger["pins"]
    assert pins["casts"] > 0 and pins["fp32_nodes"] > 0
    # the pins' cost: the converted graph as written less the same graph all in FP16
    rows = {f["format"]: f for f in ledger["formats"]}
    assert pins["converted_ms"] == rows["converted"]["estimated_ms"]
    assert pins["extra_ms"] == pins["converted_ms"] - pins["uniform_ms"] > 0
    md = (tmp_path / "p.report.md").read_text()
    assert "## What the pins cost (estimate)" in md and "Pins and casts cost" in md
    if plots.available():
        assert 'id="ledger-chart"' in (tmp_path / "p.html").read_text()


def test_trtexec_times_become_results_with_the_warm_up_dropped(save, tmp_path: Path):
    kit = tmp_path / "kit"
    assert run_cli("ledger", save(CONV), "--target", "orin", "--export-kit", kit).returncode == 0
    # trtexec --exportTimes: one record per iteration; the first two are slow warm-up runs
    times = tmp_path / "fp32_times.json"
    times.write_text(json.dumps([{"computeMs": 50.0}, {"computeMs": 40.0}]
                                + [{"computeMs": 1.0 + i / 10} for i in range(5)]))
    run = subprocess.run([sys.executable, str(kit / "time_models.py"), "--warmup", "2",
                          "--from-trtexec", f"fp32={times}"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    fp32 = json.loads((kit / "results.json").read_text())["models"]["fp32"]
    assert (fp32["median_ms"], fp32["runs"]) == (1.2, 5)


def test_a_plan_prices_its_pins_with_casts_at_their_borders(tmp_path: Path):
    from npuprep.examples import example_data_dir, example_model_path

    plan = tmp_path / "p.plan.yaml"
    r = run_cli("convert", example_model_path(), "-t", "a100", "--data", example_data_dir(),
                "--plan-only", "-o", plan)
    assert r.returncode == 0, r.stderr
    doc = json.loads(run_cli("ledger", example_model_path(), "--target", "a100", "--plan", plan,
                             "--data", example_data_dir(), "--json").stdout)
    assert doc["pinned_nodes"]
    pins = doc["pins"]
    assert pins["fp32_nodes"] == len(doc["pinned_nodes"]) and pins["casts"] >= 2
    assert pins["extra_ms"] > 0 and pins["fp32_nodes_ms"] > 0


def test_symbolic_dims_without_sizes_are_refused_naming_them(save):
    # x[batch,8,h,64] -> Relu -> y: costing batch and h at 1 would be silently wrong
    path = save("""<ir_version: 8, opset_import: ["" : 17]>
g (float[batch,8,h,64] x) => (float[batch,8,h,64] y) { y = Relu(x) }""")
    r = run_cli("ledger", path, "--target", "h200")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "x[0]=batch, x[2]=h" in r.stderr
    sized = run_cli("ledger", path, "--target", "h200", "--input-shape", "x:2x8x16x64", "--json")
    assert json.loads(sized.stdout)["formats"][0]["bytes"] == 2 * 2 * 8 * 16 * 64 * 4


# a[256,256], b -> MatMul -> y, and the same in FP16 between Casts: two rows that differ
MM = """<ir_version: 8, opset_import: ["" : 17]>
g (float[256,256] a, float[256,256] b) => (float[256,256] y) { y = MatMul(a, b) }"""
MM16 = """<ir_version: 8, opset_import: ["" : 17]>
g (float[256,256] a, float[256,256] b) => (float[256,256] y) {
  ah = Cast<to=10>(a)  bh = Cast<to=10>(b)  yh = MatMul(ah, bh)  y = Cast<to=1>(yh) }"""


def _results(tmp_path: Path, kit: str, medians: dict[str, float]) -> Path:
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"kind": "ledger-results", "schema_version": 1, "kit": kit,
                                "device": {"machine": "x86_64", "platform": "Linux-test"},
                                "models": {k: {"median_ms": v, "backend": "onnxruntime 1.x CPU"}
                                           for k, v in medians.items()}}))
    return path


def test_measured_refuses_another_models_results(save, tmp_path: Path):
    r = run_cli("ledger", save(MM), save(MM16, "c.onnx"), "--target", "h200", "--measured",
                _results(tmp_path, "0123456789abcdef", {"fp32": 1.0, "converted": 0.5}))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "results.json: key 'kit'" in r.stderr and "another model" in r.stderr


def test_the_fit_of_one_kit_reproduces_its_rows_through_the_written_profile(
        save, tmp_path: Path):
    from npuprep.ledger.kit import kit_fingerprint
    from npuprep.model_io import load_model

    model, converted = save(MM), save(MM16, "c.onnx")
    doc = json.loads(run_cli("ledger", model, converted, "--target", "h200", "--json").stdout)
    rows = {r["format"]: r for r in doc["formats"]}
    launches = {k: sum(1 for n in doc["nodes"][k] if not n["fused"]) for k in ("fp32", "converted")}
    # the board is 3x slower than the profile's roofline and pays 7 us per kernel
    measured = {k: 3 * rows[k]["estimated_ms"] + launches[k] * 7e-3 for k in launches}
    kit = kit_fingerprint({"fp32": load_model(model).proto, "converted": load_model(converted).proto})
    fitted = tmp_path / "fitted.yaml"
    r = run_cli("ledger", model, converted, "--target", "h200", "--measured",
                _results(tmp_path, kit, measured), "--fitted-profile", fitted, "--json")
    assert r.returncode == 0, r.stderr
    fit = json.loads(r.stdout)["measured"]["fit"]
    # two rows cannot tell a scale from a launch cost: the fit matches both, nearest the profile
    assert [r["fitted_vs_measured"] for r in fit["rows"]] == pytest.approx([1.0, 1.0], rel=1e-4)
    assert "onnxruntime 1.x CPU on x86_64" in json.loads(r.stdout)["measured"]["measured_on"]
    again = json.loads(run_cli("ledger", model, converted, "--target", fitted, "--json").stdout)
    for row in again["formats"]:
        if row["format"] in measured:
            assert row["estimated_ms"] == pytest.approx(measured[row["format"]], rel=1e-4)


def test_the_kit_refuses_a_provider_this_onnxruntime_lacks(save, tmp_path: Path):
    kit = tmp_path / "kit"
    assert run_cli("ledger", save(CONV), "--target", "h200", "--export-kit", kit).returncode == 0
    readme = (kit / "README.md").read_text()
    assert "trtexec --onnx=models/fp32.onnx --noTF32" in readme
    run = subprocess.run([sys.executable, str(kit / "time_models.py"), "--warmup", "1", "--runs", "1",
                          "--providers", "NoSuchExecutionProvider,CPUExecutionProvider"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "refused: NoSuchExecutionProvider" in run.stderr
    assert not (kit / "results.json").exists()
