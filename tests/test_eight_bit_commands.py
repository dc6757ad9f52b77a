"""check, probe, crosscheck and checklist with --precision int8|fp8_e4m3: the scale's clipping
and FP8's 448 line in the findings, the INT8 clipping probe, an 8-bit layer the compiler runs
wider as a note, the 8-bit artefacts in the checklist; the rknn 8-bit paths' graph helpers."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import model_with_weights, run_cli
from onnx import helper, numpy_helper, parser
from test_eight_bit import softmax_plan

from npuprep.errors import NpuprepError
from npuprep.plan.layer_precision import LayerPrecision
from npuprep.probe.int8_clip import classify_clipping
from npuprep.runtime.session import make_session, run
from npuprep.verify.vendor_8bit import float_layer, paths_table, wider_tensors

RNG = np.random.default_rng(11)

# x [512, 8] -> MatMul(W) -> y
PROJ = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[512, 8] x) => (float[512, 4] y) {
    [proj] y = MatMul (x, W)
}
"""


def _proj(tmp_path):
    model = model_with_weights(tmp_path, PROJ, {"W": RNG.standard_normal((8, 4))})
    data = tmp_path / "data"
    data.mkdir()
    feeds = []
    for i in range(4):
        x = RNG.standard_normal((512, 8)).astype(np.float32)
        x[0, 0] = 40.0 if i == 0 else x[0, 0]  # one outlier in 16384 values: the 99.99th percentile cuts it
        feeds.append(x)
        np.savez(data / f"s{i}.npz", x=x)
    return model, data, np.concatenate(feeds)


def test_check_int8_names_the_share_of_values_the_scale_clips(tmp_path):
    model, data, x = _proj(tmp_path)
    done = run_cli("check", model.path, "--target", "a2000", "--precision", "int8", "--data", data,
                   "--json")
    assert done.returncode == 0, done.stderr
    found = [f for f in json.loads(done.stdout)["findings"] if f["rule"] == "range.scale_clip"]
    assert [(f["node"], f["tensor"]) for f in found] == [("proj", "x")]
    ev = found[0]["evidence"]
    assert ev["format"] == "int8" and ev["scale_rule"] == "percentile"
    assert ev["clip"] < ev["absmax"] == pytest.approx(40.0)
    assert ev["scale"] == pytest.approx(ev["clip"] / 127)
    # The share read from the statistics is the share of |x| above the clip in the samples.
    assert ev["clipped_fraction"] == pytest.approx(np.mean(np.abs(x) > ev["clip"]), abs=1 / x.size)
    # One value in 16384 is the tail a percentile clip cuts by design: information, no warning.
    assert ev["clipped_fraction"] > 0 and found[0]["severity"] == "info"


def test_check_fp8_draws_the_448_line_and_an_abs_max_clip_clips_nothing(tmp_path):
    model, data, _ = _proj(tmp_path)
    html = tmp_path / "check.html"
    done = run_cli("check", model.path, "--target", "a2000", "--precision", "fp8_e4m3", "--data",
                   data, "--html", html, "--json")
    assert done.returncode == 0, done.stderr
    assert "fp8_e4m3 max 448" in html.read_text()
    found = [f for f in json.loads(done.stdout)["findings"] if f["rule"] == "range.scale_clip"]
    assert found and found[0]["evidence"]["format"] == "fp8_e4m3"
    assert "range.scale_clip" in html.read_text()
    # Without --precision no 8-bit finding and no FP8 line.
    plain = run_cli("check", model.path, "--target", "a2000", "--data", data, "--html", html)
    assert plain.returncode == 0 and "scale_clip" not in plain.stdout
    assert "fp8_e4m3 max 448" not in html.read_text()


def test_crosscheck_an_int8_layer_the_compiler_runs_wider_is_a_note_not_a_failure(tmp_path):
    model, plan = softmax_plan(tmp_path)
    report = tmp_path / "layers.csv"
    # The plan puts logits and mix in INT8; the compiler runs mix in FP16.
    report.write_text("node,precision\nlogits,int8\nexp,fp16\nnormalise,fp16\nmix,fp16\n")
    done = run_cli("crosscheck", model.path, "-r", report, "-t", "a2000", "--plan", plan, "--json")
    doc = json.loads(done.stdout)
    verdicts = {v["node"]: v for v in doc["verdicts"]}
    assert verdicts["mix"]["verdict"] == "ok" and "wider than the plan's int8" in verdicts["mix"]["reason"]
    assert "wider_than_planned" not in verdicts["logits"]["evidence"]
    assert any("1 layer(s) the plan puts in int8 run wider" in n and "mix" in n for n in doc["notes"])
    assert done.returncode == 0, done.stdout


