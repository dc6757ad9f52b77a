"""Removing If nodes for targets without control flow: splice a constant branch, else Where."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from rewrite_util import build, outputs

from npuprep.errors import NpuprepError
from npuprep.profiles import ControlFlow, load_profile, parse_profile
from npuprep.rewrite.control_flow import constant_condition, inline_if, remove_control_flow

HEAD = '<ir_version: 8, opset_import: ["" : 17]>'
X = np.array([[1.0, -2.0, 3.0], [0.5, 4.0, -1.5]], np.float32)


def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict) -> None:
    ref, got = outputs(before, feeds), outputs(after, feeds)
    assert ref.keys() == got.keys()
    for name in ref:
        assert ref[name].shape == got[name].shape
        np.testing.assert_array_equal(got[name], ref[name])


# x -> Relu -> h ; If(c): then Add(Mul(h, h), x) ; else Neg(h) -> y
SELECT = HEAD + """
g (float[2,3] x, bool c) => (float[2,3] y) {
  h = Relu(x)
  y = If(c) <
    then_branch = t () => (float[2,3] t_out) { sq = Mul(h, h)  t_out = Add(sq, x) },
    else_branch = e () => (float[2,3] e_out) { e_out = Neg(h) }
  >
}
"""


def test_a_runtime_condition_becomes_where_and_both_values_agree():
    model = build(SELECT)
    result = remove_control_flow(model)
    assert result and "Where(c, then, else)" in result.reason
    assert "If" not in ops(result.model) and ops(result.model).count("Where") == 1
    # Branch tensors keep their names: statistics and comparisons by name still find them.
    names = {o for n in result.model.graph.node for o in n.output}
    assert {"sq", "t_out", "e_out", "y"} <= names
    for flag in (True, False):
        same_outputs(model, result.model, {"x": X, "c": np.array(flag)})


# x (scalar), c of shape [1] ; If(c): then Exp(x) ; else Neg(x) -> y (scalar)
def test_a_condition_of_rank_1_is_made_scalar_so_where_keeps_the_output_rank():
    text = HEAD + """
    g (float x, bool[1] c) => (float y) {
      y = If(c) < then_branch = t () => (float a) { a = Exp(x) },
                  else_branch = e () => (float b) { b = Neg(x) } >
    }
    """
    model = build(text)
    result = remove_control_flow(model)
    assert ops(result.model) == ["Exp", "Neg", "Reshape", "Where"]
    for flag in (True, False):
        same_outputs(model, result.model, {"x": np.array(1.5, np.float32), "c": np.array([flag])})
    # A scalar condition needs no Reshape (rknn-toolkit2 cannot fold one to rank 0).
    assert "Reshape" not in ops(remove_control_flow(build(SELECT)).model)


# x ; If(c): then Mul(x, x) (Inf for x = 1e20) ; else Neg(x) -> y
def test_the_branch_not_taken_may_overflow_without_reaching_the_output():
    text = HEAD + """
    g (float[3] x, bool c) => (float[3] y) {
      y = If(c) < then_branch = t () => (float[3] a) { a = Mul(x, x) },
                  else_branch = e () => (float[3] b) { b = Neg(x) } >
    }
    """
    model = build(text)
    result = remove_control_flow(model)
    x = np.array([1e20, -3.0, 2.0], np.float32)
    got = outputs(result.model, {"x": x, "c": np.array(False)})["y"]
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, -x)
    assert np.isinf(outputs(result.model, {"x": x, "c": np.array(True)})["y"][0])


# x ; If(<true>): then Sigmoid(x) ; else Neg(x) -> y   (the condition is an initialiser)
def test_a_constant_condition_splices_the_taken_branch_only():
    text = HEAD + """
    g (float[2,3] x) => (float[2,3] y) <bool k = {1}> {
      y = If(k) < then_branch = t () => (float[2,3] a) { a = Sigmoid(x) },
                  else_branch = e () => (float[2,3] b) { b = Neg(x) } >
    }
    """
    model = build(text)
    result = inline_if(model, "node_of_y")
    assert result and "always True: then_branch spliced" in result.reason
    assert ops(result.model) == ["Sigmoid"]
    assert result.model.graph.node[0].output[0] == "y"
    same_outputs(model, result.model, {"x": X})


# x ; c = Equal(Gather(Shape(x), 0), 2) ; If(c): then <w> + x ; else x (an outer tensor) -> y
def test_a_condition_from_static_shapes_is_constant_and_a_passthrough_gets_an_identity():
    text = HEAD + """
    g (float[2,3] x) => (float[2,3] y) <int64 zero = {0}, int64 two = {2}> {
      s = Shape(x)
      n = Gather(s, zero)
      c = Equal(n, two)
      y = If(c) < then_branch = t () => (float[2,3] a) <float w = {0.5}> { a = Add(x, w) },
                  else_branch = e () => (float[2,3] x2) { x2 = Identity(x) } >
    }
    """
    model = build(text)
    assert constant_condition(model, "c") is True
    result = remove_control_flow(model)
    assert result and "always True" in result.reason
    assert "If" not in ops(result.model) and "w" in {i.name for i in result.model.graph.initializer}
    same_outputs(model, result.model, {"x": X})
    # The else branch returns the outer x itself: spliced, it needs an Identity to write y.
    text_else = text.replace("Equal(n, two)", "Equal(n, zero)")
    model = build(text_else)
    result = remove_control_flow(model)
    assert constant_condition(model, "c") is False and result
    assert ops(result.model)[-1] == "Identity" and result.model.graph.node[-1].input[0] == "x"
    same_outputs(model, result.model, {"x": X})


# x ; If(c): then t = Relu(x), Mul(t, t) ; else t = Neg(x), Add(t, t) -> y  (both define t)
def test_names_both_branches_define_are_renamed_apart():
    text = HEAD + """
    g (float[2,3] x, bool c) => (float[2,3] y) {
      y = If(c) < then_branch = g1 () => (float[2,3] a) { t = Relu(x)  a = Mul(t, t) },
                  else_branch = g2 () => (float[2,3] b) { t = Neg(x)  b = Add(t, t) } >
    }
    """
    model = build(text)
    result = remove_control_flow(model)
    names = [o for n in result.model.graph.node for o in n.output]
    assert len(names) == len(set(names)) and "t" in names and "node_of_y.else.t" in names
    for flag in (True, False):
        same_outputs(model, result.model, {"x": X, "c": np.array(flag)})


# x ; If(<true>): then [If(c): then Relu(x) ; else Neg(x)] ; else x -> y  (nested If)
def test_a_nested_if_goes_once_its_parent_is_spliced():
    inner = helper.make_node("If", ["c"], ["a"], name="inner", then_branch=helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"])], "it", [],
        [helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, [2, 3])]),
        else_branch=helper.make_graph(
        [helper.make_node("Neg", ["x"], ["n"])], "ie", [],
        [helper.make_tensor_value_info("n", onnx.TensorProto.FLOAT, [2, 3])]))
    outer_then = helper.make_graph([inner], "ot", [],
                                   [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [2, 3])])
    outer_else = helper.make_graph([helper.make_node("Identity", ["x"], ["b"])], "oe", [],
                                   [helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [2, 3])])
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["k"], value=helper.make_tensor("k", onnx.TensorProto.BOOL, [], [True])),
         helper.make_node("If", ["k"], ["y"], name="outer", then_branch=outer_then, else_branch=outer_else)],
        "nested", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3]),
                   helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    result = remove_control_flow(model)
    assert set(result.details["replaced"]) == {"outer", "inner"}
    assert "If" not in ops(result.model)
    for flag in (True, False):
        same_outputs(model, result.model, {"x": X, "c": np.array(flag)})


# x ; If(c): then Relu(x) [2,3] ; else ReduceSum(x) [1,1] -> y
def test_branch_outputs_of_different_shapes_are_declined():
    text = HEAD + """
    g (float[2,3] x, bool c) => (float[?, ?] y) {
      y = If(c) < then_branch = t () => (float[2,3] a) { a = Relu(x) },
                  else_branch = e () => (float[1,1] b) { b = ReduceSum(x) } >
    }
    """
    model = build(text)
    result = remove_control_flow(model)
    assert not result and result.model is model
    assert "different shapes" in result.reason and "[2, 3]" in result.reason
    assert result.details["declined"] == {"node_of_y": result.reason.split(": ", 1)[1]}


# x ; If(c): then RandomUniformLike(x) + x ; else x -> y
def test_a_branch_with_side_effects_is_declined():
    text = HEAD + """
    g (float[2,3] x, bool c) => (float[2,3] y) {
      y = If(c) < then_branch = t () => (float[2,3] a) { r = RandomUniformLike(x)  a = Add(r, x) },
                  else_branch = e () => (float[2,3] b) { b = Neg(x) } >
    }
    """
    result = inline_if(build(text), "node_of_y")
    assert not result and "side effects (RandomUniformLike" in result.reason


# x ; Loop(3) { x2 = Add(acc, acc) } -> y : left alone with its reason
def test_a_loop_is_left_with_a_reason():
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["acc", "acc"], ["acc2"])], "body",
        [helper.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc", onnx.TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc2", onnx.TensorProto.FLOAT, [2, 3])])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["n", "", "x"], ["y"], name="loop", body=body)], "looped",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
        [onnx.numpy_helper.from_array(np.array(3, np.int64), "n")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = remove_control_flow(model)
    assert not result and result.model is model
    assert "Loop is left" in result.details["declined"]["loop"]


def test_the_profile_key_is_validated_and_rk3588_takes_no_control_flow(tmp_path):
    assert load_profile("rk3588").control_flow is ControlFlow.NONE
    assert load_profile("generic").control_flow is ControlFlow.SUPPORTED
    data = load_profile("generic").to_dict() | {"control_flow": "unroll"}
    with pytest.raises(NpuprepError, match=r"my\.yaml: key 'control_flow': 'unroll' is not one of"):
        parse_profile(data, "my.yaml")


def _zoo(tmp_path, name: str):
    from npuprep.data import load_samples
    from npuprep.examples.zoo import ZOO
    from npuprep.model_io import load_model

    zoo = ZOO[name]()
    onnx.save(zoo.model, str(tmp_path / "m.onnx"))
    (tmp_path / "d").mkdir()
    for i, s in enumerate(zoo.samples):
        np.savez(tmp_path / "d" / f"s{i}.npz", **s)
    model = load_model(tmp_path / "m.onnx")
    return model, load_samples(tmp_path / "d", model.proto)


# x -> Gemm -> h ; If(flag): then sqrt(mean(h*h)) (overflows) ; else mean(h) -> y
def test_convert_for_rk3588_removes_the_if_and_rescales_the_square_it_held(tmp_path):
    from npuprep.calibrate import calibrate
    from npuprep.convert import convert
    from npuprep.plan.actions import Rescale

    model, samples = _zoo(tmp_path, "if_body_hazard")
    stats = calibrate(model, samples)
    assert not stats.tensors["e_out"].count  # the samples never take the else branch
    result = convert(model, load_profile("rk3588"), list(samples), stats=stats)
    assert "If" not in ops(result.lowered.model) and "Where" in ops(result.lowered.model)
    [rescale] = result.plan.rescales()
    assert isinstance(rescale, Rescale) and rescale.entry == "proj" and "h_sq" in rescale.domain
    replaced = "If node 'branch' replaced before planning, rk3588 takes no control flow"
    assert any(n.startswith(replaced) for n in result.plan.notes)
    assert any(n.startswith(replaced) for n in result.notes)
    assert any("never computed on these samples (a branch not taken, a fused op's own: e_out)" in n
               for n in result.notes)
    y = result.output_check.outputs["y"]
    assert result.passed and y["nonfinite"] == 0 and y["rel_l2"] < 1e-2
    assert result.source is model  # the report still names the user's model
    # A target that takes control flow keeps the If.
    kept = convert(model, load_profile("generic"), list(samples), stats=stats)
    assert "If" in ops(kept.rewritten)


def test_check_plans_on_the_graph_convert_plans(tmp_path):
    import json

    from conftest import run_cli

    model, _ = _zoo(tmp_path, "if_body_hazard")
    r = run_cli("check", model.path, "--target", "rk3588", "--data", str(tmp_path / "d"), "--json")
    assert r.returncode in (0, 1), r.stderr
    plan = json.loads(r.stdout)["plan"]
    assert [(a["action"], a["entry"]) for a in plan["actions"]] == [("rescale", "proj")]
    assert any(n.startswith("If node 'branch' replaced before planning") for n in plan["notes"])


# x (~20) ; If(c): then Exp(x) (Inf in FP16) ; else Neg(x) -> y ; the samples never take then
def test_on_rk3588_an_overflow_in_the_branch_not_taken_does_not_fail_verification(tmp_path):
    from npuprep.calibrate import calibrate
    from npuprep.convert import convert
    from npuprep.data import load_samples
    from npuprep.model_io import load_model

    text = HEAD + """
    g (float[4] x, bool c) => (float[4] y) {
      y = If(c) < then_branch = t () => (float[4] a) { a = Exp(x) },
                  else_branch = e () => (float[4] b) { b = Neg(x) } >
    }
    """
    onnx.save(build(text), str(tmp_path / "m.onnx"))
    (tmp_path / "d").mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        np.savez(tmp_path / "d" / f"s{i}.npz", x=(rng.standard_normal(4) + 20).astype(np.float32),
                 c=np.array(False))
    model = load_model(tmp_path / "m.onnx")
    samples = load_samples(tmp_path / "d", model.proto)
    result = convert(model, load_profile("rk3588"), list(samples), stats=calibrate(model, samples))
    assert result.stats.tensors["a"].absmax > 65504  # Exp(20) computed, now every time
    [a] = [t for t in result.layers.tensors if t.tensor == "a"]
    assert a.inf_count > 0  # emulated FP16 gives Inf there; Where does not select it
    y = result.output_check.outputs["y"]
    assert result.passed and y["nonfinite"] == 0 and y["rel_l2"] < 1e-2
