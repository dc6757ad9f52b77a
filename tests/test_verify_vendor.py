"""`convert --verify-with rknn` and `compare --with rknn`: the vendor's simulator beside emulation."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from npuprep.examples.zoo import ZOO
from npuprep.verify.vendor import VendorCheck
from tests.conftest import run_cli, save_zoo


@pytest.fixture
def conv_stack(tmp_path):
    """x -> Conv -> Relu -> Conv (activations ~1e5) -> Relu -> Conv -> y (fits FP16)."""
    save_zoo("conv_stack", tmp_path)
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
    _, data = save_zoo("guidance", tmp_path)
    done = run_cli("convert", tmp_path / "m.onnx", "--target", "rk3588", "--data", data,
                   "-o", tmp_path / "out.onnx", "--verify-with", "rknn",
                   "--vendor-python", rknn_python, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["host_scales"] == {"y": 4.0}
    vendor = report["vendor"]
    assert vendor["host_scales"] == {"y": 4.0}
    assert vendor["outputs"]["y"]["nonfinite"] == 0 and vendor["outputs"]["y"]["rel_l2"] <= 1e-2


def test_an_if_the_toolkit_refuses_builds_once_convert_removed_it(rknn_python, tmp_path):
    """x -> Gemm -> h ; If(flag): sqrt(mean(h*h)) (h*h overflows FP16) ; else mean(h) -> y.
    The toolkit refuses the If; convert for rk3588 computes both branches, selects with Where
    (the bool flag is a rank-0 input: given to the toolkit as [1]) and rescales the square."""
    zoo = ZOO["if_body_hazard"]()
    onnx.save(zoo.model, str(tmp_path / "m.onnx"))
    (tmp_path / "data").mkdir()
    for i, sample in enumerate(zoo.samples):
        np.savez(tmp_path / "data" / f"s{i}.npz", **sample)
    out = tmp_path / "out.onnx"
    done = run_cli("convert", tmp_path / "m.onnx", "--target", "rk3588", "--data",
                   tmp_path / "data", "-o", out, "--verify-with", "rknn",
                   "--vendor-python", rknn_python)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out.report.json").read_text())
    assert any(n.startswith("If node 'branch' replaced before planning") for n in report["notes"])
    y = report["vendor"]["outputs"]["y"]
    assert report["vendor"]["built"] and y["nonfinite"] == 0 and y["rel_l2"] <= 1e-2
