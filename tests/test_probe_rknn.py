"""`probe --backend rknn`: micro-probes and the layer probe in rknn-toolkit2's simulator, and its kit."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import onnx

from npuprep.profiles import load_profile
from tests.conftest import run_cli

CONV_BN = Path(__file__).parent / "fixtures" / "rknn" / "conv_bn.onnx"


def test_rknn_kit_ships_fp32_models_and_the_runner(tmp_path):
    kit = tmp_path / "kit"
    done = run_cli("probe", "--target", "rk3588", "--backend", "rknn", "--export-kit", kit,
                   "--probes", "conv,exp")
    assert done.returncode == 0, done.stderr
    assert (kit / "run_rknn_kit.py").is_file() and (kit / "rknn_job.py").is_file()
    model = onnx.load(str(kit / "models" / "conv.onnx"))
    # The toolkit lowers the model itself: the kit's graph stays FP32.
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert "run_rknn_kit.py --board" in (kit / "README.md").read_text()


def test_micro_probes_measure_inf_and_write_the_profile(rknn_python, tmp_path):
    out = tmp_path / "measured.yaml"
    done = run_cli("probe", "--target", "rk3588", "--backend", "rknn", "--probes", "conv,cast",
                   "--vendor-python", rknn_python, "--write-profile", out, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["backend"] == "rknn(rk3588 simulator)"
    assert {p["name"]: p["verdict"] for p in doc["probes"]} == {"conv": "inf", "cast": "inf"}
    profile = load_profile(out)
    assert str(profile.overflow) == "inf"
    assert "rknn(rk3588 simulator)" in profile.sources["overflow"]


def test_the_kit_runs_in_the_simulator_and_classifies(rknn_python, tmp_path):
    kit = tmp_path / "kit"
    assert run_cli("probe", CONV_BN, "--target", "rk3588", "--backend", "rknn", "--export-kit",
                   kit, "--micro", "--probes", "exp").returncode == 0
    ran = subprocess.run([rknn_python, str(kit / "run_rknn_kit.py"), "--target", "rk3588"],
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert (kit / "models" / "exp.rknn").is_file()
    done = run_cli("probe", "--classify", kit, "--outputs", kit / "outputs", "--json")
    assert done.returncode == 0, done.stderr
    verdicts = {p["name"]: p["verdict"] for p in json.loads(done.stdout)["probes"]}
    assert verdicts["exp"] == "inf" and verdicts["layer"] in ("inf", "nan")


def test_a_missing_vendor_python_is_one_line(tmp_path):
    done = run_cli("probe", "--target", "rk3588", "--backend", "rknn", "--probes", "conv",
                   "--vendor-python", tmp_path / "missing")
    assert done.returncode == 2
    assert "--vendor-python" in done.stderr and "Traceback" not in done.stderr



def test_rknn_backend_refuses_a_format_it_does_not_build():
    done = run_cli("probe", "--target", "rk3588", "--backend", "rknn", "--precision", "fp8_e4m3")
    assert done.returncode == 2 and "cannot probe fp8_e4m3" in done.stderr
