"""`npuprep compare` through the real CLI: exit codes, JSON, Markdown report, bad input."""

from __future__ import annotations

import json

import numpy as np
import onnx
from conftest import run_cli

from npuprep.examples import example_data_dir, example_model_path

CHAIN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[3] x) => (float[3] y) <float wa = {{{w}}}, float one = {{1.0}}> {{
  [scale_a] a = Mul(x, wa)
  [shift_y] y = Add(a, one)
}}"""


def test_emulated_planner_names_the_overflow_and_exits_1(tmp_path):
    report = tmp_path / "cmp.md"
    proc = run_cli("compare", example_model_path(), "--emulate", "--target", "generic",
                   "--data", example_data_dir(), "--json", "--report-md", report, "--worst", "3")
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert data["kind"] == "compare" and data["passed"] is False
    assert data["first_divergent"]["node"] == "offset_sq" and data["first_divergent"]["inf_count"] > 0
    assert len(data["worst"]) == 3
    assert any("accumulation" in n for n in data["notes"])
    text = report.read_text()
    assert "## First divergent node" in text and "`offset_sq` (Pow)" in text
    assert "cannot show low-precision accumulation" in text
    header = next(line for line in text.splitlines() if line.startswith("| tensor"))
    assert header.count(" | ") == 10 and "\\|cand\\| max" in header  # escaped, 11 columns


def test_unknown_overflow_target_table_says_to_probe(tmp_path):
    proc = run_cli("compare", example_model_path(), "--emulate", "-t", "a2000", "--synthetic", "2",
                   "--isolate")
    assert proc.returncode in (0, 1), proc.stderr
    assert "Inf was assumed" in proc.stdout and "probe" in proc.stdout
    assert "own rel L2" in proc.stdout


def test_two_models_with_scales_and_tolerances(tmp_path, save):
    ref = save(CHAIN.format(w=2.0), "ref.onnx")
    cand = save(CHAIN.format(w=2.02), "cand.onnx")
    np.savez(tmp_path / "x.npz", x=np.array([1.0, 2.0, 3.0], np.float32))
    data = tmp_path / "x.npz"
    failing = run_cli("compare", ref, cand, "--data", data, "--rtol", "1e-3")
    assert failing.returncode == 1 and "first divergent node: scale_a (Mul)" in failing.stdout
    assert "FAILED" in failing.stdout
    loosened = run_cli("compare", ref, cand, "--data", data, "--rtol", "1e-3",
                       "--tol", "a:0.02", "--tol", "y:0.02:0.1", "--json")
    assert loosened.returncode == 0, loosened.stdout
    assert json.loads(loosened.stdout)["thresholds"]["overrides"] == {"a": [0.02, 0.001], "y": [0.02, 0.1]}
    # A candidate whose 'a' is 4x larger passes once the convert report's scale maps it back.
    scaled = save(CHAIN.format(w=8.0), "scaled.onnx")
    report = tmp_path / "convert.json"
    report.write_text(json.dumps({"schema_version": 1, "kind": "convert", "tensor_scales": {"a": 4}}))
    mapped = run_cli("compare", ref, scaled, "--data", data, "--scales", report, "--json")
    first = json.loads(mapped.stdout)["tensors"][0]
    assert first["tensor"] == "a" and first["scale"] == 4.0 and first["max_abs_error"] == 0.0


def test_bad_input_exits_2_and_writes_nothing(tmp_path, save):
    ref = save(CHAIN.format(w=2.0), "ref.onnx")
    out = tmp_path / "never.md"
    cases = [
        ("compare", ref, "--emulate", "--synthetic", "1", "--report", out),  # no target
        ("compare", ref, ref, "--emulate", "-t", "generic", "--synthetic", "1"),
        ("compare", ref, ref, "--synthetic", "1", "--tol", "a:lots", "--report", out),
        ("compare", ref, ref, "--synthetic", "1", "--scales", tmp_path / "missing.json"),
        ("compare", ref, "--emulate", "-t", "generic", "--synthetic", "1", "--pin", "ghost"),
    ]
    for args in cases:
        proc = run_cli(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert proc.stderr.startswith("npuprep: error:") and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()
    bad_scales = tmp_path / "bad.json"
    bad_scales.write_text(json.dumps({"kind": "convert"}))
    proc = run_cli("compare", ref, ref, "--synthetic", "1", "--scales", bad_scales)
    assert proc.returncode == 2 and "'tensor_scales'" in proc.stderr


def test_a_lowered_candidate_is_widened_so_its_overflow_shows(tmp_path, save):
    # x -> Mul(x, x) -> sq -> Div(sq, 1000) -> y ; the candidate is its FP16 conversion
    from onnxconverter_common import float16

    ref_text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2] x) => (float[2] y) <float k = {1000.0}> {
      [square] sq = Mul(x, x)
      [shrink] y = Div(sq, k)
    }"""
    ref = save(ref_text, "ref.onnx")
    lowered = float16.convert_float_to_float16(onnx.load(str(ref)), keep_io_types=True)
    cand = save(lowered, "cand16.onnx")
    np.savez(tmp_path / "x.npz", x=np.array([300.0, 2.0], np.float32))
    proc = run_cli("compare", ref, cand, "--data", tmp_path / "x.npz", "--json")
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert data["format"] == "fp16" and data["first_divergent"]["node"] == "square"
    assert data["first_divergent"]["inf_count"] == 1
    assert any("widened to FP32" in n and "give --target" in n for n in data["notes"])
    as_is = run_cli("compare", ref, cand, "--data", tmp_path / "x.npz", "--as-is", "--json")
    assert as_is.returncode in (0, 1), as_is.stderr
    assert any("ran as-is" in n for n in json.loads(as_is.stdout)["notes"])


