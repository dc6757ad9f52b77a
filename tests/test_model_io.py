"""Model loading as real exports need it: external data, >2 GB weights, BF16, subgraphs, bad files."""

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from conftest import run_cli
from onnx import TensorProto, helper, numpy_helper

from npuprep.analyse import static_findings
from npuprep.graph import to_array
from npuprep.model_io import PROTOBUF_LIMIT, fingerprint, load_model
from npuprep.profiles import load_profile


def _gather_model(weight: onnx.TensorProto) -> onnx.ModelProto:
    # W (initialiser) -> Gather(W, idx) -> y
    graph = helper.make_graph(
        [helper.make_node("Gather", ["W", "idx"], ["y"], name="take")], "g",
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_external_data_model_loads_with_the_same_fingerprint(tmp_path: Path):
    w = np.linspace(-3, 3, 4096, dtype=np.float32)
    model = _gather_model(numpy_helper.from_array(w, "W"))
    onnx.save(model, str(tmp_path / "inline.onnx"))
    onnx.save(model, str(tmp_path / "ext.onnx"), save_as_external_data=True,
              location="ext.onnx.data", size_threshold=0)
    assert (tmp_path / "ext.onnx.data").stat().st_size == w.nbytes
    inline, ext = load_model(tmp_path / "inline.onnx"), load_model(tmp_path / "ext.onnx")
    assert np.array_equal(to_array(ext.graph.initializer[0]), w)
    assert ext.fingerprint == inline.fingerprint and ext.opset == 17


def test_model_over_2gb_of_external_weights_loads_and_is_analysed(tmp_path: Path):
    # W: 2^29 + 2^20 float32 (2.15 GB, past the protobuf limit), zeros but one 1e6 -> Gather -> y
    n = 2**29 + 2**20
    data = tmp_path / "big.onnx.data"
    with open(data, "wb") as fh:
        fh.truncate(4 * n)  # sparse file: no 2 GB write
        fh.seek(4 * 12345)
        fh.write(np.array([1e6], np.float32).tobytes())
    weight = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[n])
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", data.name), ("offset", "0"), ("length", str(4 * n))):
        weight.external_data.add(key=key, value=value)
    onnx.save(_gather_model(weight), str(tmp_path / "big.onnx"))
    assert 4 * n > PROTOBUF_LIMIT

    model = load_model(tmp_path / "big.onnx")
    assert model.opset == 17
    # The weights were read in full: the analysis finds the one planted value among 2^29 zeros.
    found = [f for f in static_findings(model, load_profile("generic").resolve()) if f.rule == "init.out_of_range"]
    assert len(found) == 1 and found[0].tensor == "W"
    assert found[0].evidence["count"] == 1 and found[0].evidence["worst"] == 1e6
    assert fingerprint(model.proto) == model.fingerprint


def test_bf16_initialisers_and_casts_load_as_bf16(save):
    # x -> Cast(to=BF16) -> Mul(., W_bf16) -> Cast(to=FP32) -> y
    w = np.array([1.5, -2.25, 3.0e38], dtype=ml_dtypes.bfloat16)
    init = numpy_helper.from_array(w, "W")
    assert init.data_type == TensorProto.BFLOAT16
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16, name="to_bf16"),
         helper.make_node("Mul", ["xb", "W"], ["yb"], name="mul"),
         helper.make_node("Cast", ["yb"], ["y"], to=TensorProto.FLOAT, name="to_fp32")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])], [init])
    model = load_model(save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])))
    loaded = to_array(model.graph.initializer[0])
    assert loaded.dtype == ml_dtypes.bfloat16
    assert loaded.astype(np.float32).tolist() == w.astype(np.float32).tolist()
    rules = {(f.rule, f.evidence["kind"]) for f in static_findings(model, load_profile("a2000").resolve())
             if f.rule.startswith("dtype.")}
    assert {("dtype.unsupported", "constant"), ("dtype.unsupported", "cast")} <= rules


def test_if_loop_and_scan_bodies_are_visited(save):
    # If(c): then Exp(x) | else Identity(x);  Loop body: Pow(v, 2);  Scan body: Log(e)
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (bool c, float[4] x, int64 trips, float[3, 2] seq) => (float[4] r, float[4] lv, float[2] acc) {
        r = If (c) <
            then_branch = t () => (float[4] t_out) { t_out = Exp (x) },
            else_branch = e () => (float[4] e_out) { e_out = Identity (x) }
        >
        lv = Loop (trips, , x) <body = b (int64 i, bool cond, float[4] v) => (bool cond_out, float[4] v_out) {
            cond_out = Identity (cond)
            two = Constant <value = float {2.0}> ()
            v_out = Pow (v, two)
        }>
        acc = Scan (seq) <num_scan_inputs = 1, body = s (float[2] e) => (float[2] l) {
            l = Log (e)
        }>
    }
    """
    model = load_model(save(text))
    by_rule = {f.rule: f for f in static_findings(model, load_profile("generic").resolve())}
    assert by_rule["hazard.exp"].scope == "main/node_of_r.then_branch"
    assert by_rule["hazard.square"].scope == "main/node_of_lv.body"
    assert by_rule["hazard.log"].scope == "main/node_of_acc.body"
    assert all(f.scope.startswith("main/") for f in by_rule.values() if f.rule.startswith("hazard."))


def test_opset_is_reported(save):
    # x -> Relu -> y, declared opset 13 and 19
    paths = {opset: save(f"""<ir_version: 9, opset_import: ["" : {opset}]>
        g (float[2] x) => (float[2] y) {{ y = Relu (x) }}""", name=f"m{opset}.onnx") for opset in (13, 19)}
    assert load_model(paths[13]).opset == 13
    r = run_cli("check", paths[19], "--target", "generic", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["opset"] == 19


def _one_line_exit_2(path: Path, *needles: str) -> None:
    r = run_cli("check", path, "--target", "generic")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in lines[0]


def test_bad_model_files_are_one_line_and_exit_2(tmp_path: Path, save):
    not_onnx = tmp_path / "notes.onnx"
    not_onnx.write_text("this is not a model\n" * 10)
    _one_line_exit_2(not_onnx, str(not_onnx))

    # W -> Gather -> y, cut in half
    model = _gather_model(numpy_helper.from_array(np.ones(1000, np.float32), "W"))
    whole = save(model, "whole.onnx").read_bytes()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(whole[: len(whole) // 2])
    _one_line_exit_2(truncated, str(truncated))

    onnx.save(model, str(tmp_path / "ext.onnx"), save_as_external_data=True,
              location="weights.bin", size_threshold=0)
    (tmp_path / "weights.bin").unlink()
    _one_line_exit_2(tmp_path / "ext.onnx", "weights.bin", "'W'")

    _one_line_exit_2(tmp_path / "missing.onnx", "missing.onnx")
