"""Outputs that FP16's precision, not its range, leaves off: pins that buy nothing are
dropped, and a classifier can be judged by its decisions (`--top-k`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from conftest import run_cli
from onnx import parser

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.data import load_samples
from npuprep.model_io import Model, fingerprint
from npuprep.profiles import load_profile
from npuprep.report.output_verdicts import describe_worst
from npuprep.verify.output_errors import OutputErrors, output_passes

GENERIC = load_profile("generic")

# x -> Gemm(x, I, bias 1000) -> big -> Sub(big, 1000) -> y   (FP16 keeps x to 0.5 steps around
# 1000). The shift is a layer with weights: no plan pins it for precision, and verification's
# FP32 budget cannot hold it, so FP16's precision, not its range, fails the output.
_IDENTITY = ", ".join("1.0" if i == j else "0.0" for i in range(8) for j in range(8))
CANCEL = f"""
<ir_version: 8, opset_import: ["" : 17]>
g (float[64, 8] x) => (float[64, 8] y) <float[8, 8] w = {{{_IDENTITY}}}, float c = {{1000.0}}> {{
    [shift] big = Gemm (x, w, c)
    [unshift] y = Sub (big, c)
}}
"""

# x -> MatMul(W) -> logits (~6, well separated per row) -> Softmax -> p
CLASSIFIER = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[32, 16] x) => (float[32, 10] p) {
    [mm] logits = MatMul (x, W)
    [softmax] p = Softmax <axis = -1> (logits)
}
"""


def _data(tmp_path: Path, feeds: list[dict[str, np.ndarray]]) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    for i, feed in enumerate(feeds):
        np.savez(data / f"sample_{i:03d}.npz", **feed)
    return data