# x -> MatMul(W) -> logits -> Softmax -> p   (a classifier; the candidate's W is 20% larger)
CLASSIFIER = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4, 6] x) => (float[4, 5] p) <float[6, 5] w = {{{w}}}> {{
  [fc] logits = MatMul(x, w)
  [softmax] p = Softmax <axis = -1> (logits)
}}"""


def test_metric_judges_the_outputs_by_their_decisions(tmp_path, save):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 5)) * 3.0
    text = ", ".join(f"{v:.6f}" for v in w.ravel())
    louder = ", ".join(f"{v:.6f}" for v in (w * 1.2).ravel())
    ref = save(CLASSIFIER.format(w=text), "ref.onnx")
    cand = save(CLASSIFIER.format(w=louder), "cand.onnx")
    x = rng.standard_normal((4, 6)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    data = tmp_path / "x.npz"
    # The sharper softmax moves every probability (rel L2 well over 1%) but no decision.
    plain = run_cli("compare", ref, cand, "--data", data, "--json")
    assert plain.returncode == 1 and json.loads(plain.stdout)["passed"] is False
    decided = run_cli("compare", ref, cand, "--data", data, "--metric", "auto", "--json")
    assert decided.returncode == 0, decided.stdout
    result = json.loads(decided.stdout)
    assert result["gate"]["top_k"] == {"p": 1} and result["output_errors"]["p"]["rel_l2"] > 1e-2
    assert any("p by top-1 (auto: Softmax over its last axis)" in n for n in result["notes"])
    by_value = run_cli("compare", ref, cand, "--data", data, "--metric", "rel-l2")
    assert by_value.returncode == 1 and "outputs fail the gate of --metric rel-l2" in by_value.stdout
    bad = run_cli("compare", ref, cand, "--data", data, "--top-k", "p:zero")
    assert bad.returncode == 2 and "--top-k p:zero" in bad.stderr
    report = tmp_path / "r.md"
    unknown = run_cli("compare", ref, cand, "--data", data, "--top-k", "nosuch:2", "--report-md", report)
    assert unknown.returncode == 2 and "'nosuch', which is not an output" in unknown.stderr
    assert not report.exists()
