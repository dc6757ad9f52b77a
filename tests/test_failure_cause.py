"""A random-logit classifier (logits ~1e-10): its FAILED line names the underflow, then the gate."""

from __future__ import annotations

import html
import json
import re
from dataclasses import replace

import numpy as np
import onnx
from conftest import model_from_text, run_cli
from onnx import TensorProto, helper, numpy_helper

from npuprep.calibrate import calibrate
from npuprep.data import load_samples
from npuprep.model_io import load_model
from npuprep.names import md_text
from npuprep.pipeline import CALIBRATE, Gate, Verdict, convert
from npuprep.plan.actions import Hazard
from npuprep.plan.plan import load_plan
from npuprep.profiles import load_profile


def _random_logit_classifier(tmp_path, squash=False):
    # x -> Gemm(W1 ~ 1e-12) -> Relu -> Gemm(W2 ~ 4) -> logits ~1e-10 [-> Tanh when squash]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((64, 64)) * 1e-12).astype(np.float32), "W1"),
             numpy_helper.from_array((rng.standard_normal((64, 10)) * 4.0).astype(np.float32), "W2")]
    nodes = [helper.make_node("Gemm", ["x", "W1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "W2"], ["z" if squash else "logits"], name="fc2")]
    nodes += [helper.make_node("Tanh", ["z"], ["logits"], name="squash")] if squash else []
    graph = helper.make_graph(nodes, "random_logits",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
                              inits)
    path = tmp_path / "cls.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        np.savez(data / f"s{i}.npz", x=rng.uniform(0, 1, (1, 64)).astype(np.float32))
    return path, data


def test_random_logit_classifier_on_rk3588_leaves_the_logits_scaled_up_for_the_host(tmp_path):
    # rk3588 would run the lift's compensating Mul in FP16 and flush the logits: the host does it
    path, data = _random_logit_classifier(tmp_path)
    proc = run_cli("convert", path, "-t", "rk3588", "--data", data, "-o", tmp_path / "c.onnx")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = " ".join(proc.stdout.split())
    assert "multiply it by 2^-" in said and "smallest fp16 normal" in said
    factor = json.loads((tmp_path / "c.report.json").read_text())["host_scales"]["logits"]
    assert 0 < factor < 1


def test_random_logit_classifier_failed_line_names_underflow_first(tmp_path):
    # a Tanh after the logits stops the lift before the output: logits of 1e-10 flush in FP16
    path, data = _random_logit_classifier(tmp_path, squash=True)
    proc = run_cli("convert", path, "-t", "rk3588", "--data", data, "-o", tmp_path / "c.onnx")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdict = " ".join(proc.stdout.split("\nFAILED: ")[-1].split())
    assert verdict.startswith("underflow: output logits lives at |x| <= "), proc.stdout
    assert "under the smallest fp16 normal" in verdict
    assert "; then outputs over their tolerance" in verdict


def _classifier(tmp_path):
    # x -> Gemm(W1 ~ 1e-12) -> Relu -> Gemm(W2 ~ 4) -> logits ~1e-10, as a Model and its samples
    path, data = _random_logit_classifier(tmp_path)
    model = load_model(path)
    return model, load_samples(str(data), model.proto)


def test_no_cause_for_a_pass_or_a_failure_without_underflow(tmp_path):
    model, samples = _classifier(tmp_path)
    passed = convert(model, load_profile("generic"), samples, stats=CALIBRATE)
    assert passed.verdict == Verdict(passed=True) and passed.verdict.said == "PASSED"
    # the same model with an empty plan: logits of 1e-10 flush to 0 in FP16, no remedy tried
    failed = convert(model, load_profile("generic"), samples, stats=CALIBRATE,
                     plan=replace(passed.plan, actions=()))
    assert not failed and failed.verdict.gate is Gate.OUTPUTS
    assert failed.verdict.cause.startswith("underflow: output logits lives at |x| <= ")
    # x -> Exp: the FP16 overflow past x = 11.09 is no underflow; the cause stays empty
    onnx.save(model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 4] x) => (float[1, 4] y) { y = Exp(x) }
    """), str(tmp_path / "exp.onnx"))
    exp = load_model(tmp_path / "exp.onnx")
    feeds = [{"x": np.full((1, 4), 12.0, np.float32)}]
    over = convert(exp, load_profile("generic"), feeds, stats=CALIBRATE, max_rounds=1,
                   plan=replace(passed.plan, actions=(), declined=(), notes=()))
    assert not over and over.verdict.cause == ""
    assert over.verdict.said.startswith("FAILED: first divergent node"), over.verdict


def test_share_gate_failure_names_the_weights_an_underflow_scale_pushed_up(tmp_path):
    # the planner lifts fc1 by 2^-k1 (W2 absorbs 2^k1) and fc2 just enough; a user plan lifts
    # fc2 by 2^(15-k1) instead: W2 (~4) grows 2^15 past FP16's max, so fc2 stays FP32
    model, samples = _classifier(tmp_path)
    plan = convert(model, load_profile("generic"), samples, stats=CALIBRATE).plan
    first, second = plan.actions
    assert (first.entry, second.entry) == ("fc1", "fc2") and first.k < 0
    pushed = replace(second, k=first.k - 15, domain={"logits": 15 - first.k})
    result = convert(model, load_profile("generic"), samples, stats=CALIBRATE,
                     plan=replace(plan, actions=(first, pushed)))
    assert result.output_check and not result.share and result.verdict.gate is Gate.FP32_SHARE
    w2 = np.abs(onnx.numpy_helper.to_array(
        next(t for t in result.rewritten.graph.initializer if t.name == "W2"))).max()
    assert w2 > 65504
    assert result.verdict.cause == (
        "underflow: lifting fc1, fc2 out of fp16's subnormals pushes weights of fc2 past fp16 "
        f"({w2:.6g} .. {w2:.6g}), which keeps them FP32")
    assert result.verdict.said.startswith(f"FAILED: {result.verdict.cause}; then ")


def test_a_hazard_only_a_pin_fixes_is_the_cause_on_a_target_that_cannot_pin(tmp_path):
    # t -> Mul(freqs) -> Sin | Cos -> ... with t up to 1000 on rk3588: FP16's phase spacing
    # makes Sin/Cos noise; the plan's Unpinnable names the pin rk3588 cannot grant, and the
    # FAILED line (report.json, .md and .html alike) says so first
    from test_phase import _model, _timesteps

    model, samples = _model(), _timesteps(6, 1)
    result = convert(model, load_profile("rk3588"), samples, stats=CALIBRATE, max_rounds=1,
                     max_fp32_share=1.0)
    assert not result.output_check and result.verdict.gate is Gate.OUTPUTS
    assert [u.hazard for u in result.plan.unpinnable] == [Hazard.COARSE_PHASE]
    assert result.verdict.cause.startswith("sin, cos read phase phase up to ")
    assert result.verdict.cause.endswith("only an FP32 pin of phase_mul, sin, cos could fix it, "
                                         "and target rk3588 cannot pin")
    assert result.verdict.said.startswith(f"FAILED: {result.verdict.cause}; then ")
    result.save(tmp_path / "m16.onnx", html=tmp_path / "m16.html")
    stored = json.loads((tmp_path / "m16.report.json").read_text())["verdict"]
    assert stored["cause"] == result.verdict.cause and stored["said"] == result.verdict.said
    page = (tmp_path / "m16.html").read_text()
    (shown,) = re.findall(r'<p class="verdict-said" id="verdict-said">(.*?)</p>', page)
    assert "FAILED: " + html.unescape(shown) == stored["said"]
    assert f"- verdict: **FAILED**: {md_text(html.unescape(shown))}" in (
        tmp_path / "m16.report.md").read_text()
    # the plan as written keeps the record: converting with it names the same cause
    again = convert(model, load_profile("rk3588"), samples, stats=CALIBRATE, max_rounds=1,
                    max_fp32_share=1.0, plan=load_plan(tmp_path / "m16.plan.yaml", model))
    assert again.verdict.cause == result.verdict.cause
    # the same conversion on a target that pins: the pin is made and no cause is said
    pinned = convert(model, load_profile("generic"), samples, stats=CALIBRATE, max_rounds=1,
                     max_fp32_share=1.0)
    assert pinned and pinned.verdict.cause == ""


def test_an_output_with_a_few_values_under_the_normals_is_no_underflow_cause(tmp_path):
    # x -> Sigmoid -> y with 1 in 8 values of x at -12 (y = 6e-6, under FP16's 6.1e-5): the
    # finding is raised, but flushing those values is not why a tight rtol fails
    onnx.save(model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 64] x) => (float[1, 64] y) { y = Sigmoid(x) }
    """), str(tmp_path / "s.onnx"))
    model = load_model(tmp_path / "s.onnx")
    rng = np.random.default_rng(0)
    feeds = []
    for _ in range(3):
        x = rng.uniform(-2, 2, (1, 64)).astype(np.float32)
        x[0, ::8] = -12.0
        feeds.append({"x": x})
    result = convert(model, load_profile("generic"), feeds, stats=calibrate(model, feeds, detail="all"),
                     rtol=1e-6, max_rounds=1)
    under = [f for f in result.findings if f.rule == "range.underflow" and f.tensor == "y"]
    assert under and 0 < under[0].evidence["share_below_min_normal"] < 0.5
    assert not result and result.verdict.cause == ""


