"""Crosscheck verdicts: ok, mismatch, pin-ignored, unknown, unmapped, missing; flags; JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_crosscheck_readers import FIXTURES, norm_model

from npuprep.analyse.finding import Finding, Findings
from npuprep.crosscheck.check import crosscheck
from npuprep.crosscheck.names import NodeIndex
from npuprep.crosscheck.readers import read_report
from npuprep.crosscheck.render import to_markdown
from npuprep.model_io import load_model
from npuprep.profiles import Severity, load_profile


def finding(node: str, rule: str, severity: Severity = Severity.WARNING, **evidence) -> Finding:
    return Finding(rule=rule, severity=severity, node=node, op_type="", message=f"{rule} at {node}",
                   evidence=evidence)


@pytest.fixture
def model(save):
    # x -> MatMul -> Relu -> Mul(r, r) -> ReduceMean -> Add(eps) -> Sqrt -> Div(r, .) -> Exp -> y
    return load_model(save(norm_model()))


def run(model, report_path: Path, target: str = "orin", fmt: str = "auto", **kwargs):
    index = NodeIndex(model)
    return crosscheck(model, read_report(report_path, index, fmt), load_profile(target).resolve(), index=index,
                      **kwargs)


def by_node(result) -> dict:
    return {v.node: v for v in result.verdicts}


def test_every_verdict_kind_from_a_generic_list(model, tmp_path):
    report = tmp_path / "precision.csv"
    report.write_text("node,precision\n/enc/MatMul,fp16\n/enc/Relu,fp16\n/norm/Mul,fp32\n"
                      "/norm/ReduceMean,fp32\n/norm/Add,fp16\n/norm/Div,fp16\nnode_of_y,fp16\n"
                      "vendor_cast_3,fp16\n")
    result = run(model, report, findings=Findings((
        finding("/norm/Mul", "hazard.square"),   # needs FP32 range, runs fp32 -> ok
        finding("node_of_y", "hazard.exp"),      # runs fp16 -> mismatch
        finding("/enc/Relu", "range.overflow", Severity.INFO),  # info: not sensitive
    )), pinned_nodes={"/norm/Div", "/norm/ReduceMean"})
    v = by_node(result)
    assert v["/norm/Mul"].verdict == "ok" and v["/norm/Mul"].rules == ("hazard.square",)
    assert v["node_of_y"].verdict == "mismatch"
    assert (v["node_of_y"].runs_in, v["node_of_y"].needs) == ("fp16", "fp32-range")
    assert v["/enc/Relu"].verdict == "ok" and v["/enc/Relu"].needs == ""
    assert v["/norm/Div"].verdict == "pin-ignored" and v["/norm/Div"].runs_in == "fp16"
    assert v["/norm/ReduceMean"].verdict == "ok"  # pinned and FP32: the pin was honoured
    assert v["vendor_cast_3"].verdict == "unmapped"
    # /norm/Sqrt computes a float and the report never mentions it
    assert v["/norm/Sqrt"].verdict == "missing"
    assert result.counts == {"ok": 5, "non-finite": 0, "mismatch": 1, "pin-ignored": 1, "unknown": 0,
                             "unmapped": 1, "missing": 1}
    assert not result
    # failing verdicts come first
    assert [x.verdict for x in result.verdicts[:2]] == ["mismatch", "pin-ignored"]


def test_passes_when_every_sensitive_node_is_fp32(model, tmp_path):
    report = tmp_path / "p.json"
    report.write_text(json.dumps({"/enc/MatMul": "fp16", "/enc/Relu": "fp16", "/norm/Mul": "fp32",
                                  "/norm/ReduceMean": "fp32", "/norm/Add": "fp32",
                                  "/norm/Sqrt": "fp32", "/norm/Div": "fp32", "node_of_y": "fp32"}))
    result = run(model, report, findings=[finding("/norm/Mul", "hazard.square")],
                 pinned_nodes={"/norm/Sqrt"})
    assert result and set(result.counts.items()) >= {("ok", 8), ("mismatch", 0), ("missing", 0)}


def test_bf16_is_enough_for_range_rules_but_not_for_cancellation(model, tmp_path):
    report = tmp_path / "p.csv"
    report.write_text("node,precision\n/norm/Mul,bf16\n/norm/Add,bf16\n")
    v = by_node(run(model, report, findings=[finding("/norm/Mul", "range.headroom"),
                                             finding("/norm/Add", "pattern.guidance")]))
    assert v["/norm/Mul"].verdict == "ok"
    assert v["/norm/Add"].verdict == "mismatch" and v["/norm/Add"].needs == "fp32"


def test_integer_precision_is_a_mismatch_for_a_sensitive_node(model):
    v = by_node(run(model, FIXTURES / "horizon_makertbin.log", findings=[
        finding("/norm/Mul", "hazard.square"), finding("/norm/Sqrt", "hazard.sqrt")]))
    assert v["/norm/Mul"].verdict == "mismatch" and v["/norm/Mul"].runs_in == "int16"
    assert v["/norm/Mul"].evidence["metrics"] == {"/norm/Mul": {"cosine": 0.9988}}
    assert v["/norm/Sqrt"].verdict == "ok" and v["/norm/Sqrt"].runs_in == "fp32"  # on CPU, float
    assert v["/head/Dequantize"].verdict == "unmapped"


def test_pattern_finding_covers_its_members(model, tmp_path):
    report = tmp_path / "p.csv"
    report.write_text("node,precision\n/norm/Mul,fp32\n/norm/ReduceMean,fp16\n/norm/Div,fp32\n")
    v = by_node(run(model, report, findings=[finding(
        "/norm/Div", "pattern.layernorm", members=["/norm/Mul", "/norm/ReduceMean", "/norm/Div"])]))
    assert v["/norm/ReduceMean"].verdict == "mismatch"
    assert v["/norm/Mul"].verdict == "ok" and v["/norm/Div"].verdict == "ok"


def test_tensor_only_finding_lands_on_the_producer(model, tmp_path):
    report = tmp_path / "p.csv"
    report.write_text("node,precision\n/norm/ReduceMean,fp16\n")
    tensor_finding = Finding(rule="range.overflow", severity=Severity.ERROR, node="", op_type="",
                             message="absmax 1e5", tensor="m")
    assert by_node(run(model, report, findings=[tensor_finding]))["/norm/ReduceMean"].verdict == "mismatch"


def test_trt_detailed_uses_output_dtypes_and_flags_reformat_to_half(model):
    result = run(model, FIXTURES / "trt_detailed.json", findings=[
        finding("/norm/Mul", "hazard.square"), finding("node_of_y", "hazard.exp")])
    v = by_node(result)
    # Exp reads FP16 but writes its result to an FP32 output: the range is there
    assert v["node_of_y"].verdict == "ok" and v["node_of_y"].runs_in == "fp32"
    mul = v["/norm/Mul"]
    assert mul.verdict == "mismatch" and mul.runs_in == "fp16"
    assert mul.layers == ("{ForeignNode[/norm/Mul.../norm/Div]}",)
    assert any("Reformat layer" in f and "fp16" in f for f in mul.flags)
    assert not any(v[n].flags for n in ("/enc/MatMul", "/norm/Add"))  # not sensitive: no flag
    # kgen shape kernel without Metadata and an unnamed Shuffle cannot be placed
    unmapped = {u.node: u for u in result.of("unmapped")}
    assert set(unmapped) == {"(Unnamed Layer* 14) [Shuffle]", "__myl_MulMeanAddSqrtDiv_myl0_0"}
    assert "MulMeanAddSqrtDiv" in unmapped["__myl_MulMeanAddSqrtDiv_myl0_0"].reason
    assert result.counts["missing"] == 0


def test_dynamic_shapes_leave_sensitive_nodes_unknown(model):
    result = run(model, FIXTURES / "trt_dynamic_shapes.json",
                 findings=[finding("node_of_y", "hazard.exp")], pinned_nodes={"/norm/Div"})
    v = by_node(result)
    assert v["node_of_y"].verdict == "unknown" and v["/norm/Div"].verdict == "unknown"
    assert v["/enc/MatMul"].verdict == "ok"
    assert result  # nothing proven wrong


def test_rknn_assumes_the_target_precision(model):
    result = run(model, FIXTURES / "rknn_error_analysis.txt", target="generic",
                 findings=[finding("node_of_y", "hazard.exp")])
    exp = by_node(result)["node_of_y"]
    # Marked non-finite by the toolkit: its own verdict, which also names the mismatch.
    assert exp.verdict == "non-finite" and exp.runs_in == "fp16"
    assert "rt_inf, rt_nan" in exp.reason and "also needs fp32-range, runs in fp16" in exp.reason
    assert exp.evidence["runs_in_assumed"] is True
    assert exp.evidence["metrics"]["[Exp] y"]["markers"] == ["rt_inf", "rt_nan"]
    assert exp.flags == ("the report marks non-finite results: rt_inf, rt_nan",)
    assert any("no dtypes" in n for n in result.notes)


def test_json_and_markdown(model, tmp_path):
    report = tmp_path / "p.csv"
    report.write_text("node,precision\n/norm/Mul,fp16\n")
    result = run(model, report, findings=[finding("/norm/Mul", "hazard.square")])
    data = result.to_dict()
    assert (data["schema_version"], data["kind"], data["fingerprint"]) == (1, "crosscheck", model.fingerprint)
    assert data["passed"] is False and data["counts"]["mismatch"] == 1
    assert data["verdicts"][0]["node"] == "/norm/Mul" and data["verdicts"][0]["verdict"] == "mismatch"
    json.dumps(data, allow_nan=False)
    md = to_markdown(result)
    assert "FAILED" in md and "## mismatch (1)" in md and "| mismatch | /norm/Mul | Mul | fp16 |" in md


def test_reformat_to_half_next_to_an_fp32_sensitive_node_is_flagged(model, tmp_path):
    report = tmp_path / "li.json"
    report.write_text(json.dumps({"Layers": [
        {"Name": "Reformatting CopyNode for Output Tensor 0 to node_of_y", "LayerType": "Reformat",
         "Metadata": "", "Inputs": [{"Name": "y", "Format/Datatype": "Float"}],
         "Outputs": [{"Name": "y_h", "Format/Datatype": "Half"}]},
        {"Name": "node_of_y", "LayerType": "PointWiseV2", "Metadata": "[ONNX Layer: node_of_y]",
         "Inputs": [{"Name": "n", "Format/Datatype": "Float"}],
         "Outputs": [{"Name": "y", "Format/Datatype": "Float"}]},
    ]}))
    exp = by_node(run(model, report, findings=[finding("node_of_y", "hazard.exp")]))["node_of_y"]
    assert exp.verdict == "ok" and exp.runs_in == "fp32"
    assert exp.flags == ("Reformat layer 'Reformatting CopyNode for Output Tensor 0 to node_of_y' "
                         "converts to fp16 next to this node",)
