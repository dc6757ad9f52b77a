"""An op whose output onnx's inference leaves untyped (GroupNormalization-21 in onnx 1.23) no
longer leaves every node after it untyped, hence FP32: its schema's type parameter, shared with
a typed input, types it, and the conversion lowers the chain."""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper, parser

from npuprep.graph import infer_tensors
from npuprep.model_io import Model, fingerprint
from npuprep.pipeline import convert
from npuprep.profiles import load_profile

# x -> GroupNormalization(2 groups) -> Gelu -> Transpose -> MatMul(W) -> Transpose -> y
GROUP_NORM = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[2, 8, 6] x) => (float[2, 8, 6] y) {
    n = GroupNormalization <num_groups = 2> (x, S, B)
    a = Gelu (n)
    t = Transpose <perm = [0, 2, 1]> (a)
    m = MatMul (t, W)
    y = Transpose <perm = [0, 2, 1]> (m)
}
"""


def test_a_group_norm_chain_is_typed_and_lowered_to_fp16() -> None:
    rng = np.random.default_rng(0)
    proto = parser.parse_model(GROUP_NORM)
    proto.graph.initializer.extend([
        numpy_helper.from_array(np.ones(8, np.float32), "S"),
        numpy_helper.from_array(np.zeros(8, np.float32), "B"),
        numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float32), "W")])
    assert {t: infer_tensors(proto).types.get(t) for t in "natm"} == dict.fromkeys("natm", 1)
    model = Model(proto=proto, path="m.onnx", digest=fingerprint(proto))
    feeds = [{"x": (rng.standard_normal((2, 8, 6)) * 100).astype(np.float32)} for _ in range(4)]
    result = convert(model, load_profile("a2000"), feeds, stats="calibrate")
    assert result.passed and result.pinned_nodes == ()
    assert result.output_check.outputs["y"]["rel_l2"] < 1e-2
