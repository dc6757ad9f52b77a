"""Commands given a conversion read its record, so their verdict is convert's.

graph: x -> MatMul(W, big) -> h -> LayerNorm written out (ReduceMean, Sub, Pow, ReduceMean,
       Add eps, Sqrt, Div) -> n -> MatMul(W2) -> l -> Exp -> e -> ReduceSum -> s -> Div(e, s) -> y
h^2 overflows FP16 (the plan rescales mm1, the LayerNorm absorbs it) and Exp(l) overflows
(the plan subtracts the max first): convert passes on a2000 with every node in FP16.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_cli
from conversion_util import as_stored_report, convert_recorded
from onnx import TensorProto, helper, numpy_helper

from npuprep.provenance import RECORD_KEY


def _source() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    node = helper.make_node
    nodes = [node("MatMul", ["x", "W"], ["h"], name="mm1"),
             node("ReduceMean", ["h"], ["mu"], name="ln_mean", axes=[-1]),
             node("Sub", ["h", "mu"], ["d"], name="ln_sub"),
             node("Pow", ["d", "two"], ["sq"], name="ln_pow"),
             node("ReduceMean", ["sq"], ["var"], name="ln_var", axes=[-1]),
             node("Add", ["var", "eps"], ["ve"], name="ln_add"),
             node("Sqrt", ["ve"], ["sd"], name="ln_sqrt"),
             node("Div", ["d", "sd"], ["n"], name="ln_div"),
             node("MatMul", ["n", "W2"], ["l"], name="mm2"),
             node("Exp", ["l"], ["e"], name="sm_exp"),
             node("ReduceSum", ["e", "axes"], ["s"], name="sm_sum", keepdims=1),
             node("Div", ["e", "s"], ["y"], name="sm_div")]
    weights = [numpy_helper.from_array((rng.standard_normal((8, 8)) * 40).astype(np.float32), "W"),
               numpy_helper.from_array((rng.standard_normal((8, 4)) * 6).astype(np.float32), "W2"),
               numpy_helper.from_array(np.array([2], np.float32), "two"),
               numpy_helper.from_array(np.array([1e-5], np.float32), "eps"),
               numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("record")
    source, data, out = folder / "m.onnx", folder / "data", folder / "m16.onnx"
    onnx.save(_source(), str(source))
    data.mkdir()
    rng = np.random.default_rng(1)
    for i in range(8):
        np.savez(data / f"s{i}.npz", x=(rng.standard_normal((1, 8)) * 3 + 2).astype(np.float32))
    report = convert_recorded(source, data, "a2000", out)
    assert report["passed"] and {a["action"] for a in report["plan"]["actions"]} == {"rescale", "softmax_shift"}
    stats = folder / "stats.json"
    assert run_cli("calibrate", source, "--data", data, "-o", stats).returncode == 0
    return {"source": source, "data": data, "out": out, "stats": stats,
            "csv": as_stored_report(out, folder / "layers.csv"), "folder": folder}


def _crosscheck(model: Path, csv: Path, *extra: object) -> tuple[int, dict]:
    done = run_cli("crosscheck", model, "--report", csv, "--target", "a2000", "--json", *extra)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def test_crosscheck_of_a_conversion_decides_by_its_recorded_plan(converted, tmp_path):
    # Every node in the precision the conversion wrote, source stats, no --plan: convert's verdict.
    rc, doc = _crosscheck(converted["out"], converted["csv"], "--stats", converted["stats"])
    assert rc == 0 and doc["passed"] and doc["counts"]["mismatch"] == 0
    assert any("conversion's record" in n for n in doc["notes"])
    # The same model without its record: generic rules on LayerNorm/softmax "need fp32".
    proto = onnx.load(str(converted["out"]))
    kept = {p.key: p.value for p in proto.metadata_props if p.key != RECORD_KEY}
    helper.set_model_props(proto, kept)
    bare = tmp_path / "bare.onnx"
    onnx.save(proto, str(bare))
    rc, doc = _crosscheck(bare, converted["csv"], "--stats", converted["stats"])
    assert rc == 1 and doc["counts"]["mismatch"] > 0


def test_crosscheck_of_the_source_counts_the_plans_rewrites_as_absent(converted):
    # The conversion's plan given with the source model: its rescale and shift are not in it.
    rc, doc = _crosscheck(converted["source"], converted["csv"], "--plan",
                          converted["out"].with_suffix(".plan.yaml"))
    assert rc == 1 and not doc["passed"]
    assert any("exist only in the converted model" in n and "1 rescale, 1 softmax_shift" in n
               for n in doc["notes"])
    failing = {v["node"]: v["reason"] for v in doc["verdicts"] if v["verdict"] == "mismatch"}
    assert {"ln_pow", "sm_exp"} <= set(failing)
    assert "only in the converted model" in failing["sm_exp"]


def test_compare_judges_a_conversion_by_its_recorded_gate(tmp_path):
    # source:    x (about 1000) -> Sub(c = 1000) -> t -> Add(x) -> y
    # converted: x -> Cast(fp16) -> Sub(c fp16) -> t -> Add -> Cast(fp32) -> y, with its record
    # FP16 stores x to 0.5 near 1000: t (in [0, 1]) is off by half its size, y by 1e-4 of it.
    from npuprep.model_io import load_model
    from npuprep.plan import Plan
    from npuprep.provenance import ConversionRecord, Gates, Source, record_conversion

    head = '<ir_version: 8, opset_import: ["" : 17]> g (float[64] x) => (float[64] y) '
    source, out = tmp_path / "m.onnx", tmp_path / "m16.onnx"
    onnx.save(onnx.parser.parse_model(head + "<float c = {1000.0}> { t = Sub (x, c) y = Add (t, x) }"),
              str(source))
    converted = onnx.parser.parse_model(
        head + "<float16 c = {25552}> { h = Cast <to = 10> (x) t = Sub (h, c) s = Add (t, h) "
        "y = Cast <to = 1> (s) }")  # 25552: the bits of FP16 1000.0
    fingerprint = load_model(source).fingerprint
    record_conversion(converted, ConversionRecord(
        Source(fingerprint), "a2000", "fp16", Gates(rtol=1e-2, atol=1e-3),
        Plan(fingerprint, "a2000", "fp16").to_dict(), passed=True))
    onnx.save(converted, str(out))
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(2)
    for i in range(4):
        np.savez(data / f"s{i}.npz", x=(1000 + rng.random(64)).astype(np.float32))
    done = run_cli("compare", source, out, "--data", data, "--target", "a2000", "--json")
    doc = json.loads(done.stdout)
    rows = {t["tensor"]: t for t in doc["tensors"]}
    assert done.returncode == 0 and doc["passed"] and doc["gate"]["outputs"] == ["y"]
    assert rows["y"]["passed"] and not rows["t"]["passed"]  # t is where to look, not a failure
    assert doc["first_divergent"]["tensor"] == "t"
    table = run_cli("compare", source, out, "--data", data, "--target", "a2000").stdout
    assert "look:rtol+atol" in table and "FAIL:" not in table
    # Samples the conversion calibrated on are named: its gate was met on others.
    from dataclasses import replace

    from npuprep.provenance import read_conversion, record_conversion

    proto = onnx.load(str(out))
    record_conversion(proto, replace(read_conversion(proto), calibration_ids=("s0.npz", "s1.npz"),
                                     holdout_ids=("s3.npz",),
                                     calibration_source={"kind": "dir", "source": str(data)}))
    onnx.save(proto, str(out))
    notes = json.loads(run_cli("compare", source, out, "--data", data, "--target", "a2000",
                               "--json").stdout)["notes"]
    assert any("2 of these samples (s0.npz, s1.npz)" in n and "(s3.npz)" in n for n in notes)
    # Two models without a record between them: every tensor decides, as before.
    proto = onnx.load(str(out))
    helper.set_model_props(proto, {p.key: p.value for p in proto.metadata_props if p.key != RECORD_KEY})
    onnx.save(proto, str(tmp_path / "bare.onnx"))
    done = run_cli("compare", source, tmp_path / "bare.onnx", "--data", data, "--target", "a2000", "--json")
    assert done.returncode == 1 and json.loads(done.stdout)["gate"] is None


def test_a_passed_records_headroom_is_its_decision_a_failed_ones_is_not():
    # A value short of headroom (inside FP16's range) that convert kept FP16 and verified.
    from npuprep.analyse.finding import Finding
    from npuprep.crosscheck.plan_view import PlanDecision
    from npuprep.profiles import Severity

    short = Finding("range.headroom", Severity.WARNING, "Pow_1", "Pow", "reaches 76% of fp16 max", "p")
    passed = PlanDecision("record", "record", "f", "fp16", verified=True)
    assert "verified in fp16" in passed.settles(short)
    assert PlanDecision("record", "record", "f", "fp16", verified=False).settles(short) == ""


def test_checklist_sends_the_compiler_and_crosscheck_to_the_conversion(converted, tmp_path, monkeypatch):
    # After `convert -t orin` into W, the compiler must get the converted model (only it
    # carries the rescale and the shift), with convert's trtexec line, and crosscheck it.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "W").mkdir()
    convert_recorded(converted["source"], converted["data"], "orin", Path("W/m.orin.onnx"))
    done = run_cli("checklist", converted["source"], "--target", "orin", "--workspace", "W", "--json",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    steps = {i["key"]: i["steps"] for i in json.loads(done.stdout)["items"]}
    trtexec, crosscheck = steps["crosscheck"]
    written = Path("W/m.orin.trtexec.txt").read_text().splitlines()[0]
    assert trtexec.startswith("trtexec --onnx=W/m.orin.onnx ")
    assert trtexec.replace("--onnx=W/m.orin.onnx", "--onnx=m.orin.onnx").startswith(written)
    assert "--exportLayerInfo=W/layers.json" in trtexec
    assert crosscheck.startswith("npuprep crosscheck W/m.orin.onnx ") and "--plan" not in crosscheck
    assert str(converted["source"]) not in trtexec + crosscheck


def test_each_findings_remedy_is_what_the_plan_did(converted, tmp_path):
    # The rules suggest pins for the LayerNorm and the softmax; the plan rescales and shifts.
    done = run_cli("check", converted["source"], "--target", "a2000", "--data", converted["data"], "--json")
    check = json.loads(done.stdout)
    report = json.loads(converted["out"].with_suffix(".report.json").read_text())
    for doc in (check, report):
        remedies = {(f["rule"], f["node"]): f["remedy"] for f in doc["findings"]}
        assert remedies[("range.overflow", "ln_pow")] == "rescale"
        assert remedies[("pattern.layernorm", "ln_pow")] == "rescale"
        assert remedies[("range.overflow", "sm_exp")] == "softmax_shift"
        assert remedies[("pattern.softmax", "sm_exp")] == "softmax_shift"
        assert "pin_fp32" not in remedies.values() and doc["plan"]["actions"]
        assert any(f["suggested_remedy"] == "pin_fp32" for f in doc["findings"])
    # The table says it too, and the page convert's report renders recommends no pin.
    table = run_cli("check", converted["source"], "--target", "a2000", "--data", converted["data"],
                    "--wide").stdout
    assert "softmax_shift" in table and "pin_fp32" not in table
    page = tmp_path / "report.html"
    assert run_cli("report", converted["out"].with_suffix(".report.json"), "-o", page).returncode == 0
    findings = page.read_text().split('id="table-findings"')[1].split("</table>")[0]
    assert "rescale" in findings and "pin_fp32" not in findings and "FP32" not in findings


def test_ledger_of_a_conversion_names_the_pins_its_record_holds(converted, tmp_path):
    # The recorded plan with one more pin (as a verification round adds): the ledger names it.
    from dataclasses import replace

    from npuprep.plan import PinFp32, Plan
    from npuprep.provenance import read_conversion, record_conversion

    proto = onnx.load(str(converted["out"]))
    record = read_conversion(proto)
    plan = Plan.from_dict(record.plan)
    pinned = replace(plan, actions=(*plan.actions, PinFp32(nodes=("sm_div",), why="verification")))
    record_conversion(proto, replace(record, plan=pinned.to_dict()))
    path = tmp_path / "pinned.onnx"
    onnx.save(proto, str(path))
    done = run_cli("ledger", converted["source"], path, "--target", "a2000", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["pinned_nodes"] == ["sm_div"]


def test_check_of_a_conversion_shows_the_plan_it_records(converted):
    from npuprep.provenance import read_conversion

    record = read_conversion(onnx.load(str(converted["out"])))
    done = run_cli("check", converted["out"], "--target", "a2000", "--stats", converted["stats"], "--json")
    assert json.loads(done.stdout)["plan"]["actions"] == record.plan["actions"]
    table = run_cli("check", converted["out"], "--target", "a2000", "--stats", converted["stats"]).stdout
    assert "convert planned 2 action(s)" in table and "the conversion's record" in table


def test_a_recorded_top_k_gate_passes_an_output_whose_decisions_agree():
    # Scores off by far more than rtol, the same top-1 class at each position: convert's gate.
    from npuprep.verify.compare import CompareResult, OutputGate

    ref = [{"p": np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]], np.float32)}]
    cand = [{"p": np.array([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3]], np.float32)}]

    def judged(top_k: dict[str, int]) -> CompareResult:
        gate = OutputGate(("p",), 1e-2, 1e-3, "a record", top_k=top_k)
        return CompareResult("r", "c", (), 1, "1 sample", 1e-2, 1e-3, {}, "fp16", False,
                             gate=gate, output_errors=gate.judge(ref, cand))

    assert judged({"p": 1}) and judged({"p": 1}).output_errors["p"]["rel_l2"] > 0.1
    assert not judged({}) and judged({}).failing_outputs == ["p"]


def test_checklist_of_a_conversion_takes_its_recorded_plan(converted):
    done = run_cli("checklist", converted["out"], "--target", "a2000", "--stats", converted["stats"],
                   "--json")
    items = {i["key"]: i for i in json.loads(done.stdout)["items"]}
    assert items["precision"]["done"]
    assert any("its conversion record" in e and "1 rescale, 1 softmax_shift" in e
               for e in items["precision"]["evidence"])
    crosscheck = items["crosscheck"]["steps"][-1]
    assert crosscheck.startswith(f"npuprep crosscheck {converted['out']} ") and "--plan" not in crosscheck
