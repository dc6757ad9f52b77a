"""First-week checklist: open items with commands, ticking from workspace artefacts, CLI."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from conftest import run_cli
from test_crosscheck_readers import FIXTURES, norm_model

from npuprep.analyse import static_findings
from npuprep.cli.common import dump_json
from npuprep.crosscheck.check import crosscheck
from npuprep.crosscheck.checklist import (
    bf16_tensors,
    build_checklist,
    riskiest_tensors,
    scan_workspace,
    to_markdown,
)
from npuprep.crosscheck.names import NodeIndex
from npuprep.crosscheck.readers import read_report
from npuprep.model_io import load_model
from npuprep.plan import PinFp32, Plan, save_plan
from npuprep.profiles import load_profile


@pytest.fixture
def model_path(save):
    # x -> MatMul -> Relu -> Mul(r, r) -> ReduceMean -> Add(eps) -> Sqrt -> Div(r, .) -> Exp -> y
    return save(norm_model())


def items(checklist) -> dict:
    return {i.key: i for i in checklist.items}


def test_without_workspace_every_item_is_open_with_a_command(model_path):
    model = load_model(model_path)
    profile = load_profile("orin")
    checklist = build_checklist(model, profile, model_arg=str(model_path), target_arg="orin",
                                findings=static_findings(model, profile.resolve()))
    assert [i.key for i in checklist.items] == [
        "calibrate", "precision", "probe", "crosscheck", "compare", "speed", "memory"]
    assert not any(i.done for i in checklist.items) and not checklist
    it = items(checklist)
    assert any(s.startswith(f"npuprep probe {model_path} --target orin --export-kit W/probe_kit")
               for s in it["probe"].steps)
    assert any("--profilingVerbosity=detailed --exportLayerInfo=W/layers.json" in s
               for s in it["crosscheck"].steps)
    assert any(s.startswith(f"npuprep crosscheck {model_path} --report W/layers.json --target orin "
                            "--report-format trt_json") for s in it["crosscheck"].steps)
    assert "median of 200 steps after 50" in it["speed"].title
    assert "peak allocation" in it["memory"].title
    # Without stats: the planner's static decision, and what it does per flagged node.
    assert it["precision"].evidence == (
        "no BF16 tensor or Cast to BF16 in the model",
        "the planner's decision (static rules only: calibrate for measured ranges; what convert "
        "--plan-only writes): 2 actions (1 clamp, 1 pin_fp32), 1 nodes pinned to FP32 (`/norm/Sqrt`), "
        "1 remedies declined, the rest in fp16",
        "3 nodes flagged by small-op rules or measured ranges; what the plan does: 1 pinned, "
        "1 clamped, 1 unmeasured",
        "pinned (1 nodes, pinned to FP32): `/norm/Sqrt` (hazard.sqrt)",
        "clamped (1 nodes, clamped): `node_of_y` (n to [-inf, 10.4])",
        "unmeasured (1 nodes, unmeasured: calibrate to decide): `/norm/Mul`")
    md = to_markdown(checklist)
    assert md.count("- [ ] **") == 7 and "0 of 7 items done." in md


def test_report_format_follows_the_target(model_path):
    model = load_model(model_path)
    steps = items(build_checklist(model, load_profile("a2000"), model_arg="m.onnx",
                                  target_arg="a2000"))["crosscheck"].steps
    assert any("node,precision" in s for s in steps)
    assert any("--report W/precision.csv --target a2000 --report-format generic" in s for s in steps)


def test_bf16_in_the_model_keeps_the_precision_item_open(save, tmp_path):
    # x -> Cast(bf16) -> Cast(fp32) -> y
    path = save("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2] x) => (float[2] y) {
      b = Cast<to = 16>(x)
      y = Cast<to = 1>(b)
    }
    """)
    model = load_model(path)
    assert bf16_tensors(model) == ["b"]
    ws = tmp_path / "ws"
    ws.mkdir()
    save_plan(Plan(fingerprint=model.fingerprint, target="a2000", precision="fp16"), ws / "plan.yaml")
    item = items(build_checklist(model, load_profile("a2000"), model_arg="m.onnx", target_arg="a2000",
                                 workspace=scan_workspace(ws)))["precision"]
    assert not item.done
    assert "BF16 found in the model (1 tensors: `b`); BF16 is unsupported on this target" in item.evidence[0]
    assert any(s.startswith("npuprep convert m.onnx --target a2000") for s in item.steps)


