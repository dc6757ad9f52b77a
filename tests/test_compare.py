"""Layer-by-layer compare: numbers checked against numpy, first divergent node, isolation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import model_from_text
from onnx import TensorProto, helper

from npuprep.cli.common import dump_json
from npuprep.errors import NpuprepError
from npuprep.examples.planner import build_planner, planner_samples
from npuprep.numerics import get_format
from npuprep.profiles import load_profile
from npuprep.runtime.session import make_session, run
from npuprep.verify.compare import compare_emulated, compare_models

FP16 = get_format("fp16")


def all_values(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every float node output of the main graph, from a plain FP32 run."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    known = {o.name for o in exposed.graph.output}
    for node in exposed.graph.node:
        for out in node.output:
            if out and out not in known:
                exposed.graph.output.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, None))
                known.add(out)
    return run(make_session(exposed), feed)


def chain(w_a: float = 2.0, w_b: float = 0.5) -> onnx.ModelProto:
    # x -> Mul(w_a) -> a -> Add(1) -> b -> Mul(w_b) -> y
    return model_from_text(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[3] x) => (float[3] y) <float wa = {{{w_a}}}, float one = {{1.0}}, float wb = {{{w_b}}}> {{
      [scale_a] a = Mul(x, wa)
      [shift_b] b = Add(a, one)
      [scale_y] y = Mul(b, wb)
    }}""")


SAMPLES = [{"x": np.array([1.0, -2.0, 3.0], np.float32)}, {"x": np.array([0.5, 4.0, -1.0], np.float32)}]


def test_identical_models_pass_with_zero_error():
    result = compare_models(chain(), chain(), SAMPLES, rtol=1e-3, atol=1e-6)
    assert result and result.first_divergent is None
    assert [t.tensor for t in result.tensors] == ["a", "b", "y"]
    for t in result.tensors:
        assert t and t.max_abs_error == 0 and t.rel_l2 == 0 and t.cosine == pytest.approx(1.0)
        assert t.elements == 6


def test_metrics_match_numpy_over_all_samples():
    ref, cand = chain(), chain(w_a=2.01)
    result = compare_models(ref, cand, SAMPLES, rtol=1e-3, atol=1e-6)
    r = {k: np.concatenate([all_values(ref, s)[k] for s in SAMPLES]).astype(np.float64) for k in "aby"}
    c = {k: np.concatenate([all_values(cand, s)[k] for s in SAMPLES]).astype(np.float64) for k in "aby"}
    for name in "aby":
        t = result.tensor(name)
        d = c[name] - r[name]
        assert t.max_abs_error == pytest.approx(np.abs(d).max(), rel=1e-5)
        assert t.rel_l2 == pytest.approx(np.linalg.norm(d) / np.linalg.norm(r[name]), rel=1e-4)
        cos = r[name] @ c[name] / (np.linalg.norm(r[name]) * np.linalg.norm(c[name]))
        assert t.cosine == pytest.approx(cos, abs=1e-6)
        assert t.ref_absmax is None  # measured only where Inf/NaN or the limit showed up
        assert t.cand_absmax == pytest.approx(np.abs(c[name]).max())
    assert not result
    assert result.first_divergent.node == "scale_a" and result.first_divergent.op_type == "Mul"


def test_thresholds_need_both_rtol_and_atol_crossed_and_overrides_apply():
    ref, cand = chain(), chain(w_a=2.01)  # rel L2 of a = 0.005
    assert compare_models(ref, cand, SAMPLES, rtol=0.01, atol=1e-6)
    assert compare_models(ref, cand, SAMPLES, rtol=1e-3, atol=1.0)
    failing = compare_models(ref, cand, SAMPLES, rtol=1e-3, atol=1e-6)
    assert {t.tensor for t in failing.tensors if not t} == {"a", "b", "y"}
    loose = compare_models(ref, cand, SAMPLES, rtol=1e-3, atol=1e-6, overrides={"a": (0.01, 1e-6)})
    assert loose.tensor("a") and loose.first_divergent.tensor == "b"
    with pytest.raises(NpuprepError, match="'nope'"):
        compare_models(ref, cand, SAMPLES, rtol=1e-3, atol=1e-6, overrides={"nope": (1, 1)})


