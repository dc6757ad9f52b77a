"""The user's goal by default: outputs a consumer decides by argmax are judged by their top-1
decision (`--metric auto`), each output says which rule judged it, and a FAILED conversion is
never written under the requested name."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx
from conftest import run_cli
from onnx import numpy_helper, parser

from npuprep.convert import convert
from npuprep.model_io import Model
from npuprep.pipeline.verdict import judge
from npuprep.profiles import load_profile
from npuprep.verify.output_check import OutputCheck, decided_outputs, judged_outputs
from npuprep.verify.output_errors import CTC_TEXT

# x -> MatMul(W) -> logits -> Softmax -> p ; x -> Gemm(B) -> box (4 values, a regression)
HEADS = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[8, 16] x) => (float[8, 12] p, float[8, 12] logits, float[8, 4] box, float[8, 12] e) {
    [mm] logits = MatMul (x, W)
    [softmax] p = Softmax <axis = -1> (logits)
    [box] box = Gemm (x, B)
    [emb] e = MatMul (x, E)
}
"""


def _heads() -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    proto = parser.parse_model(HEADS)
    # W: logits 10 units apart (a sure classifier); E: small values (an embedding, no peak).
    for name, shape, scale in (("W", (16, 12), 3.0), ("B", (16, 4), 1.0), ("E", (16, 12), 0.05)):
        proto.graph.initializer.append(
            numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
    return proto


def _feeds(n: int = 2) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(2)
    return [{"x": rng.standard_normal((8, 16)).astype(np.float32)} for _ in range(n)]


def test_softmax_peaked_logits_and_an_argmax_are_decisions_a_box_and_an_embedding_are_not():
    proto = _heads()
    top_k, judged = judged_outputs(proto, _feeds(), "auto", {})
    assert top_k == {"p": 1, "logits": 1}
    assert judged == {"p": "top-1 (auto: Softmax over its last axis)",
                      "logits": "top-1 (auto: logits of a final MatMul, peaked softmax)",
                      "box": "rel L2", "e": "rel L2"}
    # Without values only the graph speaks: the Softmax, and an ArgMax the graph takes.
    argmax = onnx.helper.make_node("ArgMax", ["e"], ["cls"], axis=-1)
    proto.graph.node.append(argmax)
    assert decided_outputs(proto) == {"p": "Softmax over its last axis",
                                      "e": "the graph takes its argmax"}
    # Probabilities written out (exp / sum, no Softmax node) are found from their values.
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    written = parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2, 3] x) => (float[2, 3] y) { ex = Exp (x)  s = ReduceSum <keepdims = 1> (ex, axes)
                                               y = Div (ex, s) }""")
    assert decided_outputs(written, [{"y": probs}]) == {"y": "probabilities along its last axis"}


# x (batch x 16 steps x 12 classes) -> Softmax -> p: a CTC recogniser's head, class 0 the blank
CTC_HEAD = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 16, 12] x) => (float[1, 16, 12] p) { p = Softmax <axis = -1> (x) }
"""
# ids (token ids) -> Gather(E) -> Softmax -> p: a token classifier, its "O" class 0
TOKEN_HEAD = """
<ir_version: 8, opset_import: ["" : 17]>
g (int64[1, 16] ids) => (float[1, 16, 12] p) { e = Gather (E, ids)  p = Softmax <axis = -1> (e) }
"""


def _steps(blank_every: int) -> np.ndarray:
    """Logits over 16 steps whose class 0 leads every `blank_every`-th step, another class the
    others (a line's characters between blanks)."""
    logits = np.zeros((1, 16, 12), np.float32)
    for t in range(16):
        logits[0, t, 0 if t % blank_every == 0 else 1 + t % 11] = 8.0
    return logits


def test_a_ctc_head_is_judged_by_its_text_a_token_classifier_and_a_rare_blank_by_each_step():
    ctc = parser.parse_model(CTC_HEAD)
    top_k, judged = judged_outputs(ctc, [{"x": _steps(2)}], "auto", {})
    assert top_k == {"p": CTC_TEXT}
    assert judged["p"] == "CTC text (auto: Softmax over its last axis, blank 0 leads 50% of steps)"
    # Class 0 leading 1 step in 16 is no blank between characters: each step is judged.
    assert judged_outputs(ctc, [{"x": _steps(16)}], "auto", {})[0] == {"p": 1}
    # The user's rule stands: --top-k p:1 judges each step.
    assert judged_outputs(ctc, [{"x": _steps(2)}], "auto", {"p": 1}) == (
        {"p": 1}, {"p": "top-1 (--top-k)"})
    # Steps first (torch's CTC layout, 16 x 1 x 12: ddddocr's recogniser) reads the same.
    steps_first = parser.parse_model(CTC_HEAD.replace("[1, 16, 12]", "[16, 1, 12]"))
    assert judged_outputs(steps_first, [{"x": _steps(2).transpose(1, 0, 2)}], "auto", {})[0] == {
        "p": CTC_TEXT}
    tokens = parser.parse_model(TOKEN_HEAD)
    tokens.graph.initializer.append(numpy_helper.from_array(_steps(2)[0], "E"))
    top_k, judged = judged_outputs(tokens, [{"ids": np.arange(16, dtype=np.int64)[None]}], "auto", {})
    assert top_k == {"p": 1} and judged["p"] == "top-1 (auto: Softmax over its last axis)"


