"""Initialiser rules: values beyond the format's range, flushed weights, BatchNorm variances, masks."""

import numpy as np
import pytest
from analyse_util import build, findings
from onnx import TensorProto, helper, numpy_helper

from npuprep.numerics import get_format
from npuprep.profiles import Severity

MATMUL = """<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 8] x) => (float[1, 8] y) { y = MatMul (x, W) }"""


def _of(rule, model, target="generic"):
    return [f for f in findings(model, target) if f.rule == rule]


def test_weights_beyond_fp16_range_are_counted_exactly_as_rounding_makes_them_inf():
    # x -> MatMul(x, W) -> y, W holding values around the FP16 overflow boundary
    w = np.zeros((8, 8), np.float32)
    w[0, :6] = [65504, 65519, 65520, -7e4, 1e5, 3e5]
    [found] = _of("init.out_of_range", build(MATMUL, W=w))
    inf_after_rounding = int(np.isinf(get_format("fp16").round(w, saturate=False)).sum())
    assert found.evidence["count"] == inf_after_rounding == 4
    assert found.evidence["worst"] == 3e5 and found.evidence["fraction"] == 4 / 64
    assert found.severity is Severity.ERROR and found.node == "node_of_y" and found.tensor == "W"
    assert found.remedy == "rescale"


def test_weights_inside_the_range_raise_nothing():
    w = np.full((8, 8), 6e4, np.float32)
    w[0, 0] = 65519  # rounds to 65504, still finite
    assert not _of("init.out_of_range", build(MATMUL, W=w))
    assert not _of("init.underflow", build(MATMUL, W=w))


def test_weights_living_below_min_normal_give_count_fraction_and_worst_value():
    # x -> MatMul(x, W) -> y, W a layer whose weights all sit around 1e-6 (a tiny-init gate)
    w = np.full((8, 8), 2e-6, np.float32)
    w[0, :4] = [1e-9, -2e-8, 3e-6, 5e-7]  # two flush to 0; the rest become subnormal in FP16
    [found] = _of("init.underflow", build(MATMUL, W=w))
    fp16 = get_format("fp16").round(w, saturate=False)
    assert found.evidence["flush_count"] == int(((fp16 == 0) & (w != 0)).sum()) == 2
    assert found.evidence["subnormal_count"] == 62
    assert found.evidence["fraction"] == 1.0 and found.evidence["mass_fraction"] == 1.0
    assert found.evidence["worst"] == pytest.approx(1e-9)
    # What FP16 does to this layer: its subnormal weights are 20x less precise than normal values.
    assert (np.abs(fp16[1] - w[1]) / w[1]).max() > 20 * get_format("fp16").eps / 2
    assert found.severity is Severity.WARNING and found.remedy == "rescale"


def test_a_few_flushed_values_in_a_normal_tensor_are_one_info_line():
    # x -> MatMul(x, W) -> MatMul(., V) -> y; 1.6% of W's values flush but carry almost nothing
    w = np.full((64, 64), 0.5, np.float32)
    w[1, :] = -1e-9
    v = np.full((64, 64), 0.25, np.float32)
    v[1, 1] = 1e-10
    model = build("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 64] x) => (float[1, 64] y) { h = MatMul (x, W)  y = MatMul (h, V) }""", W=w, V=v)
    [found] = _of("init.underflow", model)
    assert found.severity is Severity.INFO and found.evidence["tensors"] == ["V", "W"]
    assert found.evidence["flush_count"] == 64 + 1
    assert found.evidence["worst"] == pytest.approx(1e-10)


def test_batchnorm_variance_beyond_range_is_folded_not_clipped():
    # x -> BatchNormalization(x, scale, bias, mean, var=9.8e7) -> y
    model = build("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 2, 4, 4] x) => (float[1, 2, 4, 4] y) {
            y = BatchNormalization (x, scale, bias, mean, var)
        }""", scale=np.ones(2, np.float32), bias=np.zeros(2, np.float32),
        mean=np.zeros(2, np.float32), var=np.array([9.8e7, 1.0], np.float32))
    [found] = _of("init.out_of_range", model)
    assert found.tensor == "var" and found.remedy == "fold"
    assert found.evidence["consumer"] == "BatchNormalization variance"
    assert "clipping" in found.remedy_text


@pytest.mark.parametrize("mask_value", [-np.inf, float(np.finfo(np.float32).min), -1e9])
def test_additive_mask_constant_needs_the_targets_minus_max(mask_value):
    # scores -> Add(scores, Where(keep, 0, mask)) -> y
    model = build("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[4] scores, bool[4] keep) => (float[4] y) {
            bias = Where (keep, zero, mask)
            y = Add (scores, bias)
        }""", zero=np.zeros(1, np.float32), mask=np.array([mask_value], np.float32))
    [found] = _of("init.mask_constant", model)
    assert found.tensor == "mask" and found.evidence["target_value"] == -get_format("fp16").max
    assert not _of("init.out_of_range", model)


def test_a_mask_inside_the_range_raises_nothing():
    model = build("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[4] scores) => (float[4] y) { y = Add (scores, mask) }""",
        mask=np.array([0, 0, -1e4, -1e4], np.float32))
    assert not [f for f in findings(model) if f.rule.startswith("init.")]


def test_constant_node_values_are_checked():
    # x -> Mul(x, Constant(1e6)) -> y
    big = helper.make_node("Constant", [], ["c"], name="big",
                           value=numpy_helper.from_array(np.array([1e6], np.float32)))
    graph = helper.make_graph(
        [big, helper.make_node("Mul", ["x", "c"], ["y"], name="mul")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    [found] = _of("init.out_of_range", helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert found.tensor == "c" and found.node == "mul" and found.evidence["worst"] == 1e6


def test_constant_value_float_attributes_are_checked_too():
    # x -> Mul(x, Constant(value_float = 1e5)) -> y
    model = build("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[1] x) => (float[1] y) { c = Constant <value_float = 100000.0> () y = Mul (x, c) }""")
    [found] = _of("init.out_of_range", model)
    assert found.tensor == "c" and found.evidence["worst"] == 1e5 and found.evidence["dtype"] == "fp32"