def test_isolation_separates_own_error_from_accumulated_error():
    ref, cand = chain(), chain(w_a=2.2)
    result = compare_models(ref, cand, SAMPLES, rtol=1e-3, atol=1e-6, isolate=True)
    a, b, y = (result.tensor(n) for n in "aby")
    assert a.isolated_rel_l2 == pytest.approx(a.rel_l2, rel=1e-5)  # its own weight is off
    assert b.rel_l2 > 0.05 and y.rel_l2 > 0.05  # downstream inherits the error ...
    assert b.isolated_rel_l2 == 0 and y.isolated_max_abs_error == 0  # ... but adds none
    assert "isolated" in b.to_dict() and "isolated" not in compare_models(
        ref, cand, SAMPLES, rtol=1, atol=1).tensor("b").to_dict()


def test_isolation_charges_an_overflow_to_its_producer():
    # x -> Mul(x, x) -> sq -> Sub(sq, x) -> y : with FP16 inputs Sub sees rounded sq
    model = model_from_text("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2] x) => (float[2] y) {
      [square] sq = Mul(x, x)
      [minus] y = Sub(sq, x)
    }""")
    samples = [{"x": np.array([1.0001, 300.0], np.float32)}]
    result = compare_emulated(model, load_profile("generic").resolve(), samples, isolate=True)
    sq, y = result.tensor("sq"), result.tensor("y")
    assert sq.inf_count == 1 and not sq and not y
    assert y.isolated_rel_l2 is not None and math.isinf(y.isolated_max_abs_error)
    assert result.first_divergent.node == "square"


def test_isolation_feeds_rounded_reference_inputs_so_cancellation_shows_where_it_happens():
    # x -> Mul(x, one) -> a (1.0001, stored as 1.0 in FP16) -> Sub(a, one) -> b (1e-4 vs 0)
    model = model_from_text("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1] x) => (float[1] b) <float one = {1.0}> {
      [copy] a = Mul(x, one)
      [cancel] b = Sub(a, one)
    }""")
    # The input is rounded too, so feed a value FP16 holds exactly and let Mul make 1.0001.
    model.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(np.array(1.0001, np.float32), "one"))
    model.graph.node[1].input[1] = "unit"
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1.0, np.float32), "unit"))
    result = compare_emulated(model, load_profile("generic").resolve(), [{"x": np.array([1.0], np.float32)}],
                              isolate=True, rtol=1e-2, atol=1e-6)
    a, b = result.tensor("a"), result.tensor("b")
    assert a.isolated_rel_l2 == pytest.approx(a.rel_l2) and a.rel_l2 < 1e-3
    # The Sub's own error is the whole error: it cancels the rounding of its input.
    assert b.isolated_rel_l2 == pytest.approx(1.0, rel=1e-2) and result.first_divergent.node == "cancel"


def test_tensor_scales_map_a_rescaled_candidate_back():
    ref = chain()
    # The candidate computes a and b four times larger and undoes it at y.
    cand = chain(w_a=8.0, w_b=0.125)
    cand.graph.initializer[1].CopyFrom(onnx.numpy_helper.from_array(np.array(4.0, np.float32), "one"))
    plain = compare_models(ref, cand, SAMPLES, rtol=1e-3, atol=1e-6)
    assert not plain and plain.first_divergent.tensor == "a" and plain.tensor("y")
    scaled = compare_models(ref, cand, SAMPLES, rtol=1e-3, atol=1e-6, tensor_scales={"a": 4, "b": 4})
    assert scaled and scaled.tensor("a").max_abs_error == 0 and scaled.tensor("a").scale == 4.0
    isolated = compare_models(ref, cand, SAMPLES, rtol=1e-3, atol=1e-6,
                              tensor_scales={"a": 4, "b": 4}, isolate=True)
    assert isolated and isolated.tensor("y").isolated_max_abs_error == 0
    with pytest.raises(NpuprepError, match="'ghost'"):
        compare_models(ref, cand, SAMPLES, rtol=1, atol=1, tensor_scales={"ghost": 2.0})
    with pytest.raises(NpuprepError, match="positive"):
        compare_models(ref, cand, SAMPLES, rtol=1, atol=1, tensor_scales={"a": -2.0})


