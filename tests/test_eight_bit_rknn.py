"""An INT8 model through the rknn-toolkit2 simulator (rk3588): the vendor's own INT8 of the FP32
model (alone, and with named layers in FP16: hybrid), npuprep's QDQ model as the toolkit
imports it, each beside npuprep's QDQ error; `convert --verify-with rknn` end to end; the
INT8 clipping probe on the simulator."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import model_with_weights, run_cli
from test_eight_bit import CONVS, _convert

from npuprep.runtime.session import make_session, run
from npuprep.vendors.rockchip import run_rknn, vendor_python

pytestmark = pytest.mark.skipif(vendor_python() is None,
                                reason="no rknn-toolkit2 venv ($NPUPREP_RKNN_PYTHON or "
                                       "~/.cache/npuprep/rknn-venv)")


def _rel(got: list[np.ndarray], ref: list[np.ndarray]) -> float:
    num = sum(float(np.sum((g - r) ** 2)) for g, r in zip(got, ref, strict=True))
    return float(np.sqrt(num / sum(float(np.sum(r**2)) for r in ref)))


def test_an_int8_model_through_the_rknn_simulator(tmp_path):
    rng = np.random.default_rng(1)
    # x -> Conv -> Relu -> Conv -> y, weights of about unit gain
    model = model_with_weights(tmp_path, CONVS, {"W1": rng.standard_normal((8, 4, 3, 3)) / 6,
                                     "W2": rng.standard_normal((4, 8, 3, 3)) / 8})
    feeds = [{"x": rng.standard_normal((1, 4, 8, 8)).astype(np.float32)} for _ in range(6)]
    calib, held = feeds[:4], feeds[4:]
    result = _convert(model, calib, "int8")
    ref = [run(make_session(model.proto), f)["y"] for f in held]
    ours = _rel([run(make_session(result.lowered.model), f)["y"] for f in held], ref)
    vendor = run_rknn(model.proto, held, quantize_on=calib, work_dir=tmp_path / "vendor_int8")
    assert vendor, vendor.refusal
    assert (tmp_path / "vendor_int8" / "dataset.txt").read_text().count("\n") == len(calib)
    imported = run_rknn(result.lowered.model, held, work_dir=tmp_path / "qdq")
    assert imported, imported.refusal
    theirs = _rel([o["y"] for o in vendor.outputs], ref)
    as_imported = _rel([o["y"] for o in imported.outputs], ref)
    # All three are 8-bit errors: above FP16's (~1e-3), within the 5e-2 tolerance.
    assert 2e-3 < ours < 5e-2 and 2e-3 < theirs < 5e-2 and as_imported < 5e-2


def _two_convs(tmp_path):
    rng = np.random.default_rng(1)
    # x -> Conv -> Relu -> Conv -> y, weights of about unit gain
    return model_with_weights(tmp_path, CONVS, {"W1": rng.standard_normal((8, 4, 3, 3)) / 6,
                                    "W2": rng.standard_normal((4, 8, 3, 3)) / 8}), rng


def test_the_toolkit_keeps_the_layers_named_for_hybrid_quantisation_in_fp16(tmp_path):
    model, rng = _two_convs(tmp_path)
    calib = [{"x": rng.standard_normal((1, 4, 8, 8)).astype(np.float32)} for _ in range(4)]
    held = [{"x": rng.standard_normal((1, 4, 8, 8)).astype(np.float32)} for _ in range(2)]
    ref = [run(make_session(model.proto), f)["y"] for f in held]
    alone = run_rknn(model.proto, held, quantize_on=calib, work_dir=tmp_path / "alone")
    # conv2 is named by its output 'y'; 'gone' is no tensor of the toolkit's graph.
    hybrid = run_rknn(model.proto, held, quantize_on=calib, hybrid_fp16=[["y"], "gone"],
                      work_dir=tmp_path / "hybrid")
    assert alone and hybrid, alone.refusal or hybrid.refusal
    assert hybrid.extra == {"hybrid_fp16": "y", "hybrid_unknown": "gone"}
    assert "custom_quantize_layers: {y: float16}" in (tmp_path / "hybrid" /
                                                      "model.quantization.cfg").read_text()
    int8 = _rel([o["y"] for o in alone.outputs], ref)
    fp16_last = _rel([o["y"] for o in hybrid.outputs], ref)
    # The last Conv in FP16 removes its 8-bit rounding: the error drops, conv1's remains.
    assert 2e-3 < fp16_last < 0.9 * int8


def test_convert_int8_verify_with_rknn_runs_the_three_vendor_paths_on_the_held_out_samples(
        tmp_path, rknn_python):
    model, rng = _two_convs(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        np.savez(data / f"s{i}.npz", x=rng.standard_normal((1, 4, 8, 8)).astype(np.float32))
    out = tmp_path / "out" / "m.onnx"
    done = run_cli("convert", model.path, "--target", "rk3588", "--precision", "int8", "--data",
                   data, "-o", out, "--verify-with", "rknn", "--vendor-python", rknn_python,
                   "--json")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    vendor = report["vendor"]
    eight = vendor["eight_bit"]
    paths = {p["path"]: p for p in eight["paths"]}
    assert set(paths) == {"qdq_import", "hybrid", "vendor_int8"}
    assert all(p["built"] for p in paths.values()), [p["refusal"] for p in paths.values()]
    # The held-out split (2 of 8) is what the vendor ran; the verdict is the imported QDQ's.
    assert vendor["samples"] == report["holdout"]["samples"] == 2
    assert eight["chosen"] == "qdq_import" and vendor["passed"]
    ours = eight["npuprep_rel_l2"]
    imported = paths["qdq_import"]["worst_rel_l2"]
    assert vendor["outputs"]["y"]["rel_l2"] == pytest.approx(imported)
    # 8-bit errors all, within the 5e-2 default; the imported QDQ keeps npuprep's scales, so
    # the simulator lands near onnxruntime's run of the same model.
    assert 2e-3 < ours < 5e-2 and 2e-3 < imported < 5e-2
    assert imported == pytest.approx(ours, rel=0.6)
    assert paths["vendor_int8"]["worst_rel_l2"] < 5e-2


def test_the_int8_clipping_probe_on_the_rknn_simulator_saturates(rknn_python):
    done = run_cli("probe", "--target", "rk3588", "--precision", "int8", "--backend", "rknn",
                   "--vendor-python", rknn_python, "--json")
    assert done.returncode == 0, done.stderr
    probe = json.loads(done.stdout)["probes"][0]
    assert probe["verdict"] == "saturate"
    # +-1.5 past the calibrated 1.0 comes back within one INT8 step of +-1.
    assert all(abs(abs(o) - 1.0) < 2 / 127 for _, o in probe["pairs"])