def write_workspace(ws, model, *, probe_backend="board (outputs)", crosscheck_fingerprint=None):
    """Artefacts following the shared JSON contract, as the other commands write them."""
    ws.mkdir()
    save_plan(Plan(fingerprint=model.fingerprint, target="orin", precision="fp16",
                   actions=(PinFp32(nodes=("/norm/Mul",)),)), ws / "plan.yaml")
    index = NodeIndex(model)
    profile = load_profile("orin")
    result = crosscheck(model, read_report(FIXTURES / "trt_detailed.json", index), profile.resolve(),
                        findings=static_findings(model, profile.resolve()), index=index).to_dict()
    if crosscheck_fingerprint is not None:
        result["fingerprint"] = crosscheck_fingerprint
    (ws / "crosscheck.json").write_text(dump_json(result))
    (ws / "probe.json").write_text(json.dumps({
        "schema_version": 1, "kind": "probe", "fingerprint": "", "target": "orin", "format": "fp16",
        "backend": probe_backend, "probes": [],
        "overall": {"verdict": "saturate", "reason": "every probe that overflowed gave saturate",
                    "by_verdict": {"saturate": ["conv_accumulate", "exp"]}}}))
    (ws / "compare.json").write_text(json.dumps({
        "schema_version": 1, "kind": "compare", "fingerprint": model.fingerprint, "passed": False,
        "first_divergent": {"tensor": "s", "node": "/norm/Mul", "max_abs_error": 1.5e5,
                            "rel_l2": 0.9, "headroom": 0.0, "passed": False}}))
    (ws / "notes.json").write_text('{"kind": "something else"}')


def test_workspace_artefacts_tick_items_with_evidence(model_path, tmp_path):
    model = load_model(model_path)
    ws = tmp_path / "ws"
    write_workspace(ws, model)
    checklist = build_checklist(model, load_profile("orin"), model_arg="m.onnx", target_arg="orin",
                                workspace=scan_workspace(ws))
    it = items(checklist)
    assert it["precision"].done and not it["precision"].failed
    assert "1 actions (1 pin_fp32), 1 nodes pinned to FP32 (`/norm/Mul`), 0 remedies declined, the " \
        "rest in fp16" in it["precision"].evidence[1]
    probe = it["probe"]
    assert probe.done and "overall `saturate` (silent) on board (outputs)" in probe.evidence[0]
    assert "the profile says overflow `inf`; the board measured `saturate`" in probe.evidence[1]
    cross = it["crosscheck"]
    assert cross.done and cross.failed
    assert "FAILED (ok 6, mismatch 2, unmapped 2)" in cross.evidence[0]
    assert "mismatch: `/norm/Mul` runs in fp16, needs fp32-range" in cross.evidence
    compare = it["compare"]
    assert compare.done and compare.failed
    assert "first divergent node `/norm/Mul` (tensor `s`: max abs error 1.5e+05, rel l2 0.9, headroom 0" \
        in compare.evidence[0]
    assert not it["calibrate"].done and not it["speed"].done and not it["memory"].done
    md = to_markdown(checklist)
    assert "- [x] **4. Crosscheck" in md and "(FAILED)" in md and "  - fix: " in md
    assert "4 of 7 items done, 2 failed." in md


def test_host_probe_and_stale_crosscheck_do_not_tick(model_path, tmp_path):
    model = load_model(model_path)
    ws = tmp_path / "ws"
    write_workspace(ws, model, probe_backend="emulate", crosscheck_fingerprint="0123456789abcdef")
    it = items(build_checklist(model, load_profile("orin"), model_arg="m.onnx", target_arg="orin",
                               workspace=scan_workspace(ws)))
    assert not it["probe"].done
    assert "ran on the host, not on the board" in it["probe"].evidence[1]
    assert not it["crosscheck"].done and it["crosscheck"].evidence == ()