def first_overflowing_node(model: onnx.ModelProto, samples: list[dict]) -> str:
    """Independently: the first node (file order is topological here) whose FP32 output passes 65520."""
    order = [(n.name, o) for n in model.graph.node for o in n.output]
    peaks: dict[str, float] = {}
    for s in samples:
        for k, v in all_values(model, s).items():
            peaks[k] = max(peaks.get(k, 0.0), float(np.abs(v).max()))
    return next(node for node, out in order if peaks.get(out, 0) >= FP16.overflow_threshold)


@pytest.fixture(scope="module")
def planner():
    return build_planner(), planner_samples(4)


def test_planner_generic_shows_inf_at_the_node_that_overflows(planner):
    model, samples = planner
    result = compare_emulated(model, load_profile("generic").resolve(), samples)
    expected = first_overflowing_node(model, samples)
    first = result.first_divergent
    assert not result and first.node == expected
    assert first.inf_count > 0 and math.isinf(first.cand_absmax) and first.headroom == 0
    assert first.ref_absmax >= FP16.overflow_threshold
    assert all(t for t in result.tensors if t.order < first.order)


def saturating_profile(tmp_path: Path, precision: str = "fp16", fp8_saturate: str = "false") -> Path:
    path = tmp_path / f"sat_{precision}_{fp8_saturate}.yaml"
    path.write_text(
        f"name: sat_{precision}\ndescription: test target\n"
        f"dtypes: {{fast: [{precision}], supported: [fp32]}}\n"
        f"default_precision: {precision}\noverflow: saturate\nfp8_saturate: {fp8_saturate}\n"
        "fp32_pinning: per_node\n", encoding="utf-8")
    return path


def test_planner_saturating_profile_pins_at_max_and_still_names_the_node(planner, tmp_path):
    model, samples = planner
    result = compare_emulated(model, load_profile(saturating_profile(tmp_path)).resolve(), samples)
    first = result.first_divergent
    assert first.node == first_overflowing_node(model, samples)
    assert first.inf_count == 0 and first.nan_count == 0
    assert first.cand_absmax == FP16.max and first.saturated_count > 0
    assert "pinned at +-65504" in first.reason
    assert any("saturates" in n for n in result.notes)


def test_pinning_the_overflowing_node_moves_the_first_divergence(planner):
    model, samples = planner
    profile = load_profile("generic")
    first = compare_emulated(model, profile.resolve(), samples).first_divergent
    pinned = compare_emulated(model, profile.resolve(), samples, pinned_nodes=[first.node])
    assert pinned.tensor(first.tensor).inf_count == 0
    assert pinned.first_divergent is None or pinned.first_divergent.order > first.order


def _square_model(opset: int) -> onnx.ModelProto:
    # x -> Mul(x, x) -> sq -> Add(sq, 1) -> y
    return model_from_text(f"""
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[4] x) => (float[4] y) <float one = {{1.0}}> {{
      [square] sq = Mul(x, x)
      [inc] y = Add(sq, one)
    }}""")


def test_fp8_gives_nan_without_saturation_and_448_with_it(tmp_path):
    samples = [{"x": np.array([1.0, 2.0, 30.0, 4.0], np.float32)}]
    loud = compare_emulated(_square_model(17), load_profile(saturating_profile(tmp_path, "fp8_e4m3", "false")).resolve(),
                            samples)
    assert loud.first_divergent.node == "square" and loud.first_divergent.nan_count == 1
    once = compare_emulated(_square_model(17), load_profile(saturating_profile(tmp_path, "fp8_e4m3", "false")).resolve(),
                            iter(samples))
    assert once.first_divergent.nan_count == 1 and once.samples == 1
    assert any("declares opset 17" in n for n in loud.notes)
    quiet = compare_emulated(_square_model(19), load_profile(saturating_profile(tmp_path, "fp8_e4m3", "true")).resolve(),
                             samples)
    sq = quiet.tensor("sq")
    assert quiet.first_divergent.node == "square"
    assert sq.nan_count == 0 and sq.cand_absmax == 448.0 and sq.saturated_count == 1


