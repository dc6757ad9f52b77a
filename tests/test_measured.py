"""Measured findings: abs-max against the format's max and headroom, underflow, non-finite values."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from conftest import run_cli

from npuprep.analyse.measured import measured_findings
from npuprep.calibrate import calibrate, save_stats
from npuprep.data import load_samples
from npuprep.errors import NpuprepError
from npuprep.model_io import load_model
from npuprep.profiles import Severity, load_profile

# x -> MatMul(x, W=1000*I) -> y ;  x -> Mul(x, 1e-6) -> tiny ;  x -> Log -> lg (-Inf at 0, NaN below)
MODEL = """
<ir_version: 8, opset_import: ["" : 18]>
g (float[1,4] x) => (float[1,4] y, float[1,4] tiny, float[1,4] lg) {
    w = Constant<value = float[4,4] {1000,0,0,0, 0,1000,0,0, 0,0,1000,0, 0,0,0,1000}>()
    y = MatMul(x, w)
    c = Constant<value = float {1e-6}>()
    tiny = Mul(x, c)
    lg = Log(x)
}
"""


@pytest.fixture
def measure(save, tmp_path):
    path = save(MODEL)
    model = load_model(path)

    def _measure(rows: list[list[float]]):
        folder = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        for i, r in enumerate(rows):
            np.savez(folder / f"{i}.npz", x=np.array([r], np.float32))
        return model, calibrate(model, load_samples(str(folder), model.proto))

    return _measure


def by_rule(findings, tensor: str) -> dict[str, object]:
    return {f.rule: f for f in findings if f.tensor == tensor}


def test_fp16_overflow_headroom_and_quiet_tensors(measure):
    profile = load_profile("generic")
    model, stats = measure([[100.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0], [2.0, 1.0, 1.0, 1.0]])
    f = measured_findings(model, profile.resolve(), stats)
    over = by_rule(f, "y")["range.overflow"]
    assert over.severity is Severity.ERROR and over.op_type == "MatMul" and over.remedy == "rescale"
    assert over.evidence["absmax"] == 100000.0 and over.evidence["format_max"] == 65504.0
    assert over.evidence["count_above_max"] == 1 and over.evidence["share_above_max"] == 1 / 12
    assert over.evidence["samples_above_max"] == 1 and "single outlier" in over.message
    assert not f  # an error-level finding makes the collection falsy
    # 40 * 1000 = 40000 lies between headroom x max (32752) and max.
    model, stats = measure([[40.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    head = by_rule(measured_findings(model, profile.resolve(), stats), "y")
    assert set(head) == {"range.headroom"} and head["range.headroom"].severity is Severity.WARNING
    assert head["range.headroom"].evidence["limit"] == 0.5 * 65504
    assert head["range.headroom"].evidence["share_above_limit"] == pytest.approx(1 / 8)
    model, stats = measure([[3.0, 1.0, 2.0, 3.0]])
    assert "y" not in {x.tensor for x in measured_findings(model, profile.resolve(), stats)}


def test_precision_fp8_e4m3_checks_against_448(measure):
    profile = load_profile("generic")
    model, stats = measure([[0.5, 1.0, 2.0, 3.0]])
    assert "range.overflow" not in by_rule(measured_findings(model, profile.resolve(), stats), "y")
    fp8 = by_rule(measured_findings(model, profile.resolve("fp8_e4m3"), stats), "y")["range.overflow"]
    assert fp8.evidence["format"] == "fp8_e4m3" and fp8.evidence["format_max"] == 448.0
    assert fp8.evidence["count_above_max"] == 4
    with pytest.raises(NpuprepError, match="unknown number format"):
        measured_findings(model, profile.resolve("fp7"), stats)


def test_underflow_and_nonfinite_values(measure):
    profile = load_profile("generic")
    model, stats = measure([[0.0, 1.0, 2.0, 3.0], [5.0, 1.0, 2.0, 3.0]])
    f = measured_findings(model, profile.resolve(), stats)
    under = by_rule(f, "tiny")["range.underflow"]
    # 1e-6 .. 5e-6: every nonzero value is below FP16's 6.1e-5.
    assert under.evidence["share_below_min_normal"] == 1.0 and under.evidence["count_below_min_normal"] == 7
    assert under.severity is Severity.WARNING
    assert "range.underflow" not in by_rule(measured_findings(model, profile.resolve("bf16"), stats), "tiny")
    nonfinite = by_rule(f, "lg")["range.nonfinite"]
    assert nonfinite.evidence["inf_count"] == 1 and nonfinite.severity is Severity.ERROR


def test_severities_follow_the_profile(measure):
    profile = load_profile("generic")
    relaxed = dataclasses.replace(profile, severity={**profile.severity, "overflow": Severity.WARNING})
    model, stats = measure([[100.0, 1.0, 2.0, 3.0]])
    assert by_rule(measured_findings(model, relaxed.resolve(), stats), "y")["range.overflow"].severity is Severity.WARNING


def test_check_cli_with_data_stats_precision_and_synthetic(save, tmp_path):
    model = save(MODEL)
    np.savez(tmp_path / "hot.npz", x=np.array([[100.0, 1.0, 2.0, 3.0]], np.float32))
    np.savez(tmp_path / "cool.npz", x=np.array([[0.3, 1.0, 2.0, 3.0]], np.float32))
    r = run_cli("check", model, "--target", "generic", "--data", tmp_path / "hot.npz", "--json")
    assert r.returncode == 1, r.stderr
    rules = {(f["rule"], f["tensor"]) for f in json.loads(r.stdout)["findings"]}
    assert ("range.overflow", "y") in rules
    cool = run_cli("check", model, "--target", "generic", "--data", tmp_path / "cool.npz", "--json")
    assert ("range.overflow", "y") not in {(f["rule"], f["tensor"]) for f in json.loads(cool.stdout)["findings"]}
    loaded = load_model(model)
    stats = calibrate(loaded, load_samples(str(tmp_path / "cool.npz"), loaded.proto))
    save_stats(stats, tmp_path / "cool.json")
    fp8 = run_cli("check", model, "--target", "generic", "--stats", tmp_path / "cool.json",
                  "--precision", "fp8_e4m3", "--json")
    found = {(f["rule"], f["tensor"]): f for f in json.loads(fp8.stdout)["findings"]}
    assert fp8.returncode == 1 and found[("range.overflow", "y")]["evidence"]["format_max"] == 448.0
    syn = run_cli("check", model, "--target", "generic", "--synthetic", "2", "--json")
    measured = [f for f in json.loads(syn.stdout)["findings"] if f["rule"].startswith("range.")]
    assert measured and all(f["evidence"]["synthetic"] for f in measured)
    assert all("synthetic samples" in f["message"] for f in measured)
    lonely = run_cli("check", model, "--target", "generic", "--precision", "fp8_e4m3")
    assert lonely.returncode == 2 and "--precision" in lonely.stderr


def test_additive_masks_are_one_warning_and_log_of_zero_stays_an_error(save, tmp_path):
    # scores + mask(0 / -inf constant) -> masked (-inf where masked) -> Softmax -> p ;  x -> Log -> lg (-Inf at 0)
    path = save("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[1,4] x) => (float[1,4] p, float[1,4] lg) {
            mask = Constant<value = float[1,4] {0, 0, -inf, -inf}>()
            masked = Add(x, mask)
            p = Softmax(masked)
            lg = Log(x)
        }
    """)
    model = load_model(path)
    folder = tmp_path / "d"
    folder.mkdir()
    for i, row in enumerate([[0.0, 1.0, 2.0, 3.0], [5.0, 1.0, 2.0, 3.0]]):
        np.savez(folder / f"{i}.npz", x=np.array([row], np.float32))
    stats = calibrate(model, load_samples(str(folder), model.proto))
    found = measured_findings(model, load_profile("a2000").resolve(), stats)
    masks = [f for f in found if f.rule == "range.mask"]
    assert len(masks) == 1 and masks[0].severity is Severity.WARNING
    assert masks[0].evidence["tensors"] == ["masked"]  # constants are not calibrated
    nonfinite = [f for f in found if f.rule == "range.nonfinite"]
    assert [f.tensor for f in nonfinite] == ["lg"] and nonfinite[0].severity is Severity.ERROR
