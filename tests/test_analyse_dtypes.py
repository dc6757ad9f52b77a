"""dtype rules: BF16 is an error on a2000 and a slow path on orin; FP64 is flagged everywhere."""

import ml_dtypes
import numpy as np
from analyse_util import build, findings
from onnx import TensorProto, helper, numpy_helper

from npuprep.profiles import Severity, load_profile, parse_profile

BF16_CAST = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4] x) => (float[4] y) {
    xb = Cast <to = 16> (x)
    yb = Mul (xb, xb)
    y = Cast <to = 1> (yb)
}
"""


def _bf16_weight_model():
    # x -> Cast(BF16) -> MatMul(., W_bf16) -> Cast(FP32) -> y
    w = numpy_helper.from_array(np.ones((4, 4), ml_dtypes.bfloat16), "W")
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16, name="in_cast"),
         helper.make_node("MatMul", ["xb", "W"], ["yb"], name="mm"),
         helper.make_node("Cast", ["yb"], ["y"], to=TensorProto.FLOAT, name="out_cast")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_bf16_is_an_error_on_a2000_and_not_a_fast_path_on_orin():
    model = _bf16_weight_model()
    a2000 = [f for f in findings(model, "a2000") if f.rule.startswith("dtype.")]
    kinds = {f.evidence["kind"]: f for f in a2000}
    assert set(kinds) == {"constant", "cast", "tensor"}
    assert all(f.rule == "dtype.unsupported" and f.severity is Severity.ERROR for f in a2000)
    assert kinds["constant"].tensor == "W" and kinds["constant"].node == "mm"
    assert kinds["constant"].evidence["elements"] == 16
    assert kinds["cast"].node == "in_cast" and kinds["cast"].remedy == "convert_dtype"
    orin = [f for f in findings(model, "orin") if f.rule.startswith("dtype.")]
    assert orin and all(f.rule == "dtype.slow" and f.severity is Severity.WARNING for f in orin)
    assert all("not a fast path" in f.message for f in orin)


def test_each_cast_to_bf16_is_named():
    # x -> Cast(BF16) -> Mul(xb, xb) -> Cast(FP32) -> y
    casts = [f for f in findings(BF16_CAST, "a2000") if f.evidence.get("kind") == "cast"]
    assert len(casts) == 1 and casts[0].op_type == "Cast" and casts[0].evidence["dtype"] == "bf16"


def test_fp64_is_flagged_on_every_builtin():
    # x(f64) -> Mul(x, W_f64) -> y(f64)
    model = build("""<ir_version: 8, opset_import: ["" : 17]>
        g (double[3] x) => (double[3] y) { y = Mul (x, W) }""", W=np.ones(3, np.float64))
    for target in ("generic", "orin", "a2000"):
        found = [f for f in findings(model, target) if f.rule == "dtype.unsupported"]
        assert {f.evidence["kind"] for f in found} == {"constant", "tensor"}
        assert all(f.evidence["dtype"] == "fp64" for f in found)


def test_fp32_and_fp16_models_raise_no_dtype_finding():
    # x -> Cast(FP16) -> Mul(W) -> Cast(FP32) -> y
    model = build("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[3] x) => (float[3] y) {
            h = Cast <to = 10> (x)
            m = Mul (h, W)
            y = Cast <to = 1> (m)
        }""", W=np.ones(3, np.float16))
    for target in ("generic", "orin", "a2000"):
        assert not [f for f in findings(model, target) if f.rule.startswith("dtype.")]


def test_severity_comes_from_the_profile():
    data = load_profile("orin").to_dict()
    data["severity"]["slow_dtype"] = "info"
    quiet = parse_profile(data, "quiet.yaml")
    found = [f for f in findings(BF16_CAST, quiet) if f.rule == "dtype.slow"]
    assert found and all(f.severity is Severity.INFO for f in found)