def test_unknown_overflow_says_inf_was_assumed_and_to_probe():
    result = compare_emulated(_square_model(17), load_profile("a2000").resolve(),
                              [{"x": np.array([1.0, 2.0, 3.0, 4.0], np.float32)}])
    assert result
    assert any("unknown" in n and "Inf was assumed" in n and "probe" in n for n in result.notes)
    assert any("accumulation" in n for n in result.notes)


def test_real_fp16_candidate_is_compared_through_casts():
    from onnxconverter_common import float16

    ref = _square_model(17)
    cand = float16.convert_float_to_float16(ref, keep_io_types=True)
    samples = [{"x": np.array([1.0001, 2.0, 3.0, 4.0], np.float32)}]
    assert any(vi.type.tensor_type.elem_type == TensorProto.FLOAT16 for vi in cand.graph.value_info)
    result = compare_models(ref, cand, samples, rtol=1e-2, atol=1e-3, fmt=FP16)
    # onnxruntime's CPU provider may compute this FP16 Mul in FP32 (the trap emulation avoids),
    # so the error is at most FP16 rounding, possibly zero.
    assert result and result.tensor("sq").max_abs_error < 1e-3
    # FP16 inputs too: the merged graph casts the shared FP32 input for the candidate.
    cand16 = float16.convert_float_to_float16(ref, keep_io_types=False)
    assert cand16.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    isolated = compare_models(ref, cand16, samples, rtol=1e-2, atol=1e-3, fmt=FP16, isolate=True)
    assert isolated and isolated.tensor("sq").isolated_max_abs_error < 1e-3
    assert result.tensor("sq").headroom == pytest.approx(FP16.max / 16)


def test_different_opsets_are_brought_together():
    result = compare_models(_square_model(17), _square_model(19),
                            [{"x": np.ones(4, np.float32)}], rtol=1e-3, atol=1e-6)
    assert result and len(result.tensors) == 2


def test_subgraph_tensors_and_unshared_tensors_are_reported_not_skipped_silently():
    # c ? (x -> Mul(x, x) -> t) : (x -> Add(x, x) -> e) -> y -> Div(y, 16) -> z
    then_g = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])])
    else_g = helper.make_graph([helper.make_node("Add", ["x", "x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])])
    nodes = [helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then_g, else_branch=else_g),
             helper.make_node("Div", ["y", "sixteen"], ["z"], name="shrink")]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                                       helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])],
                          [onnx.numpy_helper.from_array(np.array(16.0, np.float32), "sixteen")]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    samples = [{"x": np.array([300.0, 1.0], np.float32), "c": np.array(True)}]
    result = compare_emulated(model, load_profile("generic").resolve(), samples, isolate=True)
    assert {t.tensor for t in result.tensors} == {"y", "z"}
    assert result.first_divergent.node == "branch"
    assert "inside main/branch.then_branch" in result.unobserved["t"]
    # Isolated, the If (its body included) overflows on its own; the Div, fed y = 90000
    # exactly (beyond FP16, so not rounded), brings it back in range: only its own output
    # rounding remains (5625 is stored as 5624), while the accumulated error is Inf.
    assert math.isinf(result.tensor("y").isolated_max_abs_error)
    z = result.tensor("z")
    assert math.isinf(z.max_abs_error) and z.isolated_max_abs_error == 1.0 and z.isolated_rel_l2 < 1e-3


def test_mismatched_inputs_are_a_user_error():
    other = model_from_text("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[3] u) => (float[3] y) { y = Relu(u) }""")
    with pytest.raises(NpuprepError, match="input 'u' exists only in the candidate"):
        compare_models(chain(), other, SAMPLES, rtol=1, atol=1)


