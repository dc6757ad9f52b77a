"""`crosscheck --plan` with plan.yaml or the conversion's .precision.yaml, alone or with --stats.

The plan decides: a pinned node (verification pins included, with their reason) must run in
FP32; a node its remedies made safe in FP16 (rescale, shifted softmax) is no mismatch; a
measured range the plan did not answer is one.
"""

from __future__ import annotations

import json
import shutil

import onnx
from conftest import run_cli
from test_conversion_stats import conversion  # noqa: F401 - the module's converted model
from test_crosscheck_readers import norm_model

from npuprep.model_io import load_model
from npuprep.plan import PinFp32, Plan, save_plan
from npuprep.provenance import RECORD_KEY

# What the orin conversion of test_conversion_stats.source_model keeps in FP32: the Exp->Log
# island (plan pin) and the softmax shift's subtraction (a rewrite's pin, in precision.yaml only).
PLAN_PINS = {"a_node", "q_node"}
REWRITE_PINS = {"softmax_shift_e_node", "softmax_shift_e_node_max"}


def _report(tmp_path, name, converted, fp32=(), overrides=None):
    """A generic node,precision CSV naming every node of `converted`."""
    overrides = overrides or {}
    rows = [f"{n.name},{overrides.get(n.name, 'fp32' if n.name in fp32 else 'fp16')}\n"
            for n in onnx.load(str(converted)).graph.node]
    path = tmp_path / name
    path.write_text("node,precision\n" + "".join(rows))
    return path


def _verdicts(done):
    return {v["node"]: v for v in json.loads(done.stdout)["verdicts"]}


def test_precision_yaml_pins_must_run_in_fp32(conversion, tmp_path):  # noqa: F811
    converted = conversion["converted"]
    precision = converted.with_suffix(".precision.yaml")
    all16 = _report(tmp_path, "all16.csv", converted)
    bad = run_cli("crosscheck", converted, "-r", all16, "-t", "orin", "--plan", precision, "--json")
    assert bad.returncode == 1, bad.stderr
    verdicts = _verdicts(bad)
    assert {n for n, v in verdicts.items() if v["verdict"] == "pin-ignored"} == PLAN_PINS | REWRITE_PINS
    assert "hazard.exp at a" in verdicts["a_node"]["reason"]
    assert "kept FP32 by rewriting" in verdicts["softmax_shift_e_node"]["reason"]
    # The softmax the plan shifted and the rescaled MatMul run in FP16: not a mismatch.
    for node in ("e_node", "s_node", "p_node", "h_node", "r_node"):
        assert verdicts[node]["verdict"] == "ok", verdicts[node]
    honoured = _report(tmp_path, "honoured.csv", converted, fp32=PLAN_PINS | REWRITE_PINS)
    ok = run_cli("crosscheck", converted, "-r", honoured, "-t", "orin", "--plan", precision)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASSED" in ok.stdout and "precision file" in ok.stdout
    # The softmax output underflows (measured): the plan kept it in fp16 and verification
    # passed, so that is its decision, not a mismatch; without a plan it is one.
    stats = conversion["folder"] / "m.stats.json"
    planned = run_cli("crosscheck", converted, "-r", honoured, "-t", "orin", "--plan", precision,
                      "--stats", stats, "--json")
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert "underflow left as is" in _verdicts(planned)["Cast_p"]["reason"]
    # Without --plan the conversion's own record decides, as --plan does.
    recorded = run_cli("crosscheck", converted, "-r", honoured, "-t", "orin", "--stats", stats, "--json")
    assert recorded.returncode == 0, recorded.stdout
    assert _verdicts(recorded)["Cast_p"]["verdict"] == "ok"
    # A conversion without its record (made before it existed): no plan decides.
    proto = onnx.load(str(converted))
    onnx.helper.set_model_props(proto, {p.key: p.value for p in proto.metadata_props
                                        if p.key != RECORD_KEY})
    bare = converted.with_name("bare.onnx")
    onnx.save(proto, str(bare))
    shutil.copy(converted.with_suffix(".precision.yaml"), bare.with_suffix(".precision.yaml"))
    unplanned = run_cli("crosscheck", bare, "-r", honoured, "-t", "orin", "--stats", stats, "--json")
    assert unplanned.returncode == 1
    assert _verdicts(unplanned)["Cast_p"]["verdict"] == "mismatch"
    assert any(f"--plan {bare.with_suffix('.precision.yaml')} lets its plan decide" in n
               for n in json.loads(unplanned.stdout)["notes"])


