"""One pipeline: the Python API and the CLI give the same conversion, and every conversion records what it did."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import model_from_text, run_cli

from npuprep.calibrate import calibrate
from npuprep.data import load_samples
from npuprep.examples import example_data_dir, example_model_path
from npuprep.json_io import dump_json
from npuprep.model_io import load_model
from npuprep.pipeline import CALIBRATE, SPLIT, STAGES, convert
from npuprep.profiles import load_profile
from npuprep.provenance import read_conversion, stats_fingerprint

# What differs between two runs of one conversion: where they wrote, what they cost.
_RUN_KEYS = ("output", "artefacts", "resources")


def test_the_stages_are_declared_in_order():
    assert [s.__name__ for s in STAGES] == ["hold_out", "goal", "calibrate", "plan", "build",
                                            "vendor_check", "user_load", "verdict", "record"]


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_api_and_cli_give_the_same_model_verdict_and_report(tmp_path, precision):
    # bundled example -> convert(holdout=SPLIT, stats=CALIBRATE).save -> files; `npuprep convert
    # --target a2000 --precision P` -> files: the same model bytes, verdict and report
    model = load_model(example_model_path(), weights="file")
    samples = load_samples(str(example_data_dir()), model.proto)
    result = convert(model, load_profile("a2000"), samples, holdout=SPLIT, stats=CALIBRATE,
                     precision=precision)
    api = result.save(tmp_path / "api" / "m.onnx")
    proc = run_cli("convert", "-t", "a2000", "--precision", precision, "-o", tmp_path / "cli" / "m.onnx")
    assert proc.returncode == (0 if result.passed else 1), proc.stdout + proc.stderr
    cli = json.loads((tmp_path / "cli" / "m.report.json").read_text())
    assert (tmp_path / "cli" / "m.onnx").read_bytes() == (tmp_path / "api" / "m.onnx").read_bytes()
    assert cli["verdict"] == api["verdict"] == result.verdict.to_dict()
    assert {k: v for k, v in cli.items() if k not in _RUN_KEYS} == \
        json.loads(dump_json({k: v for k, v in api.items() if k not in _RUN_KEYS}))
    # The report path may wrap onto its own line (100 columns): compare the words.
    assert f"{result.verdict.said}; report: " in " ".join(proc.stdout.split()) + " "
    # the CLI's report adds what the run cost (`- run: 1 s, peak ...` and its time by stage)
    md = {w: [line.replace(str(tmp_path / w), "X") for line in
              _without_run_cost((tmp_path / w / "m.report.md").read_text().splitlines())]
          for w in ("api", "cli")}
    assert md["api"] == md["cli"]
    # 16 samples: 1 in 4 held out
    assert cli["holdout"]["samples"] == 4 and len(cli["samples"]["holdout_ids"]) == 4


def _without_run_cost(lines: list[str]) -> list[str]:
    """A report's lines less what the run cost: its `- run:` line and its Time by stage."""
    kept, timing = [], False
    for line in lines:
        if line.startswith("## "):
            timing = line == "## Time by stage"
        if not timing and not line.startswith("- run:"):
            kept.append(line)
    return kept


def test_every_conversion_records_what_it_did_in_the_model(tmp_path):
    # the example to int8 (calibrated in the run, 1 in 4 held out) and x -> Exp to fp16 on
    # given stats, failing a tight rtol: each saved model carries its plan, samples, gates and
    # verdict
    model = load_model(example_model_path())
    samples = load_samples(str(example_data_dir()), model.proto)
    result = convert(model, load_profile("orin"), samples, holdout=SPLIT, stats=CALIBRATE,
                     precision="int8")
    report = result.save(tmp_path / "e.onnx")
    record = read_conversion(onnx.load(str(tmp_path / "e.onnx")))
    assert record is not None and record.to_dict() == json.loads(dump_json(result.record))
    assert (record.target, record.precision, record.passed) == ("orin", "int8", report["passed"])
    assert record.plan == json.loads(dump_json(report["plan"])) and record.plan["eight_bit"]
    assert record.holdout_ids == tuple(f"sample_{i:03d}.npz" for i in (3, 7, 11, 15))
    assert set(record.calibration_ids).isdisjoint(record.holdout_ids)
    assert len(record.calibration_ids) == 12 and record.stats_fingerprint is None
    assert record.gates.rtol == 5e-2 and record.gates.min_8bit_share == 0.5
    assert record.gates.max_fp32_share is None

    onnx.save(model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1, 4] x) => (float[1, 4] y) { y = Exp(x) }
    """), str(tmp_path / "exp.onnx"))
    exp = load_model(tmp_path / "exp.onnx")
    feeds = [{"x": np.linspace(0.1, 3.0, 4, dtype=np.float32).reshape(1, 4)}]
    stats = calibrate(exp, feeds)
    # FP16 rounds exp's outputs by ~5e-4: a 1e-6 tolerance fails them
    failed = convert(exp, load_profile("generic"), feeds, stats=stats, rtol=1e-6, max_rounds=1)
    failed.save(tmp_path / "x.onnx")
    # a FAILED model is written beside the requested name, never under it
    assert not (tmp_path / "x.onnx").exists()
    record = read_conversion(onnx.load(str(tmp_path / "x.FAILED.onnx")))
    assert not failed and record is not None and not record.passed
    assert record.cause == failed.verdict.said.removeprefix("FAILED: ") and record.cause
    assert record.stats_fingerprint == stats_fingerprint(stats.to_dict())
    assert record.gates.max_fp32_share == 0.1 and record.gates.rtol == 1e-6