def test_checklist_of_an_int8_plan_carries_the_qdq_model_dataset_and_kept_wider_layers(tmp_path):
    model, plan = softmax_plan(tmp_path)
    done = run_cli("checklist", model.path, "--target", "rk3588", "--plan", plan, "--json")
    assert done.returncode == 0, done.stderr
    item = next(i for i in json.loads(done.stdout)["items"] if i["key"] == "precision")
    said = " ".join(item["evidence"] + item["steps"])
    assert "8-bit (int8)" in said and "QDQ model" in said and "calibration dataset" in said
    assert "--precision int8" in said and "--verify-with rknn" in said
    assert "`exp`" in said  # a layer the plan keeps wider
    fp16 = run_cli("checklist", model.path, "--target", "rk3588", "--json")
    assert "QDQ model" not in fp16.stdout


def test_probe_int8_emulated_saturates_at_the_calibrated_clip():
    done = run_cli("probe", "--target", "a2000", "--precision", "int8", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["format"] == "int8" and doc["overall"]["verdict"] == "saturate"
    assert all(abs(abs(o) - 1.0) < 2 / 127 for _, o in doc["probes"][0]["pairs"])
    refused = run_cli("probe", "--target", "a2000", "--precision", "int8", "--backend", "ort")
    assert refused.returncode == 2 and "emulate, rknn or openvino" in refused.stderr


def test_int8_clipping_is_told_from_wrapping_and_from_no_clipping():
    ref = np.array([2.0, -2.0, 4.0, 0.5], np.float32)
    assert classify_clipping(ref, np.array([1.0, -1.0, 1.0, 0.5]), "x").verdict == "saturate"
    assert classify_clipping(ref, np.array([-0.4, 0.4, -1.0, 0.5]), "x").verdict == "wrap"
    assert classify_clipping(ref, ref, "x").verdict == "no-clip"


def test_the_hybrid_names_a_wider_layer_by_its_output_and_the_outputs_fused_into_it():
    # x -> [conv] Conv -> [bn] BatchNormalization -> [act] Relu -> [tail] Conv -> y
    proto = parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1, 2, 4, 4] x) => (float[1, 2, 4, 4] y) {
        [conv] a = Conv (x, W)
        [bn] b = BatchNormalization (a, s, o, m, v)
        [act] r = Relu (b)
        [tail] y = Conv (r, W)
    }
    """)
    layers = [LayerPrecision("conv", "fp16", "kept"), LayerPrecision("tail", "int8", "8-bit")]
    assert wider_tensors(proto, layers) == [["a", "b", "r"]]


def test_float_layer_takes_a_layer_out_of_int8_weights_and_inputs_alike():
    w8 = np.array([[[[10]], [[-20]]], [[[127]], [[-128]]]], np.int8)  # [2, 2, 1, 1]
    scale = np.array([0.5, 0.01], np.float32)
    # x -> Q -> DQ -> Conv(DequantizeLinear(w8, scale, 0, axis=0)) -> y
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "xs"], ["xq"]),
         helper.make_node("DequantizeLinear", ["xq", "xs"], ["x_dq8"]),
         helper.make_node("DequantizeLinear", ["w8", "ws", "wz"], ["w_dq8"], axis=0),
         helper.make_node("Conv", ["x_dq8", "w_dq8"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2, 1, 1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2, 1, 1])],
        [numpy_helper.from_array(w8, "w8"), numpy_helper.from_array(scale, "ws"),
         numpy_helper.from_array(np.zeros(2, np.int8), "wz"),
         numpy_helper.from_array(np.array(0.1, np.float32), "xs")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    wide = float_layer(model, "w_dq8")
    assert [(n.op_type, list(n.input)) for n in wide.graph.node] == [("Conv", ["x", "w_dq8"])]
    x = np.array([1.03, 2.07], np.float32)
    w = (w8.reshape(2, 2) * scale[:, None]).astype(np.float32)
    got = run(make_session(wide), {"x": x.reshape(1, 2, 1, 1)})["y"].reshape(2)
    assert np.allclose(got, w @ x, rtol=1e-6)
    with pytest.raises(NpuprepError):
        float_layer(model, "x_dq8")  # an activation, not a constant weight


def test_the_terminal_table_puts_npuprep_first_and_marks_the_verdict():
    out = {"y": {"nonfinite": 0, "max_abs_error": 0.03, "rel_l2": 0.012}}
    eight = {"chosen": "qdq_import", "npuprep_rel_l2": 0.011, "npuprep_max_abs_error": 0.02,
             "paths": [{"path": "qdq_import", "built": True, "outputs": out, "worst_rel_l2": 0.012,
                        "refusal": "", "fp16_tensors": []},
                       {"path": "hybrid", "built": True, "outputs": out, "worst_rel_l2": 0.012,
                        "refusal": "", "fp16_tensors": ["a"]},
                       {"path": "vendor_int8", "built": False, "outputs": {}, "worst_rel_l2": None,
                        "refusal": "build: no", "fp16_tensors": []}]}
    title, header, rows = paths_table(eight)
    assert "hybrid: 1 layers FP16" in title and "max abs err" in header
    assert rows[0] == ("npuprep QDQ in onnxruntime", "", "", 0.02, 0.011)
    assert rows[1][0].endswith("(verdict)") and rows[3][1:] == ("no", "", "", "build: no")