def test_result_json_carries_schema_kind_and_first_divergent(planner):
    model, samples = planner
    result = compare_emulated(model, load_profile("generic").resolve(), samples[:2], worst=3)
    data = json.loads(dump_json(result))
    assert data["schema_version"] == 1 and data["kind"] == "compare"
    assert data["fingerprint"] == result.fingerprint and len(data["fingerprint"]) == 16
    assert data["passed"] is False
    assert set(data["first_divergent"]) >= {"node", "op_type", "tensor", "max_abs_error", "rel_l2",
                                            "cosine", "headroom", "inf_count", "saturated_count"}
    assert data["first_divergent"]["max_abs_error"] == "inf"
    assert len(data["worst"]) == 3 and len(data["tensors"]) == len(result.tensors)
    assert dump_json(result) == dump_json(compare_emulated(model, load_profile("generic").resolve(), samples[:2],
                                                           worst=3))


def test_layout_ops_carry_their_inputs_numbers_without_a_second_reduction():
    # x -> Mul(w) -> a -> Reshape -> r -> Transpose -> t -> Add(1) -> y
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 3] x) => (float[3, 2] y)
      <float w = {{{w}}}, float one = {{1.0}}, int64[2] shape = {{2, 3}}> {{
      [scale] a = Mul(x, w)
      [flat] r = Reshape(a, shape)
      [swap] t = Transpose <perm = [1, 0]> (r)
      [shift] y = Add(t, one)
    }}"""
    ref, cand = model_from_text(text.format(w=2.0)), model_from_text(text.format(w=2.2))
    samples = [{"x": np.arange(6, dtype=np.float32).reshape(2, 3) - 2}]
    result = compare_models(ref, cand, samples, rtol=1e-3, atol=1e-6, isolate=True)
    a, r, t = result.tensor("a"), result.tensor("r"), result.tensor("t")
    assert [x.tensor for x in result.tensors] == ["a", "r", "t", "y"]
    assert (r.node, r.op_type, t.node, t.op_type) == ("flat", "Reshape", "swap", "Transpose")
    for x in (r, t):
        assert (x.max_abs_error, x.rel_l2, x.cand_absmax, x.passed) == (a.max_abs_error, a.rel_l2,
                                                                         a.cand_absmax, a.passed)
        assert x.isolated_rel_l2 == 0.0
    assert a.isolated_rel_l2 > 0.05
    # With its own threshold, a layout tensor is reduced on its own and judged by it.
    own = compare_models(ref, cand, samples, rtol=1e-3, atol=1e-6, overrides={"t": (0.5, 1e-6)})
    assert own.tensor("t") and not own.tensor("r")
    assert own.tensor("t").rel_l2 == pytest.approx(a.rel_l2, rel=1e-5)


def test_a_candidate_sharing_the_references_weights_compares_as_one_with_its_own_copies():
    # The bundled planner, emulated in FP16 with rounded weight copies and with weights rounded
    # in the graph (the reference's initialisers then serve both sides of the merged graph).
    from npuprep.verify.compare_graph import merged_graph
    from npuprep.verify.emulate import emulate

    model, fp16 = build_planner(), get_format("fp16")
    samples = planner_samples(3)
    copies = emulate(model, fp16, saturate=False).model
    in_graph = emulate(model, fp16, saturate=False, weights_in_graph=True).model
    a = compare_models(model, copies, samples, rtol=1e-2, atol=1e-3, fmt=fp16)
    b = compare_models(model, in_graph, samples, rtol=1e-2, atol=1e-3, fmt=fp16)
    assert [(t.tensor, t.max_abs_error, t.rel_l2, t.inf_count) for t in a.tensors] == \
        [(t.tensor, t.max_abs_error, t.rel_l2, t.inf_count) for t in b.tensors]
    assert (a.first_divergent.node if a.first_divergent else None) == \
        (b.first_divergent.node if b.first_divergent else None)
    merged, _ = merged_graph(model, in_graph, [], limit=fp16.max, isolate=False)
    weights = [i for i in model.graph.initializer if i.ByteSize() > 1024]
    assert weights and sum(1 for i in merged.graph.initializer if i.ByteSize() > 1024) == len(weights)
