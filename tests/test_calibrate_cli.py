"""`npuprep calibrate` end to end: data forms, bad data (exit 2), synthetic marking, refusal."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli
from polygraphy.json import save_json

# x -> Mul(x, x) -> sq -> Add(sq, b) -> y ; b = 1
MODEL = """
<ir_version: 8, opset_import: ["" : 18]>
g (float[2,3] x) => (float[2,3] y) {
    b = Constant<value = float {1.0}>()
    sq = Mul(x, x)
    y = Add(sq, b)
}
"""


def feeds(n: int) -> list[dict[str, np.ndarray]]:
    return [{"x": (np.arange(6, dtype=np.float32).reshape(2, 3) - 2) * (i + 1) * 30} for i in range(n)]


@pytest.fixture
def data(tmp_path):
    folder = tmp_path / "dir"
    folder.mkdir()
    for i, f in enumerate(feeds(3)):
        np.savez(folder / f"{i}.npz", **f)
    np.savez(tmp_path / "batch.npz", x=np.stack([f["x"] for f in feeds(3)]))
    save_json(feeds(3), str(tmp_path / "inputs.json"))
    return tmp_path


def test_every_data_form_gives_the_same_stats(save, data):
    model = save(MODEL)
    results = []
    for args in ([str(data / "dir")], [str(data / "batch.npz"), "--batched"], [str(data / "inputs.json")]):
        out = data / f"stats{len(results)}.json"
        r = run_cli("calibrate", model, "--data", *args, "-o", out, "--json")
        assert r.returncode == 0, r.stderr
        printed = json.loads(r.stdout)
        written = json.loads(out.read_text())
        assert printed["tensors"] == written["tensors"] and written["kind"] == "stats"
        assert written["schema_version"] == 2 and written["synthetic"] is False
        results.append(written["tensors"])
    assert results[0] == results[1] == results[2]
    sq = results[0]["sq"]
    assert sq["max"] == 72900.0 and sq["count"] == 18 and sq["per_sample_absmax"] == [8100.0, 32400.0, 72900.0]
    squares = np.concatenate([f["x"].ravel() ** 2 for f in feeds(3)])
    assert sq["over"] == {"bf16": 0, "fp16": int((squares > 65504).sum()), "fp8_e4m3": int((squares > 448).sum()),
                          "fp8_e5m2": int((squares > 57344).sum())}
    assert sq["over"]["fp16"] == 1
    assert "\x1b" not in r.stdout and "calibrating" not in r.stderr  # no progress bar when piped


def test_table_names_the_tensors_nearest_the_limits(save, data):
    r = run_cli("calibrate", save(MODEL), "--data", data / "dir", "--top", "2")
    assert r.returncode == 0, r.stderr
    assert "Tensors nearest the limits" in r.stdout
    # Piped: a plain table, its rows under the dashed rule, the tensor name first.
    lines = r.stdout.splitlines()
    rule = next(i for i, ln in enumerate(lines) if ln.startswith("---"))
    assert lines[rule - 1].split()[:2] == ["tensor", "abs-max"]
    assert [ln.split()[0] for ln in lines[rule + 1:rule + 3]] == ["y", "sq"]
    assert "SYNTHETIC" not in r.stdout


def test_synthetic_samples_are_marked_in_stats_and_report(save, tmp_path):
    model = save(MODEL)
    out = tmp_path / "s.json"
    r = run_cli("calibrate", model, "--synthetic", "4", "--seed", "3", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "SYNTHETIC" in r.stdout
    written = json.loads(out.read_text())
    assert written["synthetic"] is True and "synthetic" in written["samples"] and written["sample_count"] == 4
    again = run_cli("calibrate", model, "--synthetic", "4", "--seed", "3", "--jobs", "2", "--json")
    assert json.loads(again.stdout)["tensors"] == written["tensors"]
    auto = run_cli("calibrate", model, "--synthetic", "4", "--seed", "3", "--jobs", "auto", "--json")
    assert json.loads(auto.stdout)["tensors"] == written["tensors"]


def test_jobs_must_be_a_count_or_auto(save):
    r = run_cli("calibrate", save(MODEL), "--synthetic", "2", "--jobs", "-1")
    assert r.returncode == 2 and "expected a count >= 0 or 'auto'" in r.stderr


@pytest.mark.parametrize(
    ("feed", "message"),
    [
        ({"x": np.zeros((2, 3), np.float32), "z": np.zeros(2, np.float32)}, "unknown input 'z'"),
        ({"y": np.zeros((2, 3), np.float32)}, "missing input 'x'"),
        ({"x": np.zeros((3, 3), np.float32)}, "input 'x' has shape (3, 3)"),
        ({"x": np.zeros((2, 3), np.int32)}, "input 'x' has dtype int32"),
        ({"x": np.array([[1, 2, np.nan], [0, 0, 0]], np.float32)}, "input 'x' holds 1 NaN"),
    ],
)
def test_bad_data_is_one_line_and_exit_2(save, tmp_path, feed, message):
    bad = tmp_path / "bad.npz"
    np.savez(bad, **feed)
    out = tmp_path / "never.json"
    r = run_cli("calibrate", save(MODEL), "--data", bad, "-o", out)
    assert r.returncode == 2
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "bad.npz" in err and message in err
    assert not out.exists()


def test_stats_from_another_model_are_refused_by_check(save, tmp_path, data):
    out = tmp_path / "stats.json"
    assert run_cli("calibrate", save(MODEL), "--data", data / "dir", "-o", out).returncode == 0
    other = save(MODEL.replace("float {1.0}", "float {2.0}"), "other.onnx")
    r = run_cli("check", other, "--target", "generic", "--stats", out)
    assert r.returncode == 2
    assert "another model" in r.stderr and len(r.stderr.strip().splitlines()) == 1
