"""An FP16 model widened to FP32 as an 8-bit source (npuprep.fp16_source): every FP16 weight,
Constant, Cast target and body tensor becomes FP32 with the same values, the graph computes in
FP32, and its FP16 inputs and outputs keep their names and types behind Casts."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, numpy_helper, parser

from npuprep.fp16_source import computes_fp16, widen_fp16

# x:fp16 -> Mul(W) -> h -> If(cond: h * c, else: Cast16(Cast32(h)) + 1) -> y:fp16; h is an output too
HALF = """
<ir_version: 8, opset_import: ["" : 17]>
g (float16[3] x, bool cond) => (float16[3] y, float16[3] h) {
    h = Mul (x, W)
    y = If (cond) <
        then_branch = t () => (float16[3] a) {
            c = Constant <value = float[1] {3.0}> ()
            a = Mul (h, c)
        },
        else_branch = e () => (float16[3] b) {
            w = Cast <to = 1> (h)
            n = Cast <to = 10> (w)
            one = Constant <value = float[1] {1.0}> ()
            b = Add (n, one)
        }
    >
}
"""


def _half_model() -> onnx.ModelProto:
    proto = parser.parse_model(HALF)
    for branch in proto.graph.node[1].attribute:  # the parser writes no float16 literal
        for node in branch.g.node:
            if node.op_type == "Constant":
                value = numpy_helper.to_array(node.attribute[0].t).astype(np.float16)
                node.attribute[0].t.CopyFrom(numpy_helper.from_array(value))
    return proto


def _run(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feed)


def test_the_widened_model_computes_in_fp32_and_keeps_its_fp16_interface() -> None:
    proto = _half_model()
    w = np.array([1.0009765625, 2.0, -0.5], np.float16)
    proto.graph.initializer.append(numpy_helper.from_array(w, "W"))
    wide = widen_fp16(proto, "m.onnx")
    onnx.checker.check_model(wide)
    assert computes_fp16(proto) and not computes_fp16(wide)
    assert [(v.name, v.type.tensor_type.elem_type) for v in (*wide.graph.input, *wide.graph.output)] == [
        ("x", TensorProto.FLOAT16), ("cond", TensorProto.BOOL), ("y", TensorProto.FLOAT16),
        ("h", TensorProto.FLOAT16)]
    assert numpy_helper.to_array(wide.graph.initializer[0]).dtype == np.float32
    # x * W is no FP16 value: the widened graph rounds it once, at the output.
    x = np.array([2.0009765625, 1.5, 3.0], np.float16)
    exact = x.astype(np.float32) * w.astype(np.float32)
    y_wide, h_wide = _run(wide, {"x": x, "cond": np.array(True)})
    assert h_wide.dtype == np.float16 and np.array_equal(h_wide, exact.astype(np.float16))
    # Inside, the If's branch read the FP32 product: 3 * exact, rounded once at the output.
    assert np.array_equal(y_wide, (exact * 3).astype(np.float16))
    y_else = _run(wide, {"x": x, "cond": np.array(False)})[0]
    assert np.array_equal(y_else, (exact + 1).astype(np.float16))


def test_a_model_of_fp32_layers_with_an_fp16_interface_is_not_widened() -> None:
    # x:fp16 -> Cast(FP32) -> MatMul(W) -> Cast(FP16) -> y:fp16
    proto = parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float16[2, 4] x) => (float16[2, 3] y) {
        f = Cast <to = 1> (x)
        m = MatMul (f, W)
        y = Cast <to = 10> (m)
    }
    """)
    proto.graph.initializer.append(numpy_helper.from_array(np.ones((4, 3), np.float32), "W"))
    assert not computes_fp16(proto)
    proto.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.ones((4, 3), np.float16), "W"))
    proto.graph.node[0].attribute[0].i = TensorProto.FLOAT16
    assert computes_fp16(proto)
