"""`convert --data D` holds out 1 in 4 samples by default and fails what only fits its calibration."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import model_from_text, run_cli

from npuprep.holdout import held_out_positions, louder_inputs


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
    # The range the plan never saw is named, with the numbers behind it.
    said = verdict.split("held-out input 'x' reaches ")[1]
    ratio = float(said.split("x the calibration samples' largest |value|")[0])
    peaks = [float(np.abs(np.load(data / f"s{i}.npz")["x"]).max()) for i in range(8)]
    assert ratio == pytest.approx(max(peaks[3], peaks[7]) / max(peaks[:3] + peaks[4:7]), rel=0.05)


def test_louder_inputs_names_float_inputs_past_twice_the_calibration_range():
    # x: 0.0077 -> 0.32 (41x, named); y: 1 -> 1.5 (not past 2x); ids: integers (never)
    calib = [{"x": np.float32([0.0077, -0.001]), "y": np.float32([1.0]), "ids": np.int64([1])}]
    held = [{"x": np.float32([-0.32]), "y": np.float32([1.5]), "ids": np.int64([900])}]
    assert louder_inputs(calib, held) == {"x": (pytest.approx(0.0077), pytest.approx(0.32))}
    silent = [{"x": np.zeros(2, np.float32)}]
    assert louder_inputs(silent, [{"x": np.float32([0.5])}]) == {"x": (0.0, 0.5)}
    assert louder_inputs(held, calib) == {}


def test_holdout_that_overlaps_data_is_refused_with_one_line(tmp_path):
    # --holdout data/ (the --data folder itself), one of its files, a copy of one: exit 2
    path, data = _exp_model(tmp_path, [4.0] * 4)
    (tmp_path / "copy.npz").write_bytes((data / "s1.npz").read_bytes())
    for holdout in (data, data / "s2.npz", tmp_path / "copy.npz"):
        proc = run_cli("convert", path, "-t", "generic", "--data", data, "--holdout", holdout,
                       "-o", tmp_path / "a.onnx")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "a held-out check needs samples the plan has not seen" in lines[0]
        assert lines[0].split(f"{holdout}: ", 1)[1].startswith(
            "every sample equals a --data sample in value" if holdout.name == "copy.npz" else
            f"1 sample ({holdout.name})" if holdout.suffix else "4 samples (s0.npz, s1.npz and 2 more)")
        assert not (tmp_path / "a.onnx").exists()


def test_stats_that_saw_the_held_out_samples_make_no_held_out_claim(tmp_path):
    # calibrate on all 8 --data samples, then convert --stats with --data: the 2 the split would
    # hold out were calibrated on, so nothing is held out and the notes say why
    path, data = _exp_model(tmp_path, [4.0] * 8)
    stats = tmp_path / "s.json"
    assert run_cli("calibrate", path, "--data", data, "-o", stats).returncode == 0
    proc = run_cli("convert", path, "-t", "generic", "--data", data, "--stats", stats,
                   "-o", tmp_path / "a.onnx", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["holdout"] is None and report["verification"]["samples"] == 8
    assert not any("calibrated and planned on the other" in n for n in report["notes"])
    assert any(n.startswith("no held-out check: the --stats were calibrated on the --data samples "
                            "that would be held out (2 samples (s3.npz, s7.npz))") for n in report["notes"])
    # --holdout data/s3.npz with --data of other samples is refused: the stats saw it
    other = tmp_path / "other"
    other.mkdir()
    for i in (0, 1):
        np.savez(other / f"o{i}.npz", x=np.full((1, 16), 2.0, np.float32))
    proc = run_cli("convert", path, "-t", "generic", "--data", other, "--stats", stats,
                   "--holdout", data / "s3.npz", "-o", tmp_path / "b.onnx")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "among the samples the --stats were calibrated on" in lines[0]


def test_stats_calibrated_on_the_other_samples_keep_the_held_out_check(tmp_path):
    # stats of the 6 samples the split keeps: the 2 held out are unseen; the note says the
    # plan came from the --stats, not from calibrating on the other 6
    path, data = _exp_model(tmp_path, [4.0] * 8)
    kept = tmp_path / "kept"
    kept.mkdir()
    for i in (0, 1, 2, 4, 5, 6):
        (kept / f"s{i}.npz").write_bytes((data / f"s{i}.npz").read_bytes())
    stats = tmp_path / "s.json"
    assert run_cli("calibrate", path, "--data", kept, "-o", stats).returncode == 0
    proc = run_cli("convert", path, "-t", "generic", "--data", data, "--stats", stats,
                   "-o", tmp_path / "a.onnx", "--json")
    report = json.loads(proc.stdout)
    assert report["holdout"]["samples"] == 2
    said = next(n for n in report["notes"] if n.startswith("held out 2 of 8"))
    assert "planned on the --stats given" in said and "calibrated and planned" not in said


def test_held_out_feeds_equal_to_calibration_feeds_are_refused_through_the_api(tmp_path):
    # convert(samples=[a, b], holdout=[copy of b]): feeds in memory compared by value; all
    # equal is refused, some equal is said
    from npuprep.errors import NpuprepError
    from npuprep.model_io import load_model
    from npuprep.pipeline import convert
    from npuprep.profiles import load_profile

    path, _ = _exp_model(tmp_path, [1.0])
    a, b = ({"x": np.full((1, 16), v, np.float32)} for v in (1.0, 2.0))
    with pytest.raises(NpuprepError, match=r"--holdout \(feeds\): every sample equals a --data"):
        convert(load_model(path), load_profile("generic"), [a, b], holdout=[{"x": b["x"].copy()}])
    # one of two held-out feeds repeats a calibration feed (real data does): verified, and said
    other = convert(load_model(path), load_profile("generic"), [a, b],
                    holdout=[{"x": np.full((1, 16), 3.0, np.float32)}, {"x": a["x"].copy()}])
    assert other.holdout is not None and other.holdout.samples == 2
    assert other.notes[0] == ("1 sample (1) of --holdout equal --data samples in value: they "
                              "check nothing the calibration samples do not")
