"""`npuprep targets` lists and shows profiles; a bad profile is one line and exit 2; start-up stays light."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import run_cli


def test_targets_lists_builtins_with_a_summary():
    r = run_cli("targets")
    assert r.returncode == 0, r.stderr
    for name in ("generic", "orin", "a2000"):
        assert name in r.stdout
    assert "Huashan" in r.stdout and "unknown" in r.stdout


def test_targets_shows_one_in_full_and_as_json():
    r = run_cli("targets", "a2000")
    assert r.returncode == 0, r.stderr
    assert "unsupported:" in r.stdout and "bf16" in r.stdout and "sources:" in r.stdout
    data = json.loads(run_cli("targets", "orin", "--json").stdout)
    assert data["name"] == "orin" and data["overflow"] == "inf" and "bf16" in data["dtypes"]["slow"]


def test_targets_accepts_a_user_path_and_rejects_a_broken_one(tmp_path: Path):
    good = tmp_path / "board.yaml"
    good.write_text(
        "name: board\ndescription: d\ndtypes: {fast: [fp16]}\ndefault_precision: fp16\n"
        "overflow: nan\nfp32_pinning: none\n"
    )
    r = run_cli("targets", str(good))
    assert r.returncode == 0 and "name: board" in r.stdout
    bad = tmp_path / "broken.yaml"
    bad.write_text(good.read_text().replace("fp32_pinning: none", "fp32_pinning: sometimes"))
    r = run_cli("targets", str(bad))
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "fp32_pinning" in lines[0]


def test_cli_start_up_imports_no_heavy_runtime():
    code = ("import sys, npuprep.cli.main as m; m.build_parser(); "
            "print(sorted(k for k in ('onnxruntime', 'onnx_graphsurgeon', 'onnx') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