def test_plan_yaml_names_the_remedy_that_made_a_node_safe(conversion, tmp_path):  # noqa: F811
    converted = conversion["converted"]
    plan = converted.with_suffix(".plan.yaml")
    report = _report(tmp_path, "r.csv", converted, fp32=PLAN_PINS)
    done = run_cli("crosscheck", converted, "-r", report, "-t", "orin", "--plan", plan,
                   "--stats", conversion["folder"] / "m.stats.json", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    verdicts = _verdicts(done)
    assert "softmax shifted" in verdicts["e_node"]["reason"]
    # Source stats map onto the conversion: h is 2^-1 of the source's, within the headroom.
    assert verdicts["h_node"]["verdict"] == "ok" and not verdicts["h_node"]["rules"]
    notes = json.loads(done.stdout)["notes"]
    assert any("mapped onto its conversion" in n for n in notes)
    assert any(".precision.yaml: give that to --plan" in n for n in notes)
    # A node the plan made safe in fp16 but that the compiler runs in int8 is flagged.
    int8 = _report(tmp_path, "int8.csv", converted, fp32=PLAN_PINS, overrides={"e_node": "int8"})
    flagged = run_cli("crosscheck", converted, "-r", int8, "-t", "orin", "--plan", plan, "--json")
    assert flagged.returncode == 1
    assert _verdicts(flagged)["e_node"]["verdict"] == "mismatch"
    assert "softmax shifted" in _verdicts(flagged)["e_node"]["reason"]


def test_measured_range_the_plan_did_not_answer_is_a_mismatch(conversion, tmp_path):  # noqa: F811
    # The precision file with the Exp of the Exp->Log island left in fp16: the source's stats
    # (exp(x) up to ~1e13) say it needs FP32, and no remedy of the plan covers it.
    converted = conversion["converted"]
    text = converted.with_suffix(".precision.yaml").read_text()
    start = text.index('  - node: "a_node"')
    entry = text[start:text.index("  - node:", start + 1)]
    edited = tmp_path / "edited.precision.yaml"
    edited.write_text(text.replace(entry, entry.replace('precision: "fp32"', 'precision: "fp16"')
                                   .split("    reason:")[0] + '    reason: "as lowered"\n'))
    report = _report(tmp_path, "r.csv", converted, fp32=(PLAN_PINS | REWRITE_PINS) - {"a_node"})
    static = run_cli("crosscheck", converted, "-r", report, "-t", "orin", "--plan", edited, "--json")
    assert static.returncode == 0, static.stdout + static.stderr
    assert _verdicts(static)["a_node"]["verdict"] == "ok"  # static rules alone: the plan decides
    measured = run_cli("crosscheck", converted, "-r", report, "-t", "orin", "--plan", edited,
                       "--stats", conversion["folder"] / "m.stats.json", "--json")
    assert measured.returncode == 1
    a = _verdicts(measured)["a_node"]
    assert a["verdict"] == "mismatch" and "range.overflow" in a["rules"]
    assert "the plan did not make it safe" in a["reason"]


def test_verification_pin_keeps_its_reason(save, tmp_path):
    # x -> MatMul -> Relu -> Mul(r, r) -> ReduceMean -> Add(eps) -> Sqrt -> Div(r, .) -> Exp -> y
    model_path = save(norm_model())
    model = load_model(model_path)
    plan = tmp_path / "plan.yaml"
    why = "verification round 1: first divergent node /norm/Div (rel L2 0.3, max abs error 2)"
    save_plan(Plan(fingerprint=model.fingerprint, target="orin", precision="fp16",
                   actions=(PinFp32(nodes=("/norm/Div",), why=why),)), plan)
    report = tmp_path / "r.csv"
    report.write_text("node,precision\n/norm/Div,fp16\n/norm/Sqrt,fp16\n")
    done = run_cli("crosscheck", model_path, "-r", report, "-t", "orin", "--plan", plan, "--json")
    assert done.returncode == 1
    verdicts = _verdicts(done)
    assert verdicts["/norm/Div"]["verdict"] == "pin-ignored"
    assert "verification round 1" in verdicts["/norm/Div"]["reason"]
    # The Sqrt's small-op finding is the plan's to decide: it kept the Sqrt in fp16.
    assert verdicts["/norm/Sqrt"]["verdict"] == "ok"
    assert "the plan keeps it in fp16" in verdicts["/norm/Sqrt"]["reason"]


def test_bad_plan_or_precision_file_is_one_line(conversion, tmp_path):  # noqa: F811
    converted = conversion["converted"]
    report = _report(tmp_path, "r.csv", converted)
    text = converted.with_suffix(".precision.yaml").read_text()
    cases = {
        "kind.yaml": ("kind: precision", "kind: recipe", "kind.yaml: kind:"),
        "default.yaml": ('default: "fp16"', "default: 42", "default.yaml: default:"),
        "prec.yaml": ('precision: "fp32"', 'precision: "fp31"', "prec.yaml: nodes["),
        "foreign.yaml": ('node: "a_node"', 'node: "elsewhere"', "elsewhere are not in"),
    }
    for name, (old, new, expected) in cases.items():
        path = tmp_path / name
        path.write_text(text.replace(old, new, 1))
        done = run_cli("crosscheck", converted, "-r", report, "-t", "orin", "--plan", path)
        assert done.returncode == 2, (name, done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (name, lines)
    missing = run_cli("crosscheck", converted, "-r", report, "-t", "orin", "--plan", tmp_path / "none.yaml")
    assert missing.returncode == 2 and "none.yaml" in missing.stderr
