"""A value_info size of -1 (Paddle2ONNX writes it for a dynamic batch) is no size: calibration
counts the elements it really saw (not -1 x the rest), so 8-bit clip shares stay shares."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from npuprep.calibrate import calibrate
from npuprep.model_io import Model
from npuprep.sample_size import sample_size


def test_a_minus_one_dimension_is_dynamic_not_negative() -> None:
    # x[N,4] -> Relu -> r (declared [-1, 4]) -> Neg -> y
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
                          value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, [-1, 4])])
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    feeds = [{"x": np.random.default_rng(i).normal(size=(2, 4)).astype(np.float32)} for i in range(3)]
    stats = calibrate(Model(proto=proto, path="", digest="0"), feeds, detail="all")
    r = stats.tensors["r"]
    assert r.count == 3 * 8 and r.detailed_count == 3 * 8
    assert 0 <= r.fraction_above(r.absmax / 2) <= 1
    assert sample_size(proto, {}).node_bytes == 0