def test_a_softmax_over_thousands_of_classes_fails_without_blaming_its_tiny_probabilities(tmp_path):
    # x[4,16] -> MatMul(W ~ N(0, 1)) -> Softmax over 2000 classes: most probabilities under
    # FP16's smallest normal (the 8-bit conversion's wider format); a 1e-4 tolerance fails on
    # the INT8 MatMul's error at the largest ones
    rng = np.random.default_rng(3)
    proto = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4, 16] x) => (float[4, 2000] y) {
          z = MatMul(x, w)
          y = Softmax<axis=-1>(z)
        }
    """)
    proto.graph.initializer.append(
        numpy_helper.from_array(rng.standard_normal((16, 2000)).astype(np.float32), "w"))
    onnx.save(proto, str(tmp_path / "sm.onnx"))
    model = load_model(tmp_path / "sm.onnx")
    feeds = [{"x": rng.standard_normal((4, 16)).astype(np.float32)} for _ in range(4)]
    failed = convert(model, load_profile("a2000"), feeds, stats=CALIBRATE, rtol=1e-4,
                     metric="rel-l2", precision="int8")
    errors = failed.output_check.outputs["y"]
    under = next(f for f in failed.findings if f.rule == "range.underflow" and f.tensor == "y")
    assert under.evidence["share_below_min_normal"] > 0.5
    assert not failed and errors["max_abs_error"] > 1e-4 and errors["rel_l2"] > 1e-4
    assert failed.verdict.cause == "" and "underflow" not in failed.verdict.said, failed.verdict.said


def test_an_output_judged_by_its_text_fails_by_its_text_not_by_a_passing_sets_rel_l2():
    # PP-OCRv5 in INT8: 1 of 8 calibration texts changed; the held-out texts all held at a
    # larger rel L2. The reason names the texts, not the held-out set's rel L2.
    from types import SimpleNamespace

    from npuprep.pipeline.verdict import _precision_limited
    from npuprep.verify.output_check import OutputCheck

    def errors(rel_l2: float, agreement: float) -> dict:
        return {"rel_l2": rel_l2, "max_abs_error": 0.4, "nonfinite": 0, "top_k": 0, "ctc_text": True,
                "top_k_agreement": agreement, "top_k_positions": 8, "top_k_ties": 0,
                "top_k_ties_flipped": 0}

    calibration = OutputCheck(rtol=0.05, samples=8, outputs={"text": errors(0.089, 0.875)})
    held = OutputCheck(rtol=0.05, samples=4, outputs={"text": errors(0.192, 1.0)})
    result = SimpleNamespace(first_divergent=None, error_attribution=(), precision="int8",
                             output_check=calibration, holdout=held)
    said = _precision_limited(result, [calibration, held])
    assert said.startswith("outputs off (text: CTC text 87.5% calibration) with no Inf/NaN (INT8"), said
    assert "0.192" not in said


def test_steps_judged_one_by_one_fail_once_per_set_and_hint_at_their_ctc_text():
    # PP-OCRv5 in FP16 under --metric auto: 1 of 320 and 1 of 160 steps flip, every text the same.
    from types import SimpleNamespace

    from npuprep.pipeline.verdict import _precision_limited
    from npuprep.verify.output_check import OutputCheck

    def errors(agreement: float, texts: float) -> dict:
        return {"rel_l2": 0.03, "max_abs_error": 0.4, "nonfinite": 0, "top_k": 1,
                "top_k_agreement": agreement, "top_k_positions": 320, "top_k_ties": 0,
                "top_k_ties_flipped": 0, "ctc_text_agreement": texts}

    calibration = OutputCheck(rtol=0.01, samples=8, outputs={"y": errors(319 / 320, 1.0)})
    held = OutputCheck(rtol=0.01, samples=4, outputs={"y": errors(159 / 160, 1.0)})
    result = SimpleNamespace(first_divergent=None, error_attribution=(), precision="fp16",
                             output_check=calibration, holdout=held)
    said = _precision_limited(result, [calibration, held])
    assert said.startswith("outputs off (y: top-1 99.69% calibration, top-1 99.38% held out)"), said
    assert "read as CTC text every sequence of y holds (--top-k y:ctc if a CTC decoder reads it)" in said
    held.outputs["y"]["ctc_text_agreement"] = 0.75  # a text changed: no hint
    assert "CTC" not in _precision_limited(result, [calibration, held])
