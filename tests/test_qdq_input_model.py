"""Models not in FP32 layers, to 8 bits. One that already holds Q/DQ pairs (pre-quantised)
converts: its calibration measures the float values after each DQ, and onnxruntime's QDQ passes,
which abort on such a DQ read by statistics branches, stay out of the calibration session. An
FP16 model is widened to FP32 exactly as its 8-bit source and reference (npuprep.fp16_source),
its FP16 inputs and outputs kept (it once claimed 100% INT8 and wrote the model unchanged)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper, parser

from npuprep import fp16_source
from npuprep.errors import NpuprepError
from npuprep.model_io import load_model
from npuprep.pipeline import convert
from npuprep.profiles import load_profile
from tests.conftest import run_cli

# x -> QuantizeLinear -> DequantizeLinear -> d -> MatMul(W) -> y
PREQUANTISED = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4, 16] x) => (float[4, 8] y) {
    q = QuantizeLinear (x, s, z)
    d = DequantizeLinear (q, s, z)
    [mm] y = MatMul (d, W)
}
"""


def test_a_prequantised_model_converts_to_int8(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    proto = parser.parse_model(PREQUANTISED)
    proto.graph.initializer.extend([
        numpy_helper.from_array(np.array(0.02, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.int8), "z"),
        numpy_helper.from_array((rng.standard_normal((16, 8)) * 0.3).astype(np.float32), "W")])
    onnx.save(proto, tmp_path / "m.onnx")
    (tmp_path / "data").mkdir()
    for i in range(8):
        np.savez(tmp_path / "data" / f"{i}.npz", x=(rng.standard_normal((4, 16)) * 0.5).astype(np.float32))
    done = run_cli("convert", "m.onnx", "--target", "a2000", "--precision", "int8", "--data", "data",
                   "--out", "o.onnx", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["passed"] and report["eight_bit"]["mac_share"]["int8"] == 1.0


# x (fp16) -> MatMul(W1 fp16) -> Relu -> MatMul(W2 fp16) -> y (fp16)
HALF = """
<ir_version: 8, opset_import: ["" : 17]>
g (float16[4, 16] x) => (float16[4, 8] y) {
    [mm1] h = MatMul (x, W1)
    a = Relu (h)
    [mm2] y = MatMul (a, W2)
}
"""


def test_an_fp16_model_converts_to_int8_from_its_exact_fp32_widening(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    w1, w2 = (rng.standard_normal((16, 32)) * 0.3).astype(np.float16), (rng.standard_normal((32, 8)) * 0.3).astype(np.float16)
    proto = parser.parse_model(HALF)
    proto.graph.initializer.extend([numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    onnx.save(proto, tmp_path / "m.onnx")
    feeds = [{"x": rng.standard_normal((4, 16)).astype(np.float16)} for _ in range(8)]
    result = convert(load_model(tmp_path / "m.onnx"), load_profile("a2000"), feeds,
                     precision="int8", stats="calibrate")
    assert result.passed and result.eight_bit.mac_share["int8"] == 1.0
    assert any("computes in FP16: widened to FP32 exactly" in n for n in result.notes)
    written = result.lowered.model
    # The interface the user feeds and deploys stays FP16.
    assert [i.type.tensor_type.elem_type for i in (*written.graph.input, *written.graph.output)] == [
        onnx.TensorProto.FLOAT16] * 2
    session = ort.InferenceSession(written.SerializeToString(), providers=["CPUExecutionProvider"])
    for feed in feeds[:3]:
        got = session.run(None, feed)[0].astype(np.float32)
        # the FP32 computation of the FP16 weights, which the 8-bit model approximates
        want = np.maximum(feed["x"].astype(np.float32) @ w1.astype(np.float32), 0) @ w2.astype(np.float32)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-2


def test_an_fp16_model_with_external_weights_converts_and_one_too_large_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    proto = parser.parse_model(HALF)
    proto.graph.initializer.extend([
        numpy_helper.from_array((rng.standard_normal((16, 32)) * 0.3).astype(np.float16), "W1"),
        numpy_helper.from_array((rng.standard_normal((32, 8)) * 0.3).astype(np.float16), "W2")])
    onnx.save(proto, tmp_path / "m.onnx", save_as_external_data=True, location="m.bin",
              size_threshold=0)
    (tmp_path / "data").mkdir()
    for i in range(8):
        np.savez(tmp_path / "data" / f"{i}.npz", x=rng.standard_normal((4, 16)).astype(np.float16))
    args = ("convert", "m.onnx", "--target", "a2000", "--precision", "int8", "--data", "data",
            "--out", "o.onnx", "--json")
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["eight_bit"]["mac_share"]["int8"] == 1.0
    # Past protobuf's limit once widened: one line, nothing written.
    monkeypatch.setattr(fp16_source, "_MAX_BYTES", 1000)
    samples = [{"x": rng.standard_normal((4, 16)).astype(np.float16)} for _ in range(4)]
    with pytest.raises(NpuprepError, match=r"m.onnx: the FP16 model's weights widened to FP32 would "
                       r"pass protobuf's 2 GiB \(export it in FP32 with external weights\)"):
        convert(load_model(tmp_path / "m.onnx"), load_profile("a2000"), samples,
                precision="int8", stats="calibrate")


def test_check_decides_an_fp16_model_s_layers_as_convert_does(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    proto = parser.parse_model(HALF)
    proto.graph.initializer.extend([
        numpy_helper.from_array((rng.standard_normal((16, 32)) * 0.3).astype(np.float16), "W1"),
        numpy_helper.from_array((rng.standard_normal((32, 8)) * 0.3).astype(np.float16), "W2")])
    onnx.save(proto, tmp_path / "m.onnx")
    (tmp_path / "data").mkdir()
    for i in range(8):
        np.savez(tmp_path / "data" / f"{i}.npz", x=rng.standard_normal((4, 16)).astype(np.float16))
    done = run_cli("check", "m.onnx", "--target", "a2000", "--precision", "int8", "--data", "data",
                   "--json", cwd=tmp_path)
    layers = {x["node"]: x["precision"] for x in json.loads(done.stdout)["plan"]["eight_bit"]}
    assert layers == {"mm1": "int8", "mm2": "int8"}, done.stderr[-2000:]