def test_metric_and_top_k_override_what_auto_finds():
    proto = _heads()
    assert judged_outputs(proto, _feeds(), "rel-l2", {})[0] == {}
    top_k, judged = judged_outputs(proto, _feeds(), "top1", {"box": 2})
    assert top_k == {"p": 1, "logits": 1, "box": 2, "e": 1}
    assert judged["box"] == "top-2 (--top-k)" and judged["e"] == "top-1 (--metric top1)"


def _classifier(tmp_path):
    """MatMul -> Softmax over 10 classes, one clear winner per row; an rtol of 1e-4 that FP16's
    rounding of the probabilities misses while every decision holds."""
    rng = np.random.default_rng(3)
    proto = parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[32, 16] x) => (float[32, 10] p) { logits = MatMul (x, W)  p = Softmax (logits) }""")
    proto.graph.initializer.append(numpy_helper.from_array(
        (rng.standard_normal((16, 10)) * 1.5).astype(np.float32), "W"))
    path, data = tmp_path / "cls.onnx", tmp_path / "data"
    onnx.save(proto, path)
    data.mkdir()
    for i in range(4):
        np.savez(data / f"s{i}.npz", x=rng.standard_normal((32, 16)).astype(np.float32))
    return path, data


def test_convert_judges_a_classifier_by_its_decisions_and_fails_by_name_under_rel_l2(tmp_path):
    path, data = _classifier(tmp_path)
    out = tmp_path / "c.onnx"
    auto = run_cli("convert", path, "--target", "generic", "--data", data, "--rtol", "1e-4",
                   "--max-rounds", "1", "-o", out)
    assert auto.returncode == 0, auto.stdout + auto.stderr
    assert "top-1 (auto: Softmax over its last axis)" in " ".join(auto.stdout.split())
    report = json.loads((tmp_path / "c.report.json").read_text())
    assert report["judged_by"] == {"p": "top-1 (auto: Softmax over its last axis)"}
    assert report["verification"]["outputs"]["p"]["rel_l2"] > 1e-4 and out.is_file()
    # Judged by rel L2 it fails: the model goes to c.FAILED.onnx, the passing c.onnx of the
    # run before goes with the rest of its set, and the one line says where the model is.
    strict = run_cli("convert", path, "--target", "generic", "--data", data, "--rtol", "1e-4",
                     "--max-rounds", "1", "--metric", "rel-l2", "-o", out)
    assert strict.returncode == 1, strict.stdout + strict.stderr
    failed = tmp_path / "c.FAILED.onnx"
    assert failed.is_file() and not out.exists()
    assert f"c.report.md; model: {failed}, not -o" in " ".join(strict.stdout.split())
    report = json.loads((tmp_path / "c.report.json").read_text())
    assert report["output"] == str(failed) and report["artefacts"]["model"] == str(failed)
    assert report["judged_by"] == {"p": "rel L2 (--metric rel-l2)"}
    # Passing again takes the FAILED model away.
    again = run_cli("convert", path, "--target", "generic", "--data", data, "--rtol", "1e-4",
                    "--max-rounds", "1", "-o", out)
    assert again.returncode == 0 and out.is_file() and not failed.exists()


def test_an_8bit_failure_names_the_share_the_outputs_or_both():
    # x -> MatMul(W) -> y, in INT8: the outputs pass, and a minimum share above what it
    # reached fails on the share alone, saying the outputs passed.
    proto = parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[8, 16] x) => (float[8, 4] y) { [mm] y = MatMul (x, W) }""")
    proto.graph.initializer.append(numpy_helper.from_array(
        np.random.default_rng(4).standard_normal((16, 4)).astype(np.float32), "W"))
    model = Model(proto=proto, path="mm.onnx", digest="mm")
    result = convert(model, load_profile("a2000"), _feeds(8), precision="int8", holdout=None,
                     stats="calibrate")
    assert result.passed and result.eight_bit is not None
    short = replace(result, eight_bit=replace(result.eight_bit, min_8bit_share=1.01))
    verdict = judge(short)
    assert not verdict.passed and verdict.gate.value == "8bit_share"
    assert verdict.said.startswith("FAILED: 100% of the multiply-adds in int8, under "
                                   "--min-8bit-share 101% (the outputs pass: worst rel L2")
    check = result.output_check
    off = OutputCheck(rtol=check.rtol, samples=check.samples,
                      outputs={"y": {**check.outputs["y"], "rel_l2": 0.5}})
    both = judge(replace(short, output_check=off))
    assert both.gate.value == "outputs" and "; and 100% of the multiply-adds in int8, under " \
        "--min-8bit-share 101%" in both.said
