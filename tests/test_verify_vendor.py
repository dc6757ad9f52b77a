"""`convert --verify-with rknn` and `compare --with rknn`: the vendor's simulator beside emulation."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from npuprep.examples.zoo import ZOO
from npuprep.verify.vendor import VendorCheck
from tests.conftest import run_cli


@pytest.fixture
def conv_stack(tmp_path):
    """x -> Conv -> Relu -> Conv (activations ~1e5) -> Relu -> Conv -> y (fits FP16)."""
    zoo = ZOO["conv_stack"]()
    onnx.save(zoo.model, str(tmp_path / "m.onnx"))
    data = tmp_path / "data"
    data.mkdir()
    for i, sample in enumerate(zoo.samples):
        np.savez(data / f"s{i}.npz", **sample)
    return tmp_path


def test_vendor_check_is_truthy_only_when_built_finite_and_close():
    good = VendorCheck("rknn", "rk3588", 1e-2, 1, True, "done",
                       outputs={"y": {"nonfinite": 0, "rel_l2": 1e-3, "max_abs_error": 0.1}})
    inf = VendorCheck("rknn", "rk3588", 1e-2, 1, True, "done",
                      outputs={"y": {"nonfinite": 3, "rel_l2": 1e-3, "max_abs_error": 0.1}})
    refused = VendorCheck("rknn", "rk3588", 1e-2, 1, False, "build", refusal="not support")
    assert good and not inf and not refused
    assert refused.to_dict()["refusal"] == "not support"


def test_convert_verify_with_rknn_reports_the_simulator_beside_emulation(rknn_python, conv_stack):
    out = conv_stack / "out.onnx"
    done = run_cli("convert", conv_stack / "m.onnx", "--target", "rk3588", "--data",
                   conv_stack / "data", "-o", out, "--verify-with", "rknn",
                   "--vendor-python", rknn_python)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Outputs in rknn-toolkit2's simulator (rk3588)" in done.stdout
    report = json.loads((conv_stack / "out.report.json").read_text())
    vendor = report["vendor"]
    assert vendor["built"] and vendor["passed"]
    assert vendor["outputs"]["y"]["nonfinite"] == 0 and vendor["outputs"]["y"]["rel_l2"] <= 1e-2
    assert vendor["layers"]["counts"]["non-finite"] == 0
    assert (conv_stack / "out.rknn_error_analysis.txt").is_file()


def test_compare_with_rknn_fails_the_fp32_model(rknn_python, conv_stack):
    m = conv_stack / "m.onnx"
    done = run_cli("compare", m, m, "--data", conv_stack / "data", "--target", "rk3588",
                   "--with", "rknn", "--vendor-python", rknn_python, "--json")
    assert done.returncode == 1, done.stderr[-3000:]
    vendor = json.loads(done.stdout)["vendor"]
    assert vendor["outputs"]["y"]["nonfinite"] > 0
    assert vendor["layers"]["non_finite"]


def test_a_host_scaled_output_is_finite_in_the_simulator(rknn_python, tmp_path):
    """guidance: y = eps_c + 7.5 (eps_c - eps_u) reaches 1.1e5; it leaves the NPU divided by 4."""
    zoo = ZOO["guidance"]()
    onnx.save(zoo.model, str(tmp_path / "m.onnx"))
    data = tmp_path / "data"
    data.mkdir()
    for i, sample in enumerate(zoo.samples):
        np.savez(data / f"s{i}.npz", **sample)
    done = run_cli("convert", tmp_path / "m.onnx", "--target", "rk3588", "--data", data,
                   "-o", tmp_path / "out.onnx", "--verify-with", "rknn",
                   "--vendor-python", rknn_python, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["host_scales"] == {"y": 4.0}
    vendor = report["vendor"]
    assert vendor["host_scales"] == {"y": 4.0}
    assert vendor["outputs"]["y"]["nonfinite"] == 0 and vendor["outputs"]["y"]["rel_l2"] <= 1e-2
