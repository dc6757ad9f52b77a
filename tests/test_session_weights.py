"""Sessions made from a proto: its large initialisers reach onnxruntime as arrays beside a
weightless graph (npuprep.runtime.session.split_weights), sized by their dims."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from npuprep.runtime.session import INLINE_BYTES, make_session, run, split_weights


def test_large_weights_go_beside_the_graph_and_small_or_string_ones_stay_in_it():
    # x -> MatMul(W big) -> Add(b small) -> y; an unread string tensor s (larger than the limit)
    big = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 4096
    small = np.ones(64, np.float32)
    words = np.array(["a" * 100] * 64, dtype=object)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [numpy_helper.from_array(big, "W"), numpy_helper.from_array(small, "b"),
         numpy_helper.from_array(words, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert big.nbytes > INLINE_BYTES >= small.nbytes
    skeleton, weights = split_weights(model)
    assert list(weights) == ["W"] and np.array_equal(weights["W"], big)
    kept = {i.name: i for i in skeleton.graph.initializer}
    assert kept["W"].data_location == TensorProto.EXTERNAL and not kept["W"].raw_data
    assert numpy_helper.to_array(kept["b"]).tolist() == small.tolist()
    assert kept["s"].data_type == TensorProto.STRING and len(kept["s"].string_data) == 64
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    got = run(make_session(model), {"x": x}, ["y"])["y"]
    np.testing.assert_allclose(got, x @ big + small, rtol=1e-6)