def test_riskiest_tensors_rank_non_finite_then_largest():
    # Stand-in for CalibrationStats (.tensors of RangeStats with node and absmax).
    stats = SimpleNamespace(tensors={
        "a": SimpleNamespace(node="n_a", absmax=10.0),
        "b": SimpleNamespace(node="n_b", absmax=70000.0),
        "c": SimpleNamespace(node="n_c", absmax=math.inf),
        "d": SimpleNamespace(node="n_d", absmax=40000.0),
    }, unobserved={})
    top = riskiest_tensors(stats, load_profile("generic").resolve(), 3)
    assert [t for t, *_ in top] == ["c", "b", "d"]
    assert top[1][3] == pytest.approx(70000.0 / 65504.0)


def test_cli_writes_the_same_checklist_twice_and_exits_2_on_a_missing_workspace(model_path, tmp_path):
    out = tmp_path / "out" / "checklist.md"
    first = run_cli("checklist", model_path, "--target", "orin", "-o", out)
    assert first.returncode == 0, first.stderr
    text = out.read_bytes()
    assert run_cli("checklist", model_path, "--target", "orin", "-o", out).returncode == 0
    assert out.read_bytes() == text and b"# First-week bring-up checklist" in text
    shown = run_cli("checklist", model_path, "--target", "orin", "--json")
    data = json.loads(shown.stdout)
    assert (data["kind"], data["schema_version"], data["done"], data["total"]) == ("checklist", 1, 0, 7)
    missing = run_cli("checklist", model_path, "--target", "orin", "--workspace", tmp_path / "nope",
                      "-o", tmp_path / "never.md")
    assert missing.returncode == 2 and "workspace folder not found" in missing.stderr
    assert not (tmp_path / "never.md").exists()


