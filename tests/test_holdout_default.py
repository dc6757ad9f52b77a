"""`convert --data D` holds out 1 in 4 samples by default and fails what only fits its calibration."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import model_from_text, run_cli

from npuprep.holdout import held_out_positions


@pytest.mark.parametrize(("count", "held"), [(1, []), (2, [1]), (3, [2]), (4, [3]),
                                             (8, [3, 7]), (9, [3, 7])])
def test_one_in_four_spread_over_the_set_at_least_one_of_two(count, held):
    assert held_out_positions(count) == held


def _exp_model(tmp_path, scales: list[float]):
    # x -> Exp -> y; sample i holds x in [0, scales[i]]
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 16] x) => (float[1, 16] y) { y = Exp(x) }
    """)
    path = tmp_path / "exp.onnx"
    path.write_bytes(model.SerializeToString())
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i, s in enumerate(scales):
        np.savez(data / f"s{i}.npz", x=rng.uniform(0, s, (1, 16)).astype(np.float32))
    return path, data


def test_default_holdout_reports_both_checks_and_no_holdout_verifies_on_all(tmp_path):
    path, data = _exp_model(tmp_path, [4.0] * 8)
    proc = run_cli("convert", path, "-t", "generic", "--data", data, "-o", tmp_path / "a.onnx",
                   "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["verification"]["samples"] == 6 and report["holdout"]["samples"] == 2
    assert any(n.startswith("held out 2 of 8 --data samples") for n in report["notes"])
    proc = run_cli("convert", path, "-t", "generic", "--data", data, "-o", tmp_path / "b.onnx",
                   "--no-holdout", "--json")
    report = json.loads(proc.stdout)
    assert report["verification"]["samples"] == 8 and report["holdout"] is None


def test_passing_on_calibration_and_failing_held_out_is_failed(tmp_path):
    # samples 3 and 7 (held out) reach x = 12, past exp's FP16 limit; calibration tops at 4
    path, data = _exp_model(tmp_path, [4.0, 4.0, 4.0, 12.0, 4.0, 4.0, 4.0, 12.0])
    proc = run_cli("convert", path, "-t", "generic", "--data", data, "-o", tmp_path / "a.onnx")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdict = " ".join(proc.stdout.split("\nFAILED: ")[-1].split())
    assert verdict.startswith("held-out samples fail (rel L2"), proc.stdout
    assert "where the calibration samples pass" in verdict
