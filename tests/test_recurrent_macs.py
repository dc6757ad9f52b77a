"""Recurrent layers (RNN/GRU/LSTM) counted by their gate products: FLOPs, the ledger's compute
class, the FP32 share, and the note an 8-bit conversion gives on the layers it leaves wider."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import model_with_weights
from onnx import helper, parser

from npuprep.calibrate import calibrate
from npuprep.calibrate.layer_macs import layer_macs, recurrent_note
from npuprep.flops import node_flops
from npuprep.ops import launch_class
from npuprep.pipeline import convert
from npuprep.profiles import load_profile
from npuprep.verify.fp32_share import fp32_share

RNG = np.random.default_rng(5)
SEQ, BATCH, INPUT, HIDDEN = 6, 2, 3, 4


def _recurrent(op: str, gates: int, directions: int, layout: int) -> onnx.ModelProto:
    # x [seq, batch, input] (or batch first) -> LSTM/GRU/RNN(W, R) -> y
    x_shape = [SEQ, BATCH, INPUT] if layout == 0 else [BATCH, SEQ, INPUT]
    node = helper.make_node(op, ["x", "W", "R"], ["y"], name="cell", hidden_size=HIDDEN,
                            direction="bidirectional" if directions == 2 else "forward",
                            layout=layout)
    weights = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, s) for n, s in (
        ("W", [directions, gates * HIDDEN, INPUT]), ("R", [directions, gates * HIDDEN, HIDDEN]))]
    graph = helper.make_graph([node], "rnn",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x_shape),
                               *weights],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def _products(directions: int, gates: int) -> onnx.ModelProto:
    # The same gate products written out: x [seq*batch, input] -> MatMul(W^T), and per step
    # h [batch, hidden] -> MatMul(R^T), for each direction.
    rows = SEQ * BATCH
    steps = "\n".join(f"    s{d}_{t} = MatMul(h, r)" for d in range(directions) for t in range(SEQ))
    inputs = "\n".join(f"    i{d} = MatMul(x, w)" for d in range(directions))
    return parser.parse_model(f"""
<ir_version: 8, opset_import: ["" : 14]>
products (float[{rows}, {INPUT}] x, float[{BATCH}, {HIDDEN}] h, float[{INPUT}, {gates * HIDDEN}] w,
          float[{HIDDEN}, {gates * HIDDEN}] r) => (float[{rows}, {gates * HIDDEN}] i0) {{
{inputs}
{steps}
}}
""")


def test_recurrent_flops_are_the_gate_products_written_out_as_matmuls():
    for op, gates in (("LSTM", 4), ("GRU", 3), ("RNN", 1)):
        for directions, layout in ((1, 0), (2, 0), (1, 1)):
            got = node_flops(_recurrent(op, gates, directions, layout))["cell"]
            assert got == sum(node_flops(_products(directions, gates)).values()), (op, directions)
    assert launch_class("LSTM") == launch_class("Conv") == "mac"


# x [6, 2, 8] -> LSTM(hidden 16) [cell] -> y [6, 1, 2, 16] -> Reshape [12, 16] -> MatMul(V) [head]
LSTM_HEAD = """
<ir_version: 8, opset_import: ["" : 14]>
lstm_head (float[6, 2, 8] x) => (float[12, 4] out) {
    [cell] y = LSTM<hidden_size = 16>(x, W, R)
    shape = Constant<value = int64[2] {12, 16}>()
    flat = Reshape(y, shape)
    [head] out = MatMul(flat, V)
}
"""


def _lstm_head(tmp_path):  # noqa: ANN001, ANN202 - pytest's tmp_path; a test helper
    return model_with_weights(tmp_path, LSTM_HEAD, {
        "W": RNG.standard_normal((1, 64, 8)) * 0.3, "R": RNG.standard_normal((1, 64, 16)) * 0.3,
        "V": RNG.standard_normal((16, 4)) * 0.3})


def test_the_lstm_counts_in_the_fp32_share_and_the_note_names_its_part(tmp_path):
    model = _lstm_head(tmp_path)
    shares = fp32_share(model.proto, [(["cell"], "pinned", "")])
    lstm, head = 2 * 6 * 2 * 64 * (8 + 16), 2 * 12 * 16 * 4
    assert shares.total_mac_flops == lstm + head
    assert shares.macs == lstm / (lstm + head)
    macs = layer_macs(model.proto, None, {"x": (6, 2, 8)})
    assert macs == {"head": head // 2}
    [note] = recurrent_note(model.proto, macs, {"x": (6, 2, 8)})
    assert note.startswith(f"1 recurrent layer(s) (LSTM) hold {100 * lstm / (lstm + head):.3g}% of")
    # A model without one has no note.
    assert recurrent_note(model.proto, {"head": 1}, {}) != [] and \
        recurrent_note(onnx.parser.parse_model("""
<ir_version: 8, opset_import: ["" : 14]>
plain (float[2, 4] x) => (float[2, 4] y) { y = Relu(x) }
"""), {}, {}) == []


def test_an_int8_conversion_says_the_lstm_stays_wider_while_its_head_is_int8(tmp_path):
    model = _lstm_head(tmp_path)
    feeds = [{"x": RNG.standard_normal((6, 2, 8)).astype(np.float32)} for _ in range(4)]
    result = convert(model, load_profile("a2000"), feeds, precision="int8",
                     stats=calibrate(model, feeds, detail="all"), rtol=5e-2)
    assert result.eight_bit.mac_share["int8"] == 1.0
    assert any(n.startswith("1 recurrent layer(s) (LSTM) hold 9") for n in result.notes)
    assert not any(n.op_type == "QuantizeLinear" and "cell" in n.name
                   for n in result.lowered.model.graph.node)