def test_cli_ticks_from_a_crosscheck_it_wrote(model_path, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    done = run_cli("crosscheck", model_path, "--report", FIXTURES / "generic.csv", "--target", "orin",
                   "--json")
    (ws / "crosscheck.json").write_text(done.stdout)
    shown = run_cli("checklist", model_path, "--target", "orin", "--workspace", ws)
    assert shown.returncode == 0, shown.stderr
    assert "- [x] **4. Crosscheck" in shown.stdout and "mismatch: `node_of_y` runs in int8" in shown.stdout




def test_plan_written_by_convert_is_found(model_path, tmp_path):
    model = load_model(model_path)
    ws = tmp_path / "ws"
    ws.mkdir()
    save_plan(Plan(fingerprint=model.fingerprint, target="orin", precision="fp16",
                   actions=(PinFp32(nodes=("/norm/Sqrt",)),)), ws / "model.orin.plan.yaml")
    checklist = build_checklist(model, load_profile("orin"), model_arg="m.onnx", target_arg="orin",
                                workspace=scan_workspace(ws))
    item = items(checklist)["precision"]
    assert item.done and f"plan `{ws}/model.orin.plan.yaml`: 1 actions (1 pin_fp32), 1 nodes pinned" in item.evidence[1]
    assert any(f"--plan {ws}/model.orin.plan.yaml" in s for s in items(checklist)["crosscheck"].steps)


def test_probe_item_says_when_the_profile_does_not_know_the_overflow(model_path):
    model = load_model(model_path)
    a2000 = items(build_checklist(model, load_profile("a2000"), model_arg="m", target_arg="a2000"))
    assert a2000["probe"].evidence == ("the profile does not know how `a2000` overflows: only the "
                                       "board can tell",)
    orin = items(build_checklist(model, load_profile("orin"), model_arg="m", target_arg="orin"))
    assert orin["probe"].evidence == ("the profile says overflow `inf`; confirm it on the board",)


def story_model(tmp_path):
    """A graph with one of each fate, saved with three samples; returns (model, data dir)."""
    import numpy as np
    import onnx
    from conftest import model_from_text
    from onnx import numpy_helper

    # x -> MatMul(x5000) -> Relu -> MatMul(x0.001) -> y   (rescaled: h reaches 1e5)
    # x -> Exp -> Log -> z                                 (pinned: e reaches 4.9e8)
    # x -> Add(mask with -inf) -> Softmax -> p             (one mask warning; Softmax safe)
    model = model_from_text("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,4] x) => (float[1,4] y, float[1,4] z, float[1,4] p)
      <float[4,4] W = {5000,0,0,0, 0,5000,0,0, 0,0,5000,0, 0,0,0,5000},
       float[4,4] V = {0.001,0,0,0, 0,0.001,0,0, 0,0,0.001,0, 0,0,0,0.001},
       float[1,4] M = {0, 0, -1, -1}> {
      [big] h = MatMul(x, W)
      [relu] r = Relu(h)
      [small] y = MatMul(r, V)
      [exp] e = Exp(x)
      [log] z = Log(e)
      [mask] a = Add(x, M)
      [soft] p = Softmax(a)
    }
    """)
    mask = numpy_helper.from_array(np.array([[0, 0, -np.inf, -np.inf]], np.float32), "M")
    model.graph.initializer[2].CopyFrom(mask)
    onnx.save(model, str(tmp_path / "m.onnx"))
    (tmp_path / "d").mkdir()
    for i in range(3):
        np.savez(tmp_path / "d" / f"{i}.npz", x=np.array([[20.0 - i, 15.0, 3.0, 1.0]], np.float32))
    return tmp_path / "m.onnx", tmp_path / "d"


def test_checklist_tells_the_plan_convert_makes_per_flagged_node(tmp_path):
    model, data = story_model(tmp_path)
    stats = tmp_path / "s.json"
    assert run_cli("calibrate", model, "--data", data, "-o", stats).returncode == 0
    planned = run_cli("convert", model, "--target", "a2000", "--stats", stats, "--plan-only",
                      "-o", tmp_path / "plan.yaml", "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    shown = run_cli("checklist", model, "--target", "a2000", "--stats", stats, "--json")
    assert shown.returncode == 0, shown.stderr
    story = json.loads(shown.stdout)["story"]
    kinds = [a["action"] for a in plan["actions"]]
    # The counts are convert's: the same actions by kind, the same pinned nodes.
    assert story["action_count"] == len(kinds) == 2
    assert story["actions"] == {k: kinds.count(k) for k in kinds}
    pinned = sorted(n for a in plan["actions"] if a["action"] == "pin_fp32" for n in a["nodes"])
    assert sorted(story["pinned_nodes"]) == pinned == ["exp", "log"]
    fates = {s["node"]: s["fate"] for s in story["nodes"]}
    assert fates == {"big": "rescaled", "relu": "rescaled", "exp": "pinned", "log": "pinned",
                     "soft": "safe"}
    assert {s["node"] for s in story["nodes"] if s["needs_fp32"]} == {"exp", "log"}
    details = {s["node"]: s["detail"] for s in story["nodes"]}
    # h = 20 x 5000 = 1e5; the rescale by 2^-2 leaves 25000, under the limit 32752.
    assert "absmax 100000 -> 25000 (limit 32752)" in details["big"]
    assert details["soft"].endswith("<= limit 32752")
    # The -inf mask is one warning, never a risk ranked by its infinite abs-max.
    assert story["masks"] == ["a"]
    assert run_cli("checklist", model, "--target", "a2000", "--stats", stats, "-o",
                   tmp_path / "c.md").returncode == 0
    md = (tmp_path / "c.md").read_text()
    assert md.count("intentional -inf mask") == 1
    assert "non-finite" not in md and "infx" not in md and "inf x" not in md
    assert "2 actions (1 pin_fp32, 1 rescale), 2 nodes pinned to FP32 (`exp`, `log`)" in md
    assert "what convert --plan-only writes" in md and "- [ ] **2. Confirm" in md
    # Given the plan file, the checklist reads it (and ticks the item) with the same story.
    given = run_cli("checklist", model, "--target", "a2000", "--stats", stats, "--plan",
                    tmp_path / "plan.yaml", "--json")
    doc = json.loads(given.stdout)
    assert doc["story"] == story
    precision = next(i for i in doc["items"] if i["key"] == "precision")
    assert precision["done"] and f"plan `{tmp_path / 'plan.yaml'}`" in precision["evidence"][1]


def test_story_reads_the_planners_notes():
    # x -> Exp -> y: the plan left the finding as a note; the story says why, with its numbers.
    from npuprep.analyse.finding import Finding
    from npuprep.plan.story import plan_story
    from npuprep.profiles import Severity

    model = load_model_text("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4] x) => (float[4] y) { [ex] y = Exp(x) }
    """)
    found = Finding(rule="range.headroom", severity=Severity.WARNING, node="ex", op_type="Exp",
                    tensor="y", message="past headroom")
    profile = load_profile("a2000")
    note = ("range.headroom at y: absmax 49893.3 is past the headroom limit 32752 but within "
            "fp16 max; left as is (no remedy)")
    plan = Plan(fingerprint=model.fingerprint, target="a2000", precision="fp16", notes=(note,))
    (story,) = plan_story(model, profile, plan, [found]).nodes
    assert (story.node, story.fate, story.needs_fp32) == ("ex", "headroom", False)
    assert story.detail == "absmax 49893 > limit 32752, within max"
    pinned = Plan(fingerprint=model.fingerprint, target="a2000", precision="fp16",
                  actions=(PinFp32(nodes=("ex",)),))
    (story,) = plan_story(model, profile, pinned, []).nodes
    assert (story.fate, story.rules, story.detail) == ("pinned", (), "verify")


def load_model_text(text: str):
    import onnx
    from conftest import model_from_text

    from npuprep.model_io import Model, fingerprint

    proto: onnx.ModelProto = model_from_text(text)
    return Model(proto=proto, path="m.onnx", digest=fingerprint(proto))


def test_story_says_host_scaled_where_convert_scales_an_output_on_the_host(save, tmp_path):
    # x -> MatMul(x5000) -> Relu -> y (graph output, 1e5): on rk3588 (no FP32 pins) the rescale's
    # compensation moves to the host; the story and convert's report name the same output.
    import numpy as np

    path = save("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,4] x) => (float[1,4] y)
      <float[4,4] W = {5000,0,0,0, 0,5000,0,0, 0,0,5000,0, 0,0,0,5000}> {
      [big] h = MatMul(x, W)
      [relu] y = Relu(h)
    }
    """)
    (tmp_path / "d").mkdir()
    for i in range(2):
        np.savez(tmp_path / "d" / f"{i}.npz", x=np.array([[20.0 - i, 15.0, 3.0, 1.0]], np.float32))
    stats = tmp_path / "s.json"
    assert run_cli("calibrate", path, "--data", tmp_path / "d", "-o", stats).returncode == 0
    done = run_cli("convert", path, "--target", "rk3588", "--stats", stats, "--data", tmp_path / "d",
                   "-o", tmp_path / "out.onnx")
    assert done.returncode == 0, done.stderr
    host = json.loads((tmp_path / "out.report.json").read_text())["host_scales"]
    story = json.loads(run_cli("checklist", path, "--target", "rk3588", "--stats", stats,
                               "--json").stdout)["story"]
    assert host == {"y": 4.0}
    assert {s["node"]: s["fate"] for s in story["nodes"]} == {"big": "host-scaled", "relu": "host-scaled"}
    assert all(s["detail"].endswith("; y leaves scaled") for s in story["nodes"])


def test_story_says_shifted_for_a_written_out_softmax(save, tmp_path):
    # x -> Exp -> ReduceSum -> Div(e, s) -> p, x up to 20 (e = 4.9e8): the plan subtracts the max.
    import numpy as np

    path = save("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,4] x) => (float[1,4] p) {
      [exp] e = Exp(x)
      [sum] s = ReduceSum<keepdims = 1>(e)
      [div] p = Div(e, s)
    }
    """)
    (tmp_path / "d").mkdir()
    np.savez(tmp_path / "d" / "0.npz", x=np.array([[20.0, 15.0, 3.0, 1.0]], np.float32))
    stats = tmp_path / "s.json"
    assert run_cli("calibrate", path, "--data", tmp_path / "d", "-o", stats).returncode == 0
    plan = json.loads(run_cli("convert", path, "--target", "a2000", "--stats", stats, "--plan-only",
                              "-o", tmp_path / "p.yaml", "--json").stdout)
    story = json.loads(run_cli("checklist", path, "--target", "a2000", "--stats", stats,
                               "--json").stdout)["story"]
    assert [a["action"] for a in plan["actions"]] == ["softmax_shift"] and story["actions"] == {"softmax_shift": 1}
    assert {s["node"]: s["fate"] for s in story["nodes"]} == {"exp": "shifted", "sum": "shifted",
                                                              "div": "shifted"}
    exp = next(s for s in story["nodes"] if s["node"] == "exp")
    assert exp["detail"] == "max subtracted before exp (input absmax 20): its output <= 1"
