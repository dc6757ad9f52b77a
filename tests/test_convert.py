"""`npuprep convert`: plan, rewrite, lower and verify; the zoo's hazards are fixed, not hidden."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from conftest import run_cli, save_zoo

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.data import load_samples
from npuprep.model_io import load_model
from npuprep.numerics import get_format
from npuprep.profiles import load_profile
from npuprep.rewrite.apply import apply_plan
from npuprep.runtime.session import make_session, run
from npuprep.verify.emulate import emulate
from npuprep.verify.emulate_lowered import emulate_lowered

F16 = get_format("fp16")


def _zoo_case(tmp_path: Path, name: str):
    """The zoo model saved with its samples as a directory of .npz, as a user would have them."""
    path, data = save_zoo(name, tmp_path, f"{name}.onnx", f"{name}_data")
    model = load_model(path)
    return model, load_samples(data, model.proto), path, data


def _outputs(model: onnx.ModelProto, samples) -> list[dict[str, np.ndarray]]:
    session = make_session(model)
    return [run(session, feed) for feed in samples]


def _worst(ref: list[dict], cand: list[dict]) -> tuple[int, float]:
    nonfinite, worst = 0, 0.0
    for r, c in zip(ref, cand, strict=True):
        for name, rv in r.items():
            cv = np.asarray(c[name], np.float64)
            nonfinite += int((~np.isfinite(cv)).sum())
            if np.isfinite(cv).all():
                worst = max(worst, float(np.linalg.norm(cv - rv) / np.linalg.norm(rv)))
    return nonfinite, worst


ZOO_CASES = ["bev_distance", "exp_logits", "guidance", "conv_stack", "residual_outliers",
             "decomposed_layernorm", "if_body_hazard", "bn_large_variance"]


@pytest.mark.parametrize("name", ZOO_CASES)
def test_zoo_model_overflows_naively_and_converts_clean(tmp_path, name):
    # zoo model -> naive FP16 (emulated) fails; npuprep convert -> lowered FP16, emulated: finite, close
    model, samples, _, _ = _zoo_case(tmp_path, name)
    ref = _outputs(model.proto, samples)
    naive = _outputs(emulate(model.proto, F16, saturate=False).model, samples)
    bad, err = _worst(ref, naive)
    assert bad > 0 or err > 1e-2, f"{name}: the planted hazard does not show in naive FP16"

    result = convert(model, load_profile("generic"), list(samples), stats=calibrate(model, samples))
    assert result, result.output_check.to_dict()
    onnx.checker.check_model(result.lowered.model, full_check=True)
    lowered_out = _outputs(emulate_lowered(result.lowered.model, F16, saturate=False).model, samples)
    bad, err = _worst(ref, lowered_out)
    assert bad == 0 and err <= 1e-2
    # The lowered model really stores FP16 somewhere (it was lowered, not left in FP32).
    types = {i.data_type for i in result.lowered.model.graph.initializer}
    assert onnx.TensorProto.FLOAT16 in types
    if result.plan.rescales():
        assert result.flops_fp32_share <= 0.05


@pytest.mark.parametrize("name", ["conv_stack", "residual_outliers", "decomposed_layernorm"])
def test_rescaled_fp32_graph_computes_the_same_function(tmp_path, name):
    # model -> plan with rescales only -> rewritten FP32 graph: outputs equal within 1e-5
    model, samples, _, _ = _zoo_case(tmp_path, name)
    from npuprep.analyse import static_findings
    from npuprep.analyse.measured import measured_findings
    from npuprep.plan.planner import make_plan

    profile = load_profile("generic")
    stats = calibrate(model, samples)
    findings = static_findings(model, profile.resolve()).merged(measured_findings(model, profile.resolve(), stats))
    plan = make_plan(model, profile.resolve(), stats, findings)
    assert plan.rescales() and not plan.pins()
    applied = apply_plan(model.proto, plan)
    assert applied.tensor_scales
    ref, new = _outputs(model.proto, samples), _outputs(applied.model, samples)
    for r, n in zip(ref, new, strict=True):
        for k in r:
            assert np.linalg.norm(n[k] - r[k]) <= 1e-5 * np.linalg.norm(r[k])


def test_bf16_weights_never_reach_an_a2000(tmp_path):
    # Cast(W_bf16) -> Gemm -> ... : the lowered model holds no BF16 anywhere
    model, samples, _, _ = _zoo_case(tmp_path, "bf16_weights")
    result = convert(model, load_profile("a2000"), list(samples), stats=calibrate(model, samples))
    assert result
    text = str(result.lowered.model)
    assert "BFLOAT16" not in text and "data_type: 16" not in text
    for node in result.lowered.model.graph.node:
        for attr in node.attribute:
            assert not (attr.name == "to" and attr.i == onnx.TensorProto.BFLOAT16)


def test_cli_convert_writes_artefacts_byte_identically(tmp_path):
    # zoo model -> `npuprep convert` twice -> same bytes; input untouched; reports and constraints
    _, _, path, data = _zoo_case(tmp_path, "guidance")
    before = path.read_bytes()
    outs = []
    for i in range(2):
        out = tmp_path / f"run{i}" / "g.onnx"
        proc = run_cli("convert", path, "--target", "orin", "--data", data, "-o", out, "--json")
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        assert report["kind"] == "convert" and report["passed"]
        outs.append(out)
    assert outs[0].read_bytes() == outs[1].read_bytes()
    # What the run cost (time, memory) is measured, not decided: the rest is byte for byte.
    reports = [json.loads(o.with_suffix(".report.json").read_text().replace("run1", "run0")) for o in outs]
    costs = [r.pop("resources") for r in reports]
    assert reports[0] == reports[1]
    assert all(c["peak_rss_mb"] > 10 and c["wall_s"] > 0 and c["stages_peak_rss_mb"] for c in costs)
    # Each stage's time, the stages the memory watch saw: they add up to the run's.
    for c in costs:
        assert set(c["stages_peak_rss_mb"]) <= set(c["stage_seconds"])
        # The total is rounded to 0.1 s, each stage to 0.01 s.
        rounding = 0.05 + 0.005 * len(c["stage_seconds"])
        assert sum(t["wall_s"] for t in c["stage_seconds"].values()) <= c["wall_s"] + rounding
    md = outs[0].with_suffix(".report.md").read_text()
    assert "peak resident memory" in md and "## Time by stage" in md
    assert path.read_bytes() == before
    for suffix in (".report.md", ".plan.yaml", ".trtexec.txt"):
        assert outs[0].with_suffix(suffix).is_file()
    # Orin's compiler is TensorRT: no other vendor's constraint file unless --export asks.
    for suffix in (".precision.yaml", ".horizon.yaml", ".rknn.yaml"):
        assert not outs[0].with_suffix(suffix).exists()
    md = outs[0].with_suffix(".report.md").read_text()
    assert "FLOPs left in FP32" in md and "Headroom of every fixed tensor" in md
    assert "rel L2" in md


def test_plan_only_then_edited_plan_with_user_clamp_and_forced_pin(tmp_path):
    # --plan-only writes plan.yaml (no model); user adds a clamp on the output and forces a pin
    _, _, path, data = _zoo_case(tmp_path, "decomposed_layernorm")
    plan_path = tmp_path / "plan.yaml"
    proc = run_cli("convert", path, "--target", "generic", "--data", data, "--plan-only", "-o", plan_path)
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.glob("*.generic.onnx"))
    plan = yaml.safe_load(plan_path.read_text())
    assert any(a["action"] == "rescale" for a in plan["actions"])
    plan["actions"].append({"action": "clamp", "tensor": "y", "lo": -0.5, "hi": 0.5, "kind": "user",
                            "why": "physical bound on the output"})
    plan["actions"].append({"action": "pin_fp32", "nodes": ["head"], "forced": True,
                            "why": "user request"})
    plan_path.write_text(yaml.safe_dump(plan, sort_keys=False))
    out = tmp_path / "edited.onnx"
    proc = run_cli("convert", path, "--target", "generic", "--data", data, "--plan", plan_path,
                   "-o", out, "--json", "--rtol", "10", "--max-fp32-share", "100%")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert "head" in report["pinned_nodes"]
    # The forced pin is the user's choice, and the share still counts it.
    (island,) = [i for i in report["fp32_share"]["islands"] if "head" in i["nodes"]]
    assert island["why"] == "user request" and report["fp32_share"]["flops"] > 0.1
    lowered = make_session(str(out))
    values = np.concatenate([run(lowered, {"x": np.random.default_rng(i).standard_normal((4, 16))
                                           .astype(np.float32)})["y"].ravel() for i in range(4)])
    assert values.max() <= 0.5 and values.min() >= -0.5
    assert (np.abs(values) == 0.5).any()


def test_failed_verification_names_first_divergent_node_and_exits_1(tmp_path):
    # an emptied plan (no remedies) and one round: overflow stays; exit 1 naming the node
    _, _, path, data = _zoo_case(tmp_path, "exp_logits")
    plan_path = tmp_path / "plan.yaml"
    assert run_cli("convert", path, "-t", "generic", "--data", data, "--plan-only",
                   "-o", plan_path).returncode == 0
    plan = yaml.safe_load(plan_path.read_text())
    plan["actions"] = []
    plan_path.write_text(yaml.safe_dump(plan, sort_keys=False))
    proc = run_cli("convert", path, "-t", "generic", "--data", data, "--plan", plan_path,
                   "--max-rounds", "1", "-o", tmp_path / "out.onnx")
    assert proc.returncode == 1
    assert "first divergent node 'exp'" in proc.stdout


def test_holdout_and_io_types_target(tmp_path):
    # --holdout verifies on other samples; --io-types target gives FP16 graph inputs
    _, _, path, data = _zoo_case(tmp_path, "conv_stack")
    holdout = tmp_path / "holdout.npz"
    np.savez(holdout, x=np.random.default_rng(9).uniform(0, 1, (1, 3, 16, 16)).astype(np.float32))
    out = tmp_path / "c.onnx"
    proc = run_cli("convert", path, "-t", "generic", "--data", data, "--holdout", holdout,
                   "--io-types", "target", "-o", out, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["holdout"]["passed"] and report["holdout"]["samples"] == 1
    lowered = onnx.load(str(out))
    assert lowered.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16


def test_bad_input_exits_2_and_writes_nothing(tmp_path, save):
    _, _, path, data = _zoo_case(tmp_path, "guidance")
    before = path.read_bytes()
    proc = run_cli("convert", path, "-t", "generic", "--data", data, "-o", path)
    assert proc.returncode == 2 and "refusing to overwrite the input model" in proc.stderr
    assert path.read_bytes() == before
    proc = run_cli("convert", tmp_path / "missing.onnx", "-t", "generic", "--synthetic", "2")
    assert proc.returncode == 2 and "missing.onnx" in proc.stderr
    other, _, other_path, _ = _zoo_case(tmp_path, "exp_logits")
    plan_path = tmp_path / "other.plan.yaml"
    assert run_cli("convert", other_path, "-t", "generic", "--synthetic", "2", "--plan-only",
                   "-o", plan_path).returncode == 0
    proc = run_cli("convert", path, "-t", "generic", "--data", data, "--plan", plan_path,
                   "-o", tmp_path / "x.onnx")
    assert proc.returncode == 2 and "fingerprint" in proc.stderr
    assert not (tmp_path / "x.onnx").exists()
    assert len(proc.stderr.strip().splitlines()) == 1


def test_readme_first_command_converts_the_bundled_example(tmp_path):
    # `npuprep convert --target a2000` with no model: the embedded planner and its samples
    proc = run_cli("convert", "--target", "a2000", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASSED" in proc.stdout
    assert (tmp_path / "planner.a2000.onnx").is_file()
    assert (tmp_path / "planner.a2000.report.md").is_file()
    assert "overflow behaviour is unknown" in proc.stdout


def test_html_flag_on_check_convert_and_compare(tmp_path):
    # check --html, convert --html, compare --html: one self-contained page each
    _, _, path, data = _zoo_case(tmp_path, "guidance")
    pages = {
        "check": ["check", path, "-t", "generic", "--data", data],
        "convert": ["convert", path, "-t", "generic", "--data", data, "-o", tmp_path / "g16.onnx"],
        "compare": ["compare", path, "--emulate", "-t", "generic", "--data", data],
    }
    for name, argv in pages.items():
        html = tmp_path / f"{name}.html"
        proc = run_cli(*argv, "--html", html)
        assert proc.returncode in (0, 1), proc.stderr
        text = html.read_text()
        assert text.startswith("<!DOCTYPE html>") and "65504" in text
        # Nothing loaded from the network (SVG namespace URIs are names, not fetches).
        assert not re.search(r'(src|href)="https?://', text)
    assert "eps_c" in (tmp_path / "compare.html").read_text()
