"""Constraint exporters: TensorRT flags, per-node precision YAML, Horizon and RKNN dialects."""

from __future__ import annotations

import shlex

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper, numpy_helper

from npuprep.model_io import Model, fingerprint
from npuprep.plan import Clamp, FindingRef, PinFp32, Plan
from npuprep.report.constraints import (
    TRT11_NOTE,
    horizon_node_info,
    precision_yaml,
    rknn_custom_quantize_layers,
    trt_flags,
    trt_text,
)


def build() -> Model:
    # x -> MatMul[enc/mm] -> h -> Exp["blk:0 exp"] -> e -> Div[div,0](e, s) -> y
    #                                   e -> ReduceSum[(unnamed)] -> s ; Shape[shape] -> n
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")
    ax = numpy_helper.from_array(np.array([1], dtype=np.int64), "ax")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="enc/mm"),
        helper.make_node("Exp", ["h"], ["e"], name="blk:0 exp"),
        helper.make_node("ReduceSum", ["e", "ax"], ["s"], keepdims=1),
        helper.make_node("Div", ["e", "s"], ["y"], name="div,0"),
        helper.make_node("Shape", ["y"], ["n"], name="shape"),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("n", TensorProto.INT64, [2])],
        [w, ax],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(proto)
    return Model(proto, "m.onnx", fingerprint(proto))


def plan_for(model: Model, *, request: bool = False, forbid: tuple[str, ...] = ()) -> Plan:
    ref = FindingRef("range.overflow", "blk:0 exp", "e")
    return Plan(
        fingerprint=model.fingerprint, target="orin", precision="fp16",
        actions=(
            Clamp("h", None, 10.397, "exp", ("blk:0 exp",)),
            PinFp32(("div,0", "node_of_s", "blk:0 exp", "shape"), ("y",), (ref,), request=request),
        ),
        forbid_pin=forbid,
    )


def test_trt_flags_are_exact_and_quote_special_names():
    model = build()
    flags = trt_flags(plan_for(model), model)
    # Topological order; ':' and ' ' quoted for trtexec; ',' cannot be carried; Shape is
    # not a float layer.
    assert flags.layer_precisions == "--layerPrecisions='blk:0 exp':fp32,node_of_s:fp32"
    assert flags.layer_output_types == "--layerOutputTypes='blk:0 exp':fp32,node_of_s:fp32"
    assert flags.args == (
        "--fp16", "--precisionConstraints=obey", flags.layer_precisions, flags.layer_output_types,
    )
    assert flags.skipped == (("div,0", "trtexec splits layer lists on ',' and strips quotes"),)
    assert flags.notes[-1] == TRT11_NOTE
    line = flags.command_line("out dir/m.onnx")
    assert shlex.split(line) == ["trtexec", "--onnx=out dir/m.onnx", *flags.args]


def test_trt_flags_without_pins_only_set_the_precision():
    model = build()
    plan = Plan(fingerprint=model.fingerprint, target="orin", precision="fp16")
    flags = trt_flags(plan, model)
    assert flags.args == ("--fp16",)
    assert flags.layer_precisions == ""


def test_forbidden_nodes_leave_the_constraints():
    model = build()
    flags = trt_flags(plan_for(model, forbid=("node_of_s",)), model)
    assert flags.layer_precisions == "--layerPrecisions='blk:0 exp':fp32"


def test_precision_yaml_lists_every_float_node_with_reason():
    model = build()
    text = precision_yaml(plan_for(model, request=True), model)
    data = yaml.safe_load(text)
    assert (data["kind"], data["default"], data["fingerprint"]) == ("precision", "fp16", model.fingerprint)
    rows = {r["node"]: r for r in data["nodes"]}
    assert list(rows) == ["enc/mm", "blk:0 exp", "node_of_s", "div,0"]
    assert rows["enc/mm"]["precision"] == "fp16"
    assert rows["enc/mm"]["reason"] == "target default"
    assert rows["blk:0 exp"]["precision"] == "fp32"
    assert rows["blk:0 exp"]["reason"] == "requested FP32: range.overflow at e"
    assert rows["blk:0 exp"]["request"] is True
    assert "request" not in rows["enc/mm"]


def test_horizon_and_rknn_dialects():
    model = build()
    text = horizon_node_info(plan_for(model), model)
    data = yaml.safe_load(text)
    assert data["node_info"] == {
        "blk:0 exp": {"ON": "CPU"}, "node_of_s": {"ON": "CPU"}, "div,0": {"ON": "CPU"},
    }
    assert data["node_config"]["div,0"] == {"qtype": "float32"}
    rknn = yaml.safe_load(rknn_custom_quantize_layers(plan_for(model), model))
    assert rknn["custom_quantize_layers"] == {"e": "float16", "s": "float16", "y": "float16"}



def test_rewrite_boundaries_join_the_pins_and_the_trtexec_script_says_what_it_cannot_carry(tmp_path):
    model = build()
    plan = plan_for(model)
    flags = trt_flags(plan, model, also_pinned=("enc/mm",))
    assert flags.layer_precisions == "--layerPrecisions=enc/mm:fp32,'blk:0 exp':fp32,node_of_s:fp32"
    rows = {r["node"]: r for r in yaml.safe_load(precision_yaml(plan, model, also_pinned=("enc/mm",)))["nodes"]}
    assert rows["enc/mm"]["reason"] == "FP32 boundary of a rewrite (rescale exit)"
    script = trt_text(trt_flags(plan, model), "m.orin.onnx").splitlines()
    assert script[-1] == trt_flags(plan, model).command_line("m.orin.onnx")
    assert "# not expressible: div,0 (trtexec splits layer lists on ',' and strips quotes)" in script
    # Same plan, same bytes.
    assert precision_yaml(plan, model) == precision_yaml(plan_for(model), model)


def test_precision_yaml_of_a_lowered_model_reads_its_stored_types():
    from npuprep.rewrite.lower import lower

    model = build()
    plan = plan_for(model)
    lowered_proto = lower(model.proto, "fp16", pinned_nodes=plan.pinned_nodes()).model
    lowered = Model(lowered_proto, "low.onnx", fingerprint(lowered_proto))
    data = yaml.safe_load(precision_yaml(plan, lowered))
    assert (data["fingerprint"], data["plan_fingerprint"]) == (lowered.fingerprint, model.fingerprint)
    rows = {r["node"]: r for r in data["nodes"]}
    assert (rows["enc/mm"]["precision"], rows["enc/mm"]["reason"]) == ("fp16", "as lowered")
    assert rows["blk:0 exp"]["precision"] == "fp32"
    # The Casts lowering put at the island border are listed with the type they store.
    casts = [r for r in data["nodes"] if r["op_type"] == "Cast"]
    assert casts and {r["precision"] for r in casts} <= {"fp16", "fp32"}
    assert any(r["precision"] == "fp32" for r in casts)


def test_a_pin_without_findings_gives_its_own_reason_not_user():
    # enc/mm pinned by a verification round: precision.yaml says so, not "user".
    from npuprep.plan import PinFp32
    from npuprep.report.constraints import _pin_reason

    pin = PinFp32(nodes=("enc/mm",), why="verification round 1: first divergent node enc/mm")
    assert _pin_reason(pin) == "pinned FP32: verification round 1: first divergent node enc/mm"
    assert _pin_reason(PinFp32(nodes=("enc/mm",), forced=True)) == "forced FP32: user"
