"""`npuprep check`: readable table, --json contract, exit codes 0/1/2 and --fail-on."""

import argparse
import json

from conftest import run_cli

from npuprep.cli import check
from npuprep.model_io import load_model
from npuprep.profiles import load_profile

HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'
# x -> Exp -> y: one warning (hazard.exp)
EXP = HEAD + "g (float[4] x) => (float[4] y) { y = Exp (x) }"
# x -> Relu -> y: nothing to report
CLEAN = HEAD + "g (float[4] x) => (float[4] y) { y = Relu (x) }"
# x -> Cast(BF16) -> Cast(FP32) -> y: an error on a2000
BF16 = HEAD + "g (float[4] x) => (float[4] y) { b = Cast <to = 16> (x) y = Cast <to = 1> (b) }"


def test_table_names_node_rule_evidence_and_verdict(save):
    r = run_cli("check", save(EXP), "--target", "generic")
    assert r.returncode == 0, r.stderr
    # Lines wrap at 100 columns where the temporary path is long: compare the words.
    words = " ".join(r.stdout.split())
    for text in ("hazard.exp", "node_of_y", "Exp", "input_limit=11.09", "clamp", "opset 17",
                 "1 finding(s): 0 error, 1 warning, 0 info", "PASSED"):
        assert text in words, text


