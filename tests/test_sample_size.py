"""`--input-shape` sizes a run before it starts: the largest node's activations at those sizes,
times the least growth measured on convert, against this machine's memory or --max-memory.
Sizes that cannot fit are one line and exit 2, nothing written; real large inputs still run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from rewrite_util import build

from npuprep.data import synthetic_samples
from npuprep.errors import NpuprepError
from npuprep.sample_size import RUN_FACTOR, sample_size
from tests.conftest import model_from_text, run_cli

# x[1,3,H,W] -> Conv(8 filters, 3x3, pad 1) -> c[1,8,H,W] -> Relu -> y
CONV = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 3, H, W] x) => (float[1, 8, H, W] y) <float[8, 3, 3, 3] w> {
  c = Conv <pads = [1, 1, 1, 1]> (x, w)
  y = Relu (c)
}"""

def conv() -> onnx.ModelProto:
    return build(CONV, w=np.ones((8, 3, 3, 3), np.float32))


# x[1,N] -> Mul(2) -> Exp -> y
CHAIN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, N] x) => (float[1, N] y) <float k = {2.0}> {
  a = Mul (x, k)
  y = Exp (a)
}"""


def test_the_largest_node_is_found_at_the_given_sizes() -> None:
    size = sample_size(conv(), {"x": (1, 3, 100, 200)})
    # Relu reads c and writes y (8 channels each): 16 x 100 x 200 floats, more than the Conv's
    # 3 + 8 (its weight apart).
    assert size.node_bytes == 16 * 100 * 200 * 4 and size.node == "node_of_y"
    assert size.run_bytes == RUN_FACTOR * size.node_bytes


def test_sizes_a_run_cannot_hold_are_refused_and_real_ones_are_not() -> None:
    model = conv()
    with pytest.raises(NpuprepError, match=r"--input-shape x:1x3x100000x100000: a run needs at least "
                                           r"[0-9.]+e\+0?[34] GiB \(node 'node_of_y' reads and writes"):
        synthetic_samples(model, 1, shapes={"x": (1, 3, 100_000, 100_000)})
    # A 4K frame: 0.6 GiB through the Conv, a few GiB for the run.
    feeds = synthetic_samples(model, 1, shapes={"x": (1, 3, 2160, 3840)})
    assert feeds.specs[0].shape == (1, 3, 2160, 3840)


def test_cli_refuses_a_billion_elements_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    onnx.save(model_from_text(CHAIN), tmp_path / "m.onnx")
    big = run_cli("convert", "m.onnx", "-t", "a2000", "--synthetic", "2", "--input-shape",
                  "x:1x1000000000", "-o", "out.onnx", cwd=tmp_path)
    assert big.returncode == 2 and len(big.stderr.strip().splitlines()) == 1, big.stderr
    assert "x:1x1000000000: a run needs at least 59.6 GiB" in big.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    # --max-memory is the limit where it is the smaller: 8 x 76 MB passes 400 MB.
    tight = run_cli("convert", "m.onnx", "-t", "a2000", "--synthetic", "2", "--input-shape",
                    "x:1x10000000", "--max-memory", "400M", "-o", "out.onnx", cwd=tmp_path)
    assert tight.returncode == 2 and "over --max-memory (0.391 GiB)" in tight.stderr, tight.stderr
    fine = run_cli("convert", "m.onnx", "-t", "a2000", "--synthetic", "2", "--input-shape",
                   "x:1x1000000", "-o", "out.onnx", cwd=tmp_path)
    assert fine.returncode == 0, fine.stdout + fine.stderr
