"""A model that already holds Q/DQ pairs (a pre-quantised input) converts to 8 bits: its
calibration measures the float values after each DQ, and onnxruntime's QDQ passes, which abort
on such a DQ read by statistics branches, stay out of the calibration session."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper, parser

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
