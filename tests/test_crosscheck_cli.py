"""`npuprep crosscheck` end to end: exit codes, --json, --report-md, --plan, bad input."""

from __future__ import annotations

import json

import onnx
from conftest import run_cli
from test_crosscheck_readers import FIXTURES, norm_model

from npuprep.model_io import load_model
from npuprep.plan import PinFp32, Plan, save_plan


def test_mismatch_exits_1_with_json_and_markdown(save, tmp_path):
    # x -> MatMul -> Relu -> Mul(r, r) -> ReduceMean -> Add(eps) -> Sqrt -> Div(r, .) -> Exp -> y
    model = save(norm_model())
    md = tmp_path / "out" / "crosscheck.md"
    done = run_cli("crosscheck", model, "--report", FIXTURES / "generic.csv", "--target", "orin",
                   "--json", "--report-md", md)
    assert done.returncode == 1, done.stderr
    data = json.loads(done.stdout)
    assert (data["kind"], data["schema_version"]) == ("crosscheck", 1)
    assert data["fingerprint"] == load_model(model).fingerprint
    verdicts = {v["node"]: v for v in data["verdicts"]}
    # The small-op rules flag x^2, the Sqrt of a sum of squares and exp; the CSV runs the
    # square in fp32 but the Sqrt in fp16 and the Exp in int8.
    assert verdicts["/norm/Mul"]["verdict"] == "ok"
    assert verdicts["/norm/Sqrt"]["verdict"] == "mismatch"
    assert verdicts["node_of_y"]["verdict"] == "mismatch" and verdicts["node_of_y"]["runs_in"] == "int8"
    assert verdicts["vendor_inserted_cast"]["verdict"] == "unmapped"
    assert data["counts"]["mismatch"] == 2
    assert "## mismatch (2)" in md.read_text()


def test_honoured_plan_passes_and_ignored_pin_fails(save, tmp_path):
    model_path = save(norm_model())
    model = load_model(model_path)
    plan = tmp_path / "plan.yaml"
    save_plan(Plan(fingerprint=model.fingerprint, target="orin", precision="fp16",
                   actions=(PinFp32(nodes=("/norm/Mul", "/norm/ReduceMean")),)), plan)
    fp32_all = tmp_path / "fp32.csv"
    fp32_all.write_text("node,precision\n" + "".join(
        f"{n},fp32\n" for n in ("/enc/MatMul", "/enc/Relu", "/norm/Mul", "/norm/ReduceMean",
                                "/norm/Add", "/norm/Sqrt", "/norm/Div", "node_of_y")))
    ok = run_cli("crosscheck", model_path, "-r", fp32_all, "-t", "orin", "--plan", plan)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASSED" in ok.stdout
    ignored = tmp_path / "ignored.csv"
    ignored.write_text(fp32_all.read_text().replace("/norm/ReduceMean,fp32", "/norm/ReduceMean,fp16"))
    bad = run_cli("crosscheck", model_path, "-r", ignored, "-t", "orin", "--plan", plan, "--json")
    assert bad.returncode == 1
    verdicts = {v["node"]: v["verdict"] for v in json.loads(bad.stdout)["verdicts"]}
    assert verdicts["/norm/ReduceMean"] == "pin-ignored" and verdicts["/norm/Mul"] == "ok"


def test_malformed_report_exits_2_with_one_line(save, tmp_path):
    model = save(norm_model())
    report = tmp_path / "layers.json"
    report.write_text('{"Layers": [{"Name": "/norm/Mul", "Inputs": [{"Format/Datatype": "Sparkly"}]}]}')
    md = tmp_path / "never.md"
    done = run_cli("crosscheck", model, "--report", report, "--target", "orin", "--report-md", md)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "layers.json: Layers[0].Inputs[0].Format/Datatype" in lines[0]
    assert not md.exists()
    names_only = run_cli("crosscheck", model, "--report", FIXTURES / "trt_names_only.json", "-t", "orin")
    assert names_only.returncode == 2 and "--profilingVerbosity=detailed" in names_only.stderr


def test_plan_of_the_model_before_conversion_applies_to_the_converted_one(save, tmp_path):
    original = load_model(save(norm_model(), "original.onnx"))
    # converted: the same graph with an FP16 round trip on y (Cast pair), so another fingerprint
    converted_proto = norm_model()
    converted_proto.graph.node[-1].output[0] = "y_pre"
    converted_proto.graph.node.extend([
        onnx.helper.make_node("Cast", ["y_pre"], ["y_h"], to=onnx.TensorProto.FLOAT16, name="cast_h"),
        onnx.helper.make_node("Cast", ["y_h"], ["y"], to=onnx.TensorProto.FLOAT, name="cast_f"),
    ])
    converted = save(converted_proto, "converted.onnx")
    plan = tmp_path / "plan.yaml"
    save_plan(Plan(fingerprint=original.fingerprint, target="orin", precision="fp16",
                   actions=(PinFp32(nodes=("/norm/Sqrt",)),)), plan)
    report = tmp_path / "p.csv"
    report.write_text("node,precision\n/norm/Sqrt,fp16\ncast_h,fp16\n")
    done = run_cli("crosscheck", converted, "-r", report, "-t", "orin", "--plan", plan, "--json")
    assert done.returncode == 1, done.stderr
    data = json.loads(done.stdout)
    assert {v["node"]: v["verdict"] for v in data["verdicts"]}["/norm/Sqrt"] == "pin-ignored"
    assert any("made for model " + original.fingerprint in n for n in data["notes"])
    foreign = tmp_path / "foreign.yaml"
    foreign.write_text(plan.read_text().replace("/norm/Sqrt", "/other/Sqrt"))
    refused = run_cli("crosscheck", converted, "-r", report, "-t", "orin", "--plan", foreign)
    assert refused.returncode == 2 and "/other/Sqrt are not in" in refused.stderr


def test_a_plan_of_another_model_is_refused(save, tmp_path):
    from npuprep.provenance import record_source

    original = load_model(save(norm_model(), "original.onnx"))
    report = tmp_path / "p.csv"
    report.write_text("node,precision\n/norm/Sqrt,fp16\n")
    # A plan without pins made for another model: nothing ties it to this one.
    unpinned = tmp_path / "unpinned.yaml"
    save_plan(Plan(fingerprint="0123456789abcdef", target="orin", precision="fp16", actions=()), unpinned)
    refused = run_cli("crosscheck", original.path, "-r", report, "-t", "orin", "--plan", unpinned)
    assert refused.returncode == 2 and "names none of its nodes" in refused.stderr, refused.stderr
    # A conversion of a third model: its record names the model it came from.
    converted = norm_model()
    converted.graph.node[-1].output[0] = "y_pre"
    converted.graph.node.append(onnx.helper.make_node("Identity", ["y_pre"], ["y"], name="id"))
    record_source(converted, "fedcba9876543210", {})
    plan = tmp_path / "plan.yaml"
    save_plan(Plan(fingerprint=original.fingerprint, target="orin", precision="fp16",
                   actions=(PinFp32(nodes=("/norm/Sqrt",)),)), plan)
    refused = run_cli("crosscheck", save(converted, "converted.onnx"), "-r", report, "-t", "orin", "--plan", plan)
    assert refused.returncode == 2 and "was converted from model fedcba9876543210" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
