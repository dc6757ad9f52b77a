"""check --precision int8 shows the clip convert --precision int8 writes: the same rule on the same
statistics, raised for unseen samples as quantisation raises it, stored as uint8 where convert
stores it so; where the rules' clips differ, every candidate convert weighs is listed, and the
one it picked is among them with the scale in the artefact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_cli
from onnx import numpy_helper
from rewrite_util import build

from npuprep.analyse.scale_clip import scale_clip_findings
from npuprep.calibrate.scales import FP8_NAN_HEADROOM, sample_headroom
from npuprep.calibrate.stats import RangeStats
from npuprep.numerics import eight_bit_format

# x[64,64] -> MatMul(W) -> h -> Relu -> r -> MatMul(W) -> y
MLP = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[64, 64] x) => (float[64, 64] y) <float[64, 64] W> {
    [mm1] h = MatMul (x, W)
    [relu] r = Relu (h)
    [mm2] y = MatMul (r, W)
}
"""


def _written(path: Path) -> dict[str, tuple[float, str, int]]:
    """Activation -> (scale, stored type, zero point) of the QuantizeLinears of a QDQ model."""
    model = onnx.load(path)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return {n.input[0]: (float(inits[n.input[1]]), inits[n.input[2]].dtype.name, int(inits[n.input[2]]))
            for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in inits}


def test_check_shows_the_clip_convert_writes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    onnx.save(build(MLP, W=(rng.normal(size=(64, 64)) / 8).astype(np.float32)), tmp_path / "m.onnx")
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        np.savez(data / f"s{i}.npz", x=rng.normal(size=(64, 64)).astype(np.float32))
    checked = run_cli("check", "m.onnx", "-t", "a2000", "--precision", "int8", "--data", "data",
                      "--json", cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    found = {f["tensor"]: f["evidence"] for f in json.loads(checked.stdout)["findings"]
             if f["rule"] == "range.scale_clip"}
    done = run_cli("convert", "m.onnx", "-t", "a2000", "--precision", "int8", "--data", "data",
                   "--no-holdout", "-o", "out.onnx", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    eight = json.loads((tmp_path / "out.report.json").read_text())["eight_bit"]
    written = _written(tmp_path / "out.onnx")
    assert set(written) == set(found) == {"x", "r"}
    for tensor, ev in found.items():
        rule = eight["tensor_rules"].get(tensor, eight["scale_rule"])
        shown = ev["candidates"][rule] if "candidates" in ev else ev
        # The scale in the file is an FP32 number: equal to check's to FP32's precision.
        assert written[tensor] == (pytest.approx(shown["scale"], rel=1e-7), shown["stored"],
                                   shown["zero_point"])
    assert written["r"][1] == "uint8"  # a Relu's output: uint8 in both
    # x's percentile clip sits below its abs-max: convert weighs both, check lists both.
    assert set(found["x"]["candidates"]) >= {"absmax", "percentile"}
    # The clip check shows is raised for unseen samples past the rule's own.
    assert found["x"]["clip"] > 4.0 and found["x"]["unseen_sample_widening"] > 1


def _stats(per_sample: list[float]) -> object:
    top = max(per_sample)
    r = RangeStats(tensor="x", scope="", node="", min=-top, max=top, absmax=top, count=64,
                   nan_count=0, inf_count=0, zero_count=0, exp_hist={}, over={}, under={},
                   per_sample_absmax=tuple(per_sample), detailed_count=0)

    class Stats:
        tensors = {"x": r}
    return Stats()


def test_fp8_that_does_not_saturate_takes_abs_max_with_its_nan_headroom() -> None:
    # x -> MatMul(W): FP8 on a target whose FP8 gives NaN past 448 clips at 2 x abs-max, as
    # convert's scales do; a saturating one keeps the rule's clip (abs-max when no histogram).
    model = build("""
    <ir_version: 8, opset_import: ["" : 19]>
    g (float[4, 4] x) => (float[4, 4] y) <float[4, 4] W> {
        [mm] y = MatMul (x, W)
    }""", W=np.eye(4, dtype=np.float32))
    fmt = eight_bit_format("fp8_e4m3")
    stats = _stats([3.0, 3.1, 2.9, 3.0])
    spread = sample_headroom(stats.tensors["x"])
    loud = scale_clip_findings(model, stats, fmt, ["mm"], "mse", saturate=False).items[0].evidence
    assert loud["scale_rule"] == "absmax" and loud["clip"] == pytest.approx(3.1 * max(FP8_NAN_HEADROOM, spread))
    quiet = scale_clip_findings(model, stats, fmt, ["mm"], "absmax", saturate=True).items[0].evidence
    assert quiet["clip"] == pytest.approx(3.1 * spread) and quiet["clipped_fraction"] == 0