def _classifier(tmp_path: Path) -> tuple[Path, Path]:
    """Logits of a few units with one clear winner per row: FP16 rounding of logits near 8
    (steps of 1/128) moves the probabilities by a few percent, never the winner."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 10)).astype(np.float32) * 1.5
    proto = parser.parse_model(CLASSIFIER)
    proto.graph.initializer.append(onnx.numpy_helper.from_array(w, "W"))
    onnx.checker.check_model(proto, full_check=True)
    path = tmp_path / "cls.onnx"
    onnx.save(proto, path)
    feeds = []
    for _ in range(3):
        x = rng.standard_normal((32, 16)).astype(np.float32)
        feeds.append({"x": x})
    return path, _data(tmp_path, feeds)


def _convert_cancellation(tmp_path: Path) -> Any:
    """`npuprep convert` of CANCEL on two samples, as a user runs it (report at c.report.*)."""
    path = tmp_path / "cancel.onnx"
    onnx.save(parser.parse_model(CANCEL), path)
    rng = np.random.default_rng(1)
    data = _data(tmp_path, [{"x": rng.standard_normal((64, 8)).astype(np.float32)} for _ in range(2)])
    return run_cli("convert", path, "--target", "generic", "--data", data, "-o", tmp_path / "c.onnx")


def test_a_verification_pin_that_does_not_improve_the_outputs_is_dropped(tmp_path):
    proto = parser.parse_model(CANCEL)
    model = Model(proto, "cancel.onnx", fingerprint(proto))
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((64, 8)).astype(np.float32)} for _ in range(2)]
    samples = load_samples(_data(tmp_path, feeds), proto)
    result = convert(model, GENERIC, list(samples), stats=calibrate(model, samples))
    # The Sub cancels what FP16 already lost in the Gemm: pinning the Sub alone cannot help.
    worst = max(o["rel_l2"] for o in result.output_check.outputs.values())
    assert worst > 1e-2 and not result.passed
    assert "unshift" not in result.pinned_nodes
    assert not [a for a in result.plan.actions if "verification round" in getattr(a, "why", "")]
    assert any("did not improve the outputs" in n and "dropped it" in n for n in result.notes)


def test_top_k_agreement_is_measured_and_passes_an_output_whose_decisions_agree():
    errors = OutputErrors(top_k={"p": 1, "q": 2})
    ref = np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]])
    errors.add("p", ref, np.array([[0.6, 0.3, 0.1], [0.1, 0.4, 0.5]]))  # same winners, 10% off
    errors.add("q", ref, np.array([[0.2, 0.7, 0.1], [0.6, 0.3, 0.1]]))  # top-2 sets differ in row 2
    errors.add("r", ref, ref * 1.5)
    out = errors.result()
    assert out["p"]["top_k_agreement"] == 1.0 and out["p"]["rel_l2"] > 0.1
    assert output_passes(out["p"], rtol=1e-2)
    assert out["q"]["top_k_agreement"] == 0.5 and not output_passes(out["q"], rtol=1e-2)
    assert "top_k" not in out["r"] and not output_passes(out["r"], rtol=1e-2)
    assert output_passes(out["r"], rtol=0.6)


def test_a_flip_where_fp32_is_tied_within_rtol_is_a_tie_not_a_decision():
    # 3 positions x 3 classes: a clear winner, a tie within 1% (0.457 / 0.454), a 2% margin.
    ref = np.array([[0.8, 0.15, 0.05], [0.457, 0.454, 0.089], [0.49, 0.48, 0.03]])
    tie_flipped = ref.copy()
    tie_flipped[1, :2] = [0.452, 0.459]
    both_flipped = tie_flipped.copy()
    both_flipped[2, :2] = [0.47, 0.50]
    judged = OutputErrors(top_k={"p": 1}, tie_rtol=1e-2)
    judged.add("p", ref, tie_flipped)
    judged.add("q", ref, both_flipped)
    out = judged.result()
    assert out["p"]["top_k_ties"] == 1 and out["p"]["top_k_ties_flipped"] == 1
    assert out["p"]["top_k_positions"] == 2 and out["p"]["top_k_agreement"] == 1.0
    assert out["p"]["top1_agreement"] == 1.0 and out["p"]["top1_ties"] == 1
    assert output_passes(out["p"], rtol=1e-4)
    assert describe_worst(out["p"]).endswith(
        "top-1 agrees at 2 of 2 decided positions over all samples (1 FP32 tie(s) within rtol "
        "not counted)")
    # The 2% margin is a decision at rtol 1e-2: its flip fails the output.
    assert "top_k" not in out["q"] and out["q"]["top1_agreement"] == 0.5
    strict = OutputErrors(top_k={"p": 1})  # tie_rtol 0: only exact ties are ties
    strict.add("p", ref, tie_flipped)
    assert strict.result()["p"]["top_k_agreement"] == 2 / 3 and strict.result()["p"]["top_k_ties"] == 0


def test_convert_judges_a_classifier_by_its_decisions_with_top_k(tmp_path):
    path, data = _classifier(tmp_path)
    strict = run_cli("convert", path, "--target", "generic", "--data", data, "--rtol", "1e-4",
                     "-o", tmp_path / "strict.onnx", "--max-rounds", "1", "--metric", "rel-l2")
    assert strict.returncode == 1, strict.stdout
    # FAILED is never written under the name asked for.
    assert (tmp_path / "strict.FAILED.onnx").is_file() and not (tmp_path / "strict.onnx").exists()
    judged = run_cli("convert", path, "--target", "generic", "--data", data, "--rtol", "1e-4",
                     "-o", tmp_path / "judged.onnx", "--max-rounds", "1", "--top-k", "p:1")
    assert judged.returncode == 0, judged.stdout
    assert "top-1 100%" in judged.stdout
    report = (tmp_path / "judged.report.md").read_text()
    assert "top-1 agreement 100%" in report
    import json

    out = json.loads((tmp_path / "judged.report.json").read_text())["verification"]["outputs"]["p"]
    assert out["top_k"] == 1 and out["top_k_agreement"] == 1.0 and out["rel_l2"] > 1e-4


# x -> Softmax -> p   (FP16 steps of 0.5 near 1000: 1000.22 and 1000.23 both become 1000)
TIED = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4, 3] x) => (float[4, 3] p) {
    [softmax] p = Softmax <axis = -1> (x)
}
"""


