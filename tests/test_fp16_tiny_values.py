"""Values FP16 cannot hold on unseen models: weights under its smallest subnormal named, float64
graph I/O and 0-d inputs kept as the model declares them."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from npuprep.convert import convert
from npuprep.model_io import Model, fingerprint
from npuprep.profiles import load_profile

RNG = np.random.default_rng(437)


def _model(proto: onnx.ModelProto, name: str) -> Model:
    return Model(proto=proto, path=f"{name}.onnx", digest=fingerprint(proto))


def _outputs(proto: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


def test_weights_that_round_to_zero_are_named():
    # x[4,32] -> MatMul(w: a quarter of its rows ~5e-9, under FP16's smallest subnormal) -> y
    w = RNG.normal(0, .2, (32, 16))
    w[:8] = RNG.normal(0, 5e-9, (8, 16))
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])],
                              [numpy_helper.from_array(w.astype(np.float32), "w")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = [{"x": RNG.normal(0, 1, (4, 32)).astype(np.float32)} for _ in range(4)]
    result = convert(_model(proto, "flush"), load_profile("a2000"), feeds, stats="calibrate")
    assert result, result.verdict.said
    written = {t.name: numpy_helper.to_array(t) for t in result.lowered.model.graph.initializer}["w"]
    assert written.dtype == np.float16 and np.count_nonzero(written[:8]) == 0
    note = next(n for n in result.notes if "smallest fp16 subnormal" in n)
    assert "'w' (128)" in note
