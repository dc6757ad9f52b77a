"""FLOPs of layers sized only by shape arithmetic that ONNX data propagation cannot follow."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort

from npuprep.flops import node_flops, tensor_shapes
from npuprep.graph import node_label

# x -> Shape -> Where(Equal(shape, -1), 1, shape) -> Expand(cls) -> Concat(cls, x) -> MatMul(W)
# (a ViT's class token: the Where stops inference, so the MatMul's token axis was unknown)
CLS_TOKEN = """
<ir_version: 8, opset_import: ["" : 17]>
vit_cls (float[1, 8, 4] x) => (float[1, T, 16] y) <float[1, 1, 4] cls, float[4, 16] w,
                                                     int64[1] axis0, int64[1] one,
                                                     int64[1] minus> {
    s = Shape(x)
    b = Gather(s, axis0)
    target = Concat<axis = 0>(b, one, minus)
    unknown = Equal(target, minus)
    fixed = Where(unknown, one, target)
    cls_b = Expand(cls, fixed)
    tokens = Concat<axis = 1>(cls_b, x)
    y = MatMul(tokens, w)
}
"""


def _model() -> onnx.ModelProto:
    model = onnx.parser.parse_model(CLS_TOKEN)
    rng = np.random.default_rng(0)
    model.graph.initializer.extend([
        onnx.numpy_helper.from_array(rng.normal(size=(1, 1, 4)).astype(np.float32), "cls"),
        onnx.numpy_helper.from_array(rng.normal(size=(4, 16)).astype(np.float32), "w"),
        onnx.numpy_helper.from_array(np.asarray([0], np.int64), "axis0"),
        onnx.numpy_helper.from_array(np.asarray([1], np.int64), "one"),
        onnx.numpy_helper.from_array(np.asarray([-1], np.int64), "minus"),
    ])
    return model


def test_a_layer_behind_a_where_is_sized_as_onnxruntime_runs_it() -> None:
    model = _model()
    onnx.checker.check_model(model)
    x = np.ones((1, 8, 4), np.float32)
    (y,) = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})
    shapes = tensor_shapes(model, {"x": x.shape})
    assert shapes["tokens"] == (1, 9, 4)
    assert shapes["y"] == y.shape == (1, 9, 16)
    matmul = next(n for n in model.graph.node if n.op_type == "MatMul")
    assert node_flops(model, {"x": x.shape})[node_label(matmul)] == 2 * 9 * 16 * 4

