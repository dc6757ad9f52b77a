"""A model onnxruntime loads but cannot run (a kernel refuses an attribute combination) is the
user's input: one line naming the file and the node, exit 2, nothing written; whichever
command runs it first (the goal's outputs, or the calibration under --metric rel-l2, or check)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper, parser

from tests.conftest import run_cli

# x -> Conv(dilations 2, auto_pad SAME_UPPER: onnxruntime refuses to run it) -> y
DILATED_SAME = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 4, 32] x) => (float[1, 8, 32] y) {
    [c1] y = Conv <auto_pad = "SAME_UPPER", dilations = [2], kernel_shape = [3]> (x, W)
}
"""


@pytest.mark.parametrize("args", [
    ("convert", "--target", "a2000", "-o", "o.onnx"),
    ("convert", "--target", "a2000", "--metric", "rel-l2", "-o", "o.onnx"),
    ("convert", "--target", "a2000", "--precision", "int8", "-o", "o.onnx"),
    ("check", "--target", "a2000"),
])
def test_a_model_onnxruntime_cannot_run_is_refused_in_one_line(tmp_path: Path, args: tuple) -> None:
    rng = np.random.default_rng(0)
    proto = parser.parse_model(DILATED_SAME)
    proto.graph.initializer.append(numpy_helper.from_array(rng.standard_normal((8, 4, 3)).astype(np.float32), "W"))
    onnx.save(proto, tmp_path / "m.onnx")
    (tmp_path / "data").mkdir()
    for i in range(4):
        np.savez(tmp_path / "data" / f"{i}.npz", x=rng.standard_normal((1, 4, 32)).astype(np.float32))
    done = run_cli(args[0], "m.onnx", *args[1:], "--data", "data", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    line, = done.stderr.strip().splitlines()  # onnxruntime's own words follow the node
    assert line.startswith("npuprep: error: m.onnx: onnxruntime cannot run it: node 'c1' (Conv): ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "m.onnx"]
