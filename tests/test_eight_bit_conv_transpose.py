"""ConvTranspose layers in 8 bits: a decoder's upsampling quantised like a Conv.

Its weight is [C_in, C_out / group, k...]: per-channel scales run along axis 1 (one per output
channel) where group is 1; a grouped one takes a single scale (axis 1 is then one channel per
group, shared by every group).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.graph import to_array
from npuprep.rewrite.qdq import weight_axis
from npuprep.runtime.session import make_session, run
from tests.conftest import run_cli


def decoder(group: int) -> onnx.ModelProto:
    """x -> Conv -> a -> Relu -> r -> ConvTranspose(stride 2, group) -> u -> Conv -> y"""
    rng = np.random.default_rng(group)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3, "w1"),
             numpy_helper.from_array(rng.standard_normal((8, 8 // group, 2, 2)).astype(np.float32)
                                     * np.linspace(0.05, 1.0, 8 // group, dtype=np.float32)[None, :, None, None],
                                     "wt"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32) * 0.1, "bt"),
             numpy_helper.from_array(rng.standard_normal((2, 8, 3, 3)).astype(np.float32) * 0.3, "w2")]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1], name="conv1"),
         helper.make_node("Relu", ["a"], ["r"], name="relu"),
         helper.make_node("ConvTranspose", ["r", "wt", "bt"], ["u"], strides=[2, 2], group=group,
                          name="up"),
         helper.make_node("Conv", ["u", "w2"], ["y"], pads=[1, 1, 1, 1], name="conv2")],
        "decoder", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 16, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def test_weight_axis_of_a_conv_transpose():
    up = decoder(1).graph.node[2]
    assert weight_axis(up, 4) == 1
    assert weight_axis(decoder(2).graph.node[2], 4) is None  # grouped: one scale


def test_a_decoder_s_conv_transpose_is_quantised(tmp_path):
    for group in (1, 2):
        model = decoder(group)
        path = tmp_path / f"decoder{group}.onnx"
        onnx.save(model, str(path))
        data = tmp_path / f"data{group}"
        data.mkdir()
        rng = np.random.default_rng(0)
        xs = [rng.standard_normal((1, 3, 8, 8)).astype(np.float32) for _ in range(4)]
        for i, x in enumerate(xs):
            np.savez(data / f"{i}.npz", x=x)
        out = tmp_path / f"decoder{group}.int8.onnx"
        done = run_cli("convert", path, "--target", "a2000", "--precision", "int8", "--data", data,
                       "-o", out)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "100% int8" in done.stdout
        written = onnx.load(str(out))
        up = next(n for n in written.graph.node if n.op_type == "ConvTranspose")
        dq = {n.output[0]: n for n in written.graph.node if n.op_type == "DequantizeLinear"}
        assert up.input[0] in dq and up.input[1] in dq  # input and weight both 8-bit
        weight_dq = dq[up.input[1]]
        scales = to_array(next(i for i in written.graph.initializer if i.name == weight_dq.input[1]))
        if group == 1:
            assert [a.i for a in weight_dq.attribute if a.name == "axis"] == [1]
            assert scales.shape == (8,) and scales.max() > 5 * scales.min()  # one per channel
        else:
            assert scales.size == 1
        want = run(make_session(model), {"x": xs[0]})["y"]
        got = run(make_session(written), {"x": xs[0]})["y"]
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05