def test_convert_with_top_k_counts_a_flipped_fp32_tie_apart_and_passes(tmp_path):
    path = tmp_path / "tied.onnx"
    onnx.save(parser.parse_model(TIED), path)
    # Row 0 is decided (FP16 moves it by 0.1, the winner holds); row 1 is FP32's tie within
    # 1%, which FP16 flips (equal values: the first wins).
    x = np.array([[1000.2, 1000.3, 990.0], [1000.22, 1000.23, 990.0], [0, 5, 1], [1, 0, 5]],
                 dtype=np.float32)
    data = _data(tmp_path, [{"x": x}])
    plain = run_cli("convert", path, "--target", "generic", "--data", data,
                    "-o", tmp_path / "plain.onnx", "--max-rounds", "1", "--metric", "rel-l2")
    assert plain.returncode == 1, plain.stdout
    said = " ".join(plain.stdout.split())
    # The tie flipped, every decided position held: the note says how to judge by decisions.
    assert "top-1 agrees at 3 of 3 decided positions over all samples (1 FP32 tie(s)" in said
    assert "every top-1 decision of p on the calibration samples holds; if its decisions are " \
           "what it is judged by: --top-k p:1" in said
    judged = run_cli("convert", path, "--target", "generic", "--data", data,
                     "-o", tmp_path / "judged.onnx", "--max-rounds", "1", "--top-k", "p:1")
    assert judged.returncode == 0, judged.stdout
    assert "top-1 100% (1 tie, 1 flipped)" in judged.stdout
    assert "top-1 agreement 100% (1 tie, 1 flipped)" in (tmp_path / "judged.report.md").read_text()


def test_top_k_names_an_output_and_a_whole_k(tmp_path):
    path, data = _classifier(tmp_path)
    for bad, words in (("logits:1", "'logits', which is not an output"), ("p:0", "--top-k p:0"),
                       ("p", "--top-k p:"), ("p:10", "'p' has 10 classes along its last axis"),
                       ("p:100000000000000000000", "'p' has 10 classes")):
        proc = run_cli("convert", path, "--target", "generic", "--data", data, "--top-k", bad,
                       "-o", tmp_path / "x.onnx")
        assert proc.returncode == 2, proc.stderr
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "x.onnx").exists()


def test_the_verdict_tells_precision_from_overflow(tmp_path):
    proc = _convert_cancellation(tmp_path)
    assert proc.returncode == 1, proc.stderr
    verdict = " ".join(proc.stdout[proc.stdout.index("\nFAILED") + 1:].split())
    assert verdict.startswith("FAILED: outputs off by rel L2 0.1")
    assert "with no Inf/NaN (FP16 precision; --metric, --top-k, --detect or --rtol are yours): largest own share " \
        in verdict and "first seen at 'unshift'" in verdict
    assert max(map(len, proc.stdout.splitlines())) <= 100


def test_where_the_error_sits_tells_one_undecided_position_from_an_error_everywhere():
    rng = np.random.default_rng(5)
    ref = rng.dirichlet(np.full(10, 0.3), size=(2, 40))  # 2 samples x 40 positions x 10 classes
    ref[1, 7, :2] = [0.49, 0.48]  # sample 1, position 7: the reference is undecided
    ref[1, 7, 2:] = 0.03 / 8
    local = ref.copy()
    local[1, 7, :2] = [0.40, 0.57]  # the near-tie flips; every other position is exact
    spread = ref * (1 + 0.02 * rng.standard_normal(ref.shape))
    errors = OutputErrors()
    for i in range(2):
        errors.add("local", ref[i], local[i])
        errors.add("spread", ref[i], spread[i])
    out = errors.result()
    w = out["local"]["worst_sample"]
    assert w["sample"] == 1 and w["position"] == 7 and w["of"] == 40 and w["positions"] == 1
    assert w["share"] == 1.0 and w["reference_top2"] == [0.49, 0.48] and not w["same_decision"]
    assert np.isclose(w["rel_l2"], np.linalg.norm(local[1] - ref[1]) / np.linalg.norm(ref[1]))
    assert out["spread"]["worst_sample"]["share"] < 0.5  # 1 of 40 positions holds far less
    words = describe_worst(out["local"])
    assert words.startswith("worst sample #1 (rel L2 ") and "100% of its error at 1 of 40 positions" in words
    assert "FP32's top two are 0.49 / 0.48, decision changed" in words
    # Probabilities along the last axis: the decisions are counted without --top-k.
    assert out["local"]["top1_agreement"] == 79 / 80 and "top_k" not in out["local"]
    assert words.endswith("; top-1 agrees at 79 of 80 positions over all samples")
    assert describe_worst({"rel_l2": 0.0}) == ""
    logits = OutputErrors()
    logits.add("z", np.log(ref[1]), np.log(local[1]))
    z = logits.result()["z"]
    assert "top1_agreement" not in z  # not probabilities: no decisions counted or spoken of
    assert describe_worst(z).endswith("of its error at 1 of 40 positions")