def test_json_carries_the_shared_contract(save):
    path = save(EXP)
    r = run_cli("check", path, "--target", "orin", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["schema_version"] == 1 and data["kind"] == "check"
    assert data["fingerprint"] == load_model(path).fingerprint
    assert data["target"] == "orin" and data["opset"] == 17 and data["model"] == str(path)
    assert data["summary"] == {"error": 0, "warning": 1, "info": 0, "total": 1}
    [f] = data["findings"]
    assert f["rule"] == "hazard.exp" and f["severity"] == "warning" and f["node"] == "node_of_y"
    assert f["evidence"]["input_limit"] > 11 and f["remedy"] == "clamp"


def test_exit_codes_follow_fail_on(save):
    exp, clean, bf16 = save(EXP, "exp.onnx"), save(CLEAN, "clean.onnx"), save(BF16, "bf16.onnx")
    assert run_cli("check", bf16, "--target", "a2000").returncode == 1
    assert run_cli("check", exp, "--target", "generic", "--fail-on", "warning").returncode == 1
    r = run_cli("check", clean, "--target", "generic", "--fail-on", "info")
    assert r.returncode == 0 and "0 finding(s)" in r.stdout


def test_bad_input_exits_2_with_one_line(save):
    r = run_cli("check", save(CLEAN), "--target", "no_such_target")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "no_such_target" in r.stderr


def test_plan_check_is_the_one_place_findings_come_from(save):
    path = save(EXP)
    args = argparse.Namespace(model=str(path), target="generic", json=True, fail_on="error")
    planned = check.plan_check(args, load_model(path), load_profile("generic").resolve(), None)
    assert [f.rule for f in planned.findings] == ["hazard.exp"] and planned.findings
    # Each finding carries what the plan did for it.
    assert [f.planned for f in planned.findings] == [planned.plan.actions[0].action]


def test_findings_that_read_the_same_share_one_table_row(save):
    # x -> Exp -> Exp -> Exp -> Exp -> Exp -> y: five identical hazards, one row
    chain = " ".join(f"e{i} = Exp ({'x' if i == 0 else f'e{i - 1}'})" for i in range(4))
    path = save(HEAD + f"g (float[4] x) => (float[4] y) {{ {chain} y = Exp (e3) }}")
    findings = check.plan_check(argparse.Namespace(), load_model(path),
                                load_profile("generic").resolve(), None).findings
    assert len(findings) == 5
    [row] = check._rows(findings)
    # The sentence rides last, counted; the table shows it with --wide, -v prints it whole below.
    assert row[1] == "hazard.exp" and "(+2)" in row[2] and row[6].startswith("5x: ")


def test_without_a_model_the_bundled_example_is_checked():
    r = run_cli("check", "--target", "a2000", "--json")
    assert r.returncode == 0 and "bundled example" in r.stderr
    data = json.loads(r.stdout)
    assert data["model"].endswith("planner.onnx")
    assert {"pattern.softmax", "pattern.layernorm", "pattern.guidance"} <= {f["rule"] for f in data["findings"]}


def test_check_reports_the_plan_convert_would_make(tmp_path):
    # conv_stack (zoo): x -> Conv -> Relu -> Conv (~1e5) -> ... : check --data names the same
    # rescales that convert --plan-only writes, one story for both commands.
    import numpy as np
    import onnx

    from npuprep.examples.zoo import ZOO

    zoo = ZOO["conv_stack"]()
    onnx.save(zoo.model, str(tmp_path / "m.onnx"))
    (tmp_path / "d").mkdir()
    for i, s in enumerate(zoo.samples):
        np.savez(tmp_path / "d" / f"{i}.npz", **s)
    checked = run_cli("check", tmp_path / "m.onnx", "--target", "a2000", "--data", tmp_path / "d", "--json")
    planned = run_cli("convert", tmp_path / "m.onnx", "--target", "a2000", "--data", tmp_path / "d",
                      "--plan-only", "-o", tmp_path / "p.yaml", "--json")
    assert planned.returncode == 0, planned.stderr
    from_check = json.loads(checked.stdout)["plan"]["actions"]
    from_convert = json.loads(planned.stdout)["actions"]
    assert from_check == from_convert and [a["action"] for a in from_check] == ["rescale", "rescale"]
    table = run_cli("check", tmp_path / "m.onnx", "--target", "a2000", "--data", tmp_path / "d").stdout
    assert "What convert would do (measured ranges" in table and "0 node(s) pinned" in table


def _remedy_marks(page: str) -> list[str]:
    """The headroom chart's remedy triangles: one <g id="headroom-remedy-N"> each, its title."""
    import re

    groups = re.findall(r'<g id="headroom-remedy-\d+"><title>([^<]*)</title>(.*?)</g>\s*</g>', page,
                        re.S)
    assert all(body.count("<use ") == 1 for _, body in groups)
    return [title for title, _ in groups]


def test_html_marks_exactly_the_plans_actions(tmp_path):
    # x -> MatMul(x5000) -> Relu -> MatMul -> y; x -> Exp -> Log -> z; x -> Add(-inf mask) -> Softmax
    # The plan: one rescale, one FP32 island; the chart draws those two and nothing for the
    # findings the plan answered otherwise (Softmax measured safe, the mask).
    import pytest

    pytest.importorskip("matplotlib")
    from test_checklist import story_model

    model, data = story_model(tmp_path)
    page = tmp_path / "c.html"
    checked = run_cli("check", model, "--target", "a2000", "--data", data, "--html", page, "--json")
    actions = json.loads(checked.stdout)["plan"]["actions"]
    assert [a["action"] for a in actions] == ["rescale", "pin_fp32"]
    assert _remedy_marks(page.read_text()) == ["rescale: big (3 tensors)", "pin_fp32: exp, log (2 tensors)"]


def test_html_draws_no_remedy_where_the_plan_has_none(save, tmp_path):
    # x -> Exp -> y, measured small: the finding suggests a remedy, the plan proves it safe.
    import numpy as np
    import pytest

    pytest.importorskip("matplotlib")
    (tmp_path / "d").mkdir()
    np.savez(tmp_path / "d" / "0.npz", x=np.array([0.5, 1.0, -1.0, 2.0], np.float32))
    page = tmp_path / "c.html"
    checked = run_cli("check", save(EXP), "--target", "a2000", "--data", tmp_path / "d", "--html", page,
                      "--json")
    doc = json.loads(checked.stdout)
    # The rule suggested a remedy; the plan took none, and the finding says so.
    assert any(f["suggested_remedy"] in ("clamp", "pin_fp32") for f in doc["findings"])
    assert {f["remedy"] for f in doc["findings"]} == {"none"}
    assert doc["plan"]["actions"] == [] and _remedy_marks(page.read_text()) == []
    assert "headroom-chart" in page.read_text()
