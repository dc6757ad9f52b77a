"""A random-logit classifier (logits ~1e-10): its FAILED line names the underflow, then the gate."""

from __future__ import annotations

import json

import numpy as np
import onnx
from conftest import run_cli
from onnx import TensorProto, helper, numpy_helper

from npuprep.report.cause import failure_cause


def _random_logit_classifier(tmp_path, squash=False):
    # x -> Gemm(W1 ~ 1e-12) -> Relu -> Gemm(W2 ~ 4) -> logits ~1e-10 [-> Tanh when squash]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((64, 64)) * 1e-12).astype(np.float32), "W1"),
             numpy_helper.from_array((rng.standard_normal((64, 10)) * 4.0).astype(np.float32), "W2")]
    nodes = [helper.make_node("Gemm", ["x", "W1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "W2"], ["z" if squash else "logits"], name="fc2")]
    nodes += [helper.make_node("Tanh", ["z"], ["logits"], name="squash")] if squash else []
    graph = helper.make_graph(nodes, "random_logits",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
                              inits)
    path = tmp_path / "cls.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        np.savez(data / f"s{i}.npz", x=rng.uniform(0, 1, (1, 64)).astype(np.float32))
    return path, data


def test_random_logit_classifier_on_rk3588_leaves_the_logits_scaled_up_for_the_host(tmp_path):
    # rk3588 would run the lift's compensating Mul in FP16 and flush the logits: the host does it
    path, data = _random_logit_classifier(tmp_path)
    proc = run_cli("convert", path, "-t", "rk3588", "--data", data, "-o", tmp_path / "c.onnx")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = " ".join(proc.stdout.split())
    assert "multiply it by 2^-" in said and "smallest fp16 normal" in said
    factor = json.loads((tmp_path / "c.report.json").read_text())["host_scales"]["logits"]
    assert 0 < factor < 1


def test_random_logit_classifier_failed_line_names_underflow_first(tmp_path):
    # a Tanh after the logits stops the lift before the output: logits of 1e-10 flush in FP16
    path, data = _random_logit_classifier(tmp_path, squash=True)
    proc = run_cli("convert", path, "-t", "rk3588", "--data", data, "-o", tmp_path / "c.onnx")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdict = " ".join(proc.stdout.split("\nFAILED: ")[-1].split())
    assert verdict.startswith("underflow: output logits lives at |x| <= "), proc.stdout
    assert "under the smallest fp16 normal" in verdict
    assert "; then outputs over their tolerance" in verdict


def test_no_cause_for_a_pass_or_a_failure_without_underflow():
    passed = {"passed": True, "precision": "fp16"}
    overflow = {"passed": False, "precision": "fp16", "findings": [], "actions": [],
                "verification": {"rtol": 0.01, "outputs": {"y": {"nonfinite": 3, "rel_l2": 1.0}}}}
    assert failure_cause(passed) == "" and failure_cause(overflow) == ""


def test_share_gate_failure_names_the_weights_an_underflow_scale_pushed_up():
    # a user plan lifts fc2 by 2^20: W2 past FP16, fc2 kept FP32; the cause precedes the gate
    report = {"passed": False, "precision": "fp16",
              "actions": [{"action": "rescale", "entry": "fc2", "k": -20, "absorbers": []}],
              "forced_fp32": {"fc2": "weight 'W2' reaches 849825, beyond fp16 max 65504 (kept FP32, not clipped)"}}
    assert failure_cause(report) == ("underflow: lifting fc2 out of fp16's subnormals pushes "
                                     "weights of fc2 past fp16 (849825 .. 849825), which keeps "
                                     "them FP32")
