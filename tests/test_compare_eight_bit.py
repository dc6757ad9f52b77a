"""`npuprep compare REF CAND` on an 8-bit conversion says what convert said: the QDQ model is run
as convert verified it (its Q/DQ pairs exact, every other tensor rounded to the target's FP16),
so the same samples give the same errors; samples of another folder that share the calibration
files' names are not taken for them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper, parser

from tests.conftest import run_cli

# x -> MatMul(W) -> Relu -> MatMul(V) -> Softmax -> p ; logits y too
MLP = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4, 16] x) => (float[4, 8] y, float[4, 8] p) {
    [mm1] h = MatMul (x, W)
    a = Relu (h)
    [mm2] y = MatMul (a, V)
    p = Softmax <axis = -1> (y)
}
"""


def _outputs(text: str) -> dict[str, float]:
    return {line.split()[1].rstrip(":"): float(line.split("rel L2 ")[1].split(",")[0])
            for line in text.splitlines() if line.startswith("output ")}


def _save_mlp(path: Path, rng: np.random.Generator) -> None:
    """MLP with weights drawn from `rng`, written to `path`."""
    proto = parser.parse_model(MLP)
    proto.graph.initializer.extend([
        numpy_helper.from_array((rng.standard_normal((16, 32)) * 0.4).astype(np.float32), "W"),
        numpy_helper.from_array((rng.standard_normal((32, 8)) * 0.4).astype(np.float32), "V")])
    onnx.save(proto, path)


def test_compare_gives_convert_s_held_out_errors_and_knows_its_calibration_folder(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    _save_mlp(tmp_path / "m.onnx", rng)
    for folder, count in (("calib", 8), ("held", 4)):
        (tmp_path / folder).mkdir()
        for i in range(count):
            np.savez(tmp_path / folder / f"{i:03d}.npz", x=rng.standard_normal((4, 16)).astype(np.float32))
    done = run_cli("convert", "m.onnx", "--target", "a2000", "--precision", "int8", "--data", "calib",
                   "--holdout", "held", "-o", "q.onnx", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    held = {k: v["rel_l2"] for k, v in json.loads(done.stdout)["holdout"]["outputs"].items()}
    compared = run_cli("compare", "m.onnx", "q.onnx", "--data", "held", cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr[-2000:]
    said = _outputs(compared.stdout + compared.stderr)
    assert said.keys() == held.keys()
    for name, rel_l2 in held.items():
        assert abs(said[name] - rel_l2) <= 5e-4 * rel_l2 + 1e-9, (name, said[name], rel_l2)
    text = compared.stdout + compared.stderr
    assert "compared as convert verified it" in text and "calibrated and planned on" not in text
    # The calibration folder itself is named as such; a copy elsewhere is not (names alike).
    again = run_cli("compare", "m.onnx", "q.onnx", "--data", "calib", cwd=tmp_path)
    assert "8 of these samples" in again.stdout + again.stderr
    shutil.copytree(tmp_path / "calib", tmp_path / "other")
    for f in (tmp_path / "other").iterdir():
        np.savez(f, x=rng.standard_normal((4, 16)).astype(np.float32))
    other = run_cli("compare", "m.onnx", "q.onnx", "--data", "other", cwd=tmp_path)
    assert "calibrated and planned on" not in other.stdout + other.stderr


def test_an_fp8_conversion_is_compared_as_convert_verified_it_not_widened_as_fp8_storage(
        tmp_path: Path) -> None:
    # MLP in FP8: its weights are FP8 behind DequantizeLinear; compare took the model for one
    # lowered to FP8 storage, widened those weights to FP32 and could not load it (BlazeFace's
    # INT8 conversion with 1.9% of its layers in FP8 alike).
    rng = np.random.default_rng(1)
    _save_mlp(tmp_path / "m.onnx", rng)
    # a2000 without INT8: its FP8 conversion keeps FP8 (with INT8 it kept INT8 throughout).
    a2000 = Path(__file__).parents[1] / "target_profiles" / "a2000.yaml"
    (tmp_path / "fp8only.yaml").write_text(a2000.read_text().replace(
        "name: a2000", "name: fp8only").replace("fast: [int4, int8, fp8_e4m3, fp16]",
                                                "fast: [fp8_e4m3, fp16]"))
    (tmp_path / "calib").mkdir()
    for i in range(4):
        np.savez(tmp_path / "calib" / f"{i}.npz", x=rng.standard_normal((4, 16)).astype(np.float32))
    done = run_cli("convert", "m.onnx", "--target", "fp8only.yaml", "--precision", "fp8_e4m3", "--data",
                   "calib", "--no-holdout", "-o", "q.onnx", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    stored = {i.data_type for i in onnx.load(tmp_path / "q.onnx").graph.initializer}
    assert onnx.TensorProto.FLOAT8E4M3FN in stored
    compared = run_cli("compare", "m.onnx", "q.onnx", "--data", "calib", "--target",
                       "fp8only.yaml", cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr[-2000:]
    assert "compared as convert verified it" in compared.stdout + compared.stderr


def test_convert_s_layer_table_is_compare_s_on_the_calibration_samples(tmp_path: Path) -> None:
    # MLP in INT8: convert compares layer by layer what the board computes (every tensor outside
    # the Q/DQ pairs rounded to FP16), as `npuprep compare` reads the model written: one table.
    rng = np.random.default_rng(1)
    _save_mlp(tmp_path / "m.onnx", rng)
    (tmp_path / "calib").mkdir()
    for i in range(8):
        np.savez(tmp_path / "calib" / f"{i:03d}.npz", x=rng.standard_normal((4, 16)).astype(np.float32))
    done = run_cli("convert", "m.onnx", "--target", "a2000", "--precision", "int8", "--data", "calib",
                   "--no-holdout", "-o", "q.onnx", "--report-json", "r.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    ours = {t["tensor"]: t["rel_l2"] for t in json.loads((tmp_path / "r.json").read_text())["compare"]["tensors"]}
    compared = run_cli("compare", "m.onnx", "q.onnx", "--data", "calib", "--json", cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr[-2000:]
    theirs = {t["tensor"]: t["rel_l2"] for t in json.loads(compared.stdout)["tensors"]}
    assert ours.keys() == theirs.keys() and "a" in ours
    for name, rel_l2 in ours.items():
        assert abs(theirs[name] - rel_l2) <= 1e-6 * rel_l2 + 1e-12, (name, theirs[name], rel_l2)
