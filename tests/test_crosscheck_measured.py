"""Crosscheck and checklist from real calibration statistics (measured ranges)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli
from test_crosscheck_readers import norm_model

from npuprep.calibrate import calibrate, save_stats
from npuprep.crosscheck.checklist import build_checklist, scan_workspace
from npuprep.data import load_samples
from npuprep.model_io import load_model
from npuprep.profiles import load_profile


@pytest.fixture
def workspace(save, tmp_path):
    """The norm model calibrated on x = 300: x^2 = 9e4 leaves FP16 (max 65504)."""
    # x -> MatMul(I) -> Relu -> Mul(r, r) -> ReduceMean -> Add(eps) -> Sqrt -> Div(r, .) -> Exp -> y
    model_path = save(norm_model())
    model = load_model(model_path)
    data = tmp_path / "x.npz"
    np.savez(data, x=np.full((1, 4), 300.0, np.float32))
    ws = tmp_path / "ws"
    ws.mkdir()
    stats = calibrate(model, load_samples(data, model.proto))
    save_stats(stats, ws / "stats.json")
    return model_path, model, ws, stats


def test_measured_range_makes_a_node_sensitive(workspace, tmp_path):
    model_path, _, ws, stats = workspace
    assert stats.tensors["m"].absmax == pytest.approx(90000.0)
    report = tmp_path / "p.csv"
    # The static rules flag the square and the Sqrt (both FP32 here); only the measured
    # range says the ReduceMean of the squares (9e4) needs more than FP16.
    report.write_text("node,precision\n/norm/Mul,fp32\n/norm/ReduceMean,fp16\n/norm/Sqrt,fp32\n")
    without = run_cli("crosscheck", model_path, "-r", report, "-t", "orin", "--json")
    assert without.returncode == 0, without.stderr
    with_stats = run_cli("crosscheck", model_path, "-r", report, "-t", "orin", "--json",
                         "--stats", ws / "stats.json")
    assert with_stats.returncode == 1, with_stats.stderr
    verdict = {v["node"]: v for v in json.loads(with_stats.stdout)["verdicts"]}["/norm/ReduceMean"]
    assert verdict["verdict"] == "mismatch" and "range.overflow" in verdict["rules"]


def test_checklist_names_the_riskiest_tensors_from_workspace_stats(workspace):
    model_path, model, ws, _ = workspace
    checklist = build_checklist(model, load_profile("orin"), model_arg=str(model_path),
                                target_arg="orin", workspace=scan_workspace(ws), top_n=3)
    items = {i.key: i for i in checklist.items}
    assert items["calibrate"].done and "tensors observed" in items["calibrate"].evidence[0]
    risky = items["compare"].evidence[0]
    # s, m and v hold 9e4 (137% of 65504): named first, over the safe limit
    assert "`m` (/norm/ReduceMean): absmax 90000 = 137.4% of fp16 max OVER the safe limit" in risky
    assert "`d`" not in risky  # 300: not among the top 3
    assert any(s.startswith("on the board, dump these tensors for the fixed batch: m, s, v")
               for s in items["compare"].steps)
    shown = run_cli("checklist", model_path, "-t", "orin", "--workspace", ws)
    assert shown.returncode == 0, shown.stderr
    assert "`/norm/ReduceMean`" in shown.stdout  # measured finding joins the precision list
