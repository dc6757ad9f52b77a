"""An additive -inf mask stored in FP16 (a model already FP16, or an FP16 Constant Cast up in an
FP32 graph) is lowered to -65504 as an FP32 mask is, so convert verifies it as it does the FP32
case; an FP16 -inf that is no mask (a Mul reads it) is left alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from rewrite_util import outputs, rel_err

from npuprep.numerics import get_format
from npuprep.rewrite.lower import lower
from tests.conftest import run_cli

MASK = np.array([[0, -np.inf, 0, -np.inf]], np.float16)
FP16_MAX = get_format("fp16").max


def masked(elem: int, *, cast_up: bool, reader: str = "Add", initialiser: bool = False) -> onnx.ModelProto:
    """Constant(mask, FP16) [-> Cast(elem)] -> reader(x, mask) = s -> Softmax -> y; s and y
    are both outputs (the masked scores returned as they are). `initialiser`: the mask is one."""
    inits = [numpy_helper.from_array(MASK, "m16")] if initialiser else []
    nodes = [] if initialiser else [
        helper.make_node("Constant", [], ["m16"], value=numpy_helper.from_array(MASK, "m16"))]
    if cast_up:
        nodes.append(helper.make_node("Cast", ["m16"], ["m"], to=elem))
    nodes += [helper.make_node(reader, ["x", "m" if cast_up else "m16"], ["s"], name="masked"),
              helper.make_node("Softmax", ["s"], ["y"], name="probs")]
    graph = helper.make_graph(nodes, "masked", [helper.make_tensor_value_info("x", elem, [1, 4])],
                              [helper.make_tensor_value_info(o, elem, [1, 4]) for o in ("s", "y")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _constant(model: onnx.ModelProto, name: str) -> np.ndarray:
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    node = next(n for n in model.graph.node if n.op_type == "Constant" and n.output[0] == name)
    return numpy_helper.to_array(node.attribute[0].t)


@pytest.mark.parametrize("initialiser", [False, True], ids=["constant", "initialiser"])
@pytest.mark.parametrize("elem, cast_up", [(TensorProto.FLOAT16, False), (TensorProto.FLOAT, True)],
                         ids=["fp16_model", "fp16_mask_cast_up"])
def test_an_fp16_minus_inf_mask_becomes_minus_max(elem: int, cast_up: bool, initialiser: bool) -> None:
    lowered = lower(masked(elem, cast_up=cast_up, initialiser=initialiser), "fp16")
    assert lowered.mapped_masks == {"m16": 2}
    low = _constant(lowered.model, "m16")
    assert low.dtype == np.float16 and list(low[0]) == [0, -FP16_MAX, 0, -FP16_MAX]


def test_the_lowered_fp16_mask_gives_the_fp32_softmax() -> None:
    # Judged in the FP32 graph (the FP16 mask Cast up): the masked positions stay 0 in y and
    # the others match the source; s is finite where the source has -inf.
    model = masked(TensorProto.FLOAT, cast_up=True)
    lowered = lower(model, "fp16")
    feeds = {"x": np.random.default_rng(0).normal(size=(1, 4)).astype(np.float32)}
    ref, out = outputs(model, feeds), outputs(lowered.model, feeds)
    assert np.isneginf(ref["s"][0, 1::2]).all() and np.isfinite(out["s"]).all()
    assert (out["y"][0, 1::2] == 0).all() and rel_err(ref["y"], out["y"]) < 1e-3


def test_an_fp16_minus_inf_no_mask_reads_is_left_alone() -> None:
    # x * Constant(-inf) is a value, not a mask: lowering keeps it as the model wrote it.
    lowered = lower(masked(TensorProto.FLOAT16, cast_up=False, reader="Mul"), "fp16")
    assert not lowered.mapped_masks and np.isneginf(_constant(lowered.model, "m16")[0, 1::2]).all()


@pytest.mark.parametrize("elem, cast_up", [(TensorProto.FLOAT16, False), (TensorProto.FLOAT, True)],
                         ids=["fp16_model", "fp16_constant_cast_up"])
def test_convert_verifies_a_model_returning_fp16_masked_scores(tmp_path: Path, elem: int,
                                                               cast_up: bool) -> None:
    onnx.save(masked(elem, cast_up=cast_up), tmp_path / "m.onnx")
    done = run_cli("convert", "m.onnx", "-t", "a2000", "--synthetic", "4", "-o", "out.onnx",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "out.report.json").read_text())
    s = report["verification"]["outputs"]["s"]
    # The source's -inf positions are no error (as for an FP32 mask); the lowered s is finite.
    assert s["nonfinite"] == 0 and s["reference_nonfinite"] == 6


def test_a_minus_1e9_mask_is_lowered_to_minus_max_and_nothing_is_pinned() -> None:
    # q -> MatMul(W) -> Add(., neg) -> Softmax -> y; neg holds 0 or -1e9 (not -inf, beyond FP16)
    from npuprep.calibrate import calibrate
    from npuprep.convert import convert
    from npuprep.model_io import Model
    from npuprep.profiles import load_profile

    rng = np.random.default_rng(5)
    neg = np.where(rng.random((2, 8)) > 0.3, 0.0, -1e9).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["q", "W"], ["s"], name="scores"),
             helper.make_node("Add", ["s", "neg"], ["t"], name="masked"),
             helper.make_node("Softmax", ["t"], ["y"], name="probs")]
    graph = helper.make_graph(
        nodes, "masked", [helper.make_tensor_value_info("q", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [numpy_helper.from_array(rng.normal(size=(8, 8)).astype(np.float32), "W"),
         numpy_helper.from_array(neg, "neg")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = Model(proto=proto, path="masked.onnx", digest="masked")
    samples = [{"q": rng.normal(size=(2, 8)).astype(np.float32)} for _ in range(6)]
    stats = calibrate(model, samples)
    assert stats.tensors["t"].min < -FP16_MAX and np.isfinite(stats.tensors["t"].min)
    result = convert(model, load_profile("generic"), samples, stats=stats)
    assert result, result.to_dict()["verdict"]
    assert not result.pinned_nodes
    assert [f.rule for f in result.findings if f.tensor == "t"] == ["range.mask"]
    lowered = _constant(result.lowered.model, "neg")
    assert lowered.min() == -FP16_MAX and lowered.dtype == np.float16
    feeds = samples[0]
    assert rel_err(outputs(proto, feeds)["y"], outputs(result.lowered.model, feeds)["y"]) < 1e-2


@pytest.mark.parametrize("value", [-1e5, -1e9])
def test_a_scalar_minus_1e9_spread_by_a_mul_is_a_mask_too(value: float) -> None:
    # m (0/1) -> Sub(1, m) -> Mul(., -1e9) -> Add(scores, .) -> Softmax -> y: the Mul's -1e9
    # (or -1e5: beyond FP16 too) becomes -65504 (x {0, 1}: the same mask), nothing is pinned;
    # a -1e9 that scales data (no mask follows: Mul -> output) keeps its node FP32
    from npuprep.calibrate import calibrate
    from npuprep.convert import convert
    from npuprep.model_io import Model
    from npuprep.profiles import load_profile

    rng = np.random.default_rng(6)
    nodes = [helper.make_node("MatMul", ["q", "W"], ["s"], name="scores"),
             helper.make_node("Sub", ["one", "m"], ["inv"], name="invert"),
             helper.make_node("Mul", ["inv", "big"], ["add"], name="spread"),
             helper.make_node("Add", ["s", "add"], ["t"], name="masked"),
             helper.make_node("Softmax", ["t"], ["y"], name="probs")]
    graph = helper.make_graph(
        nodes, "masked", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 8]) for n in "qm"],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [numpy_helper.from_array(rng.normal(size=(8, 8)).astype(np.float32), "W"),
         numpy_helper.from_array(np.array(1.0, np.float32), "one"),
         numpy_helper.from_array(np.array(value, np.float32), "big")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = Model(proto=proto, path="masked.onnx", digest="masked")
    samples = [{"q": rng.normal(size=(2, 8)).astype(np.float32),
                "m": (rng.random((2, 8)) > 0.3).astype(np.float32)} for _ in range(6)]
    result = convert(model, load_profile("generic"), samples, stats=calibrate(model, samples))
    assert result, result.to_dict()["verdict"]
    assert not result.pinned_nodes and not result.lowered.forced_fp32
    assert float(_constant(result.lowered.model, "big")) == -FP16_MAX
    assert rel_err(outputs(proto, samples[0])["y"], outputs(result.lowered.model, samples[0])["y"]) < 1e-2
    # The same -1e9 scaling a graph output is no mask: its node stays FP32, unclipped.
    proto.graph.output.append(helper.make_tensor_value_info("add", TensorProto.FLOAT, [2, 8]))
    low = lower(proto, "fp16")
    assert "spread" in low.forced_fp32 and float(_constant(low.model, "big")) == np.float32(value)
