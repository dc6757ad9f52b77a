"""A layer behind an ai.onnx.ml op that onnx's inference cannot type (skl2onnx's Scaler ->
Sub -> MatMul): typed from the op's schema, measured by calibration, and 8-bit."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import model_with_weights

from npuprep.calibrate import calibrate
from npuprep.graph import infer_tensors
from npuprep.pipeline import convert
from npuprep.profiles import load_profile
from npuprep.runtime.session import make_session, run

# x -> Scaler (ai.onnx.ml) -> Sub(mean) -> MatMul(W) [pca] -> y
SCALED_PCA = """
<ir_version: 8, opset_import: ["" : 15, "ai.onnx.ml" : 1]>
scaled_pca (float[N, 12] x) => (float[N, 6] y) {
    s = ai.onnx.ml.Scaler<offset = [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
                          scale = [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]>(x)
    c = Sub(s, mean)
    [pca] y = MatMul(c, W)
}
"""


def test_a_matmul_after_a_scaler_is_typed_measured_and_converted_to_int8(tmp_path):
    rng = np.random.default_rng(5)
    model = model_with_weights(tmp_path, SCALED_PCA, {
        "mean": rng.standard_normal(12) * 0.1, "W": rng.standard_normal((12, 6)) * 0.5})
    # onnx infers no type for Scaler's output; its schema says float.
    assert infer_tensors(model.proto).types["c"] == onnx.TensorProto.FLOAT
    feeds = [{"x": rng.standard_normal((16, 12)).astype(np.float32)} for _ in range(6)]
    stats = calibrate(model, feeds, detail="all")
    assert stats.tensors["c"].count == 6 * 16 * 12
    result = convert(model, load_profile("a2000"), feeds, precision="int8", stats=stats, rtol=5e-2)
    assert {x.node: x.precision for x in result.plan.eight_bit} == {"pca": "int8"}
    assert result.eight_bit.mac_share["int8"] == 1.0
    made_by = {o: n.op_type for n in result.lowered.model.graph.node for o in n.output}
    pca = next(n for n in result.lowered.model.graph.node if n.name == "pca")
    assert made_by[pca.input[0]] == made_by[pca.input[1]] == "DequantizeLinear"
    ours = run(make_session(result.lowered.model), feeds[0])["y"]
    ref = run(make_session(model.proto), feeds[0])["y"]
    err = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    assert 0 < err < 5e-2
    assert result.output_check