def test_a_precision_failure_says_where_its_error_sits(tmp_path):
    proc = _convert_cancellation(tmp_path)
    assert proc.returncode == 1, proc.stderr
    said = " ".join(proc.stdout.split())
    # The cancellation loses precision at every row: the worst 1 of 64 rows holds a small share.
    assert "note: y on the calibration samples: worst sample #" in said
    assert "of its error at 1 of 64 positions" in said
    report = (tmp_path / "c.report.md").read_text()
    assert "Where the error sits" in report and "`y` on the calibration samples: worst sample" in report
    import json

    worst = json.loads((tmp_path / "c.report.json").read_text())["verification"]["outputs"]["y"]["worst_sample"]
    assert worst["of"] == 64 and worst["share"] < 0.2


# x -> Gemm(W, 1) -> h (1 +- 0.01) -> Unsqueeze -> u -> Log (FP32, the user's pin) -> y (~0.01)
# x -> MatMul(V) -> z                                   (the FP16 bulk of the FLOPs)
# FP16 keeps h to steps of 1/1024, ~3% of y. Pinning the Gemm alone buys nothing: the FP16
# Unsqueeze between it and the FP32 Log rounds h again; the chain to the Log must be kept.
NEAR_ONE_LOG = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[64, 16] x) => (float[1, 64, 4] y, float[64, 256] z) <int64[1] axes = {0}> {
    [mm] h = Gemm (x, W, one)
    [unsq] u = Unsqueeze (h, axes)
    [log] y = Log (u)
    [bulk] z = MatMul (x, V)
}
"""


def test_a_precision_failure_keeps_the_attributed_chain_wider_up_to_the_fp32_nodes(tmp_path):
    from npuprep.plan import PinFp32, Plan

    rng = np.random.default_rng(4)
    proto = parser.parse_model(NEAR_ONE_LOG)
    proto.graph.initializer.extend([
        onnx.numpy_helper.from_array((rng.standard_normal((16, 4)) * 0.0025).astype(np.float32), "W"),
        onnx.numpy_helper.from_array(np.ones(4, np.float32), "one"),
        onnx.numpy_helper.from_array((rng.standard_normal((16, 256)) / 4).astype(np.float32), "V")])
    model = Model(proto, "near_one_log.onnx", fingerprint(proto))
    feeds = [{"x": rng.standard_normal((64, 16)).astype(np.float32)} for _ in range(3)]
    plan = Plan(fingerprint=model.fingerprint, target="generic", precision="fp16",
                actions=(PinFp32(nodes=("log",), forced=True, why="the user keeps the Log"),))
    result = convert(model, GENERIC, feeds, plan=plan)
    assert result.passed, result.notes
    assert {"mm", "unsq", "log"} <= set(result.pinned_nodes) and "bulk" not in result.pinned_nodes
    worst = max(o["rel_l2"] for o in result.output_check.outputs.values())
    assert worst <= 1e-2
    # What it cost is said: the round's pin names the layers and the FP32 share stays small.
    pin = next(a for a in result.plan.actions if "verification round" in getattr(a, "why", ""))
    assert pin.nodes == ("mm", "unsq") and "squared error" in pin.why
    assert result.flops_fp32_share < 0.05
