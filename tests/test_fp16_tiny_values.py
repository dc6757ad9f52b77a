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


_F64 = """
<ir_version: 8, opset_import: ["" : 17]>
g (double[N, 8] x, float t, double s) => (double[N, 4] y, float z, double[N, 4] u) <float[8,4] w> {
  xf = Cast<to=1>(x)
  a = MatMul(xf, w)
  b = Mul(a, t)
  y = Cast<to=11>(b)
  z = ReduceSum<keepdims=0>(b)
  u = Mul(y, s)
}
"""


def test_float64_io_and_0d_inputs_are_kept_as_the_model_declares_them():
    # x (float64) -> Cast -> MatMul -> Mul(t, a 0-d input) -> y (float64), z (0-d), u = y * s (float64, 0-d s)
    proto = onnx.parser.parse_model(_F64)
    proto.graph.initializer.append(numpy_helper.from_array(RNG.normal(0, 1, (8, 4)).astype(np.float32), "w"))
    feeds = [{"x": RNG.normal(0, 1, (3, 8)), "t": np.array(RNG.uniform(.5, 2), np.float32),
              "s": np.array(RNG.uniform(.5, 2), np.float64)} for _ in range(6)]
    for io_types in ("fp32", "target"):
        result = convert(_model(proto, "f64"), load_profile("a2000"), feeds, stats="calibrate", io_types=io_types)
        assert result, result.verdict.said
        written = result.lowered.model
        declared = {v.name: (v.type.tensor_type.elem_type, len(v.type.tensor_type.shape.dim))
                    for v in (*written.graph.input, *written.graph.output)}
        assert declared["x"] == declared["y"] == declared["u"] == (TensorProto.DOUBLE, 2)
        assert declared["s"] == (TensorProto.DOUBLE, 0)
        assert declared["t"][1] == declared["z"][1] == 0
        low_t = declared["t"][0]
        feed = {**feeds[0], "t": feeds[0]["t"].astype(helper.tensor_dtype_to_np_dtype(low_t))}
        for got, ref in zip(_outputs(written, feed), _outputs(proto, feeds[0]), strict=True):
            assert got.shape == ref.shape and np.linalg.norm(got - ref) <= 1e-2 * np.linalg.norm(ref)
