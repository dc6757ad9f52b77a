"""A layer's weights under FP16's smallest subnormal: lifted by 2^j and compensated downstream,
or the layer kept FP32 where no compensation closes; checked with explicit Cast pairs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from npuprep.convert import convert
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import get_format
from npuprep.plan.actions import PinFp32, Rescale
from npuprep.profiles import load_profile
from npuprep.verify.emulate_lowered import emulate_lowered

RNG = np.random.default_rng(37)
FP16 = get_format("fp16")


def _chain(after: str) -> onnx.ModelProto:
    """x[4,32] (1e3..3e3) -> MatMul(w1: 1e-8..2.9e-8, all under half FP16's smallest subnormal)
    -> h (~1e-3) -> `after` -> y: "matmul" a MatMul(w2: 100..500), "tanh" a Tanh."""
    w1 = RNG.uniform(1e-8, 2.9e-8, (32, 16)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="tiny")]
    inits = [numpy_helper.from_array(w1, "w1")]
    if after == "matmul":
        nodes.append(helper.make_node("MatMul", ["h", "w2"], ["y"], name="head"))
        inits.append(numpy_helper.from_array(RNG.uniform(100, 500, (16, 8)).astype(np.float32), "w2"))
        width = 8
    else:
        nodes.append(helper.make_node("Tanh", ["h"], ["y"], name="squash"))
        width = 16
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(n: int) -> list[dict[str, np.ndarray]]:
    return [{"x": RNG.uniform(1e3, 3e3, (4, 32)).astype(np.float32)} for _ in range(n)]


def _rel_l2(model: onnx.ModelProto, reference: onnx.ModelProto, feed: dict[str, np.ndarray]) -> float:
    def out(m: onnx.ModelProto) -> np.ndarray:
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]

    got, ref = out(model).astype(np.float64), out(reference).astype(np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _naive_fp16(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The source with its weights rounded to FP16 and back: what a plain lowering stores."""
    naive = onnx.ModelProto()
    naive.CopyFrom(proto)
    for init in naive.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(
            numpy_helper.to_array(init).astype(np.float16).astype(np.float32), init.name))
    return naive


def test_tiny_weights_are_lifted_and_compensated_by_the_next_layer():
    proto = _chain("matmul")
    feeds = _feeds(6)
    # Without a remedy the stored weights are all 0: the layer is lost.
    assert _rel_l2(_naive_fp16(proto), proto, feeds[0]) > 0.1
    result = convert(Model(proto=proto, path="tiny.onnx", digest=fingerprint(proto)), load_profile("a2000"),
                     feeds, stats="calibrate")
    assert result, result.verdict.said
    lifted = [a for a in result.plan.actions if isinstance(a, Rescale) and a.entry == "tiny"]
    assert len(lifted) == 1 and lifted[0].k < 0 and "head" in lifted[0].absorbers
    assert "w1" in lifted[0].why and "round to 0" in lifted[0].why
    assert not [a for a in result.plan.actions if isinstance(a, PinFp32)]
    written = result.lowered.model
    stored = {t.name: numpy_helper.to_array(t) for t in written.graph.initializer}
    w1 = next(v for k, v in stored.items() if k.startswith("w1"))
    assert w1.dtype == np.float16 and np.count_nonzero(w1) == w1.size
    assert not any("smallest fp16 subnormal" in n for n in result.notes)
    # The written model emulated with explicit Cast pairs (rounds as FP16 hardware would).
    emulated = emulate_lowered(written, FP16, saturate=False).model
    for feed in feeds[:2]:
        assert _rel_l2(emulated, proto, feed) < 1e-2


def test_tiny_weights_without_a_compensation_keep_their_layer_fp32():
    # h -> Tanh: no consumer takes 2^-j back, so the layer and its weight stay FP32, named.
    proto = _chain("tanh")
    feeds = _feeds(6)
    assert _rel_l2(_naive_fp16(proto), proto, feeds[0]) > 0.1
    result = convert(Model(proto=proto, path="tiny_tanh.onnx", digest=fingerprint(proto)), load_profile("a2000"),
                     feeds, stats="calibrate", max_fp32_share=1.0)
    assert result, result.verdict.said
    assert not [a for a in result.plan.actions if isinstance(a, Rescale)]
    pins = [a for a in result.plan.actions if isinstance(a, PinFp32)]
    assert pins and "tiny" in pins[0].nodes and "w1 would lose its small values" in pins[0].why
    stored = {t.name: t.data_type for t in result.lowered.model.graph.initializer}
    assert stored["w1"] == TensorProto.FLOAT
    emulated = emulate_lowered(result.lowered.model, FP16, saturate=False).model
    assert _rel_l2(emulated, proto, feeds[0]) < 1e-2
