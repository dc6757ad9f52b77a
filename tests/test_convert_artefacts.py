"""Artefacts on request: model, plan and reports always; constraint files for the target's compiler or --export.

ConversionResult.save writes what the CLI writes, and a light (weights="file") model with
external data converts.
"""

from __future__ import annotations

import json

import onnx
from conftest import run_cli

from npuprep.convert import CALIBRATE, SPLIT, convert
from npuprep.data import load_samples
from npuprep.examples import example_data_dir, example_model_path
from npuprep.model_io import load_model
from npuprep.profiles import load_profile


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_api_save_on_a_light_external_data_model_writes_what_the_cli_writes(tmp_path):
    # example planner saved with its weights in m.onnx.data -> load_model(weights="file") -> convert -> save
    src = tmp_path / "src"
    src.mkdir()
    onnx.save(onnx.load(str(example_model_path())), str(src / "m.onnx"), save_as_external_data=True,
              location="m.onnx.data", size_threshold=64)
    model = load_model(src / "m.onnx", weights="file")
    samples = load_samples(str(example_data_dir()), model.proto)
    # what the CLI does with --data: 1 in 4 held out, calibrated on the rest
    result = convert(model, load_profile("orin"), samples, holdout=SPLIT, stats=CALIBRATE)
    assert result
    report = result.save(tmp_path / "api" / "m.orin.onnx")
    assert _names(tmp_path / "api") == ["m.orin.onnx", "m.orin.plan.yaml", "m.orin.report.json",
                                        "m.orin.report.md", "m.orin.trtexec.txt"]
    assert set(report["artefacts"]) == {"model", "plan", "trtexec", "report_json", "report_md"}
    cli = run_cli("convert", src / "m.onnx", "-t", "orin", "--data", example_data_dir(),
                  "-o", tmp_path / "cli" / "m.orin.onnx")
    assert cli.returncode == 0, cli.stderr
    assert _names(tmp_path / "cli") == _names(tmp_path / "api")
    assert (tmp_path / "cli" / "m.orin.onnx").read_bytes() == (tmp_path / "api" / "m.orin.onnx").read_bytes()


def test_export_names_the_constraint_files(tmp_path):
    out = tmp_path / "o" / "p.onnx"
    r = run_cli("convert", example_model_path(), "-t", "orin", "--data", example_data_dir(), "-o", out,
                "--export", "horizon,yaml")
    assert r.returncode == 0, r.stderr
    assert _names(out.parent) == ["p.horizon.yaml", "p.onnx", "p.plan.yaml", "p.precision.yaml",
                                  "p.report.json", "p.report.md"]
    # a2000's compiler reads the generic precision list.
    a = tmp_path / "a" / "p.onnx"
    assert run_cli("convert", example_model_path(), "-t", "a2000", "--data", example_data_dir(),
                   "-o", a).returncode in (0, 1)
    assert "p.precision.yaml" in _names(a.parent) and "p.trtexec.txt" not in _names(a.parent)
    bad = run_cli("convert", example_model_path(), "-t", "orin", "--data", example_data_dir(),
                  "-o", tmp_path / "b" / "p.onnx", "--export", "trt,bogus")
    assert bad.returncode == 2 and "'bogus'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


def test_plan_only_default_is_not_the_path_convert_writes(tmp_path):
    r = run_cli("convert", example_model_path(), "-t", "orin", "--data", example_data_dir(), "--plan-only",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert _names(tmp_path) == ["planner.orin.draft.plan.yaml"]


def test_a_new_conversion_replaces_the_whole_set_an_older_one_left(tmp_path):
    # convert -t orin -o out.onnx (out.trtexec.txt) -> convert -t a2000 --export rknn: the
    # trtexec file (listed by the older report) goes; a user's own out.horizon.yaml stays
    out = tmp_path / "out.onnx"
    assert run_cli("convert", "-t", "orin", "-o", out).returncode == 0
    assert (tmp_path / "out.trtexec.txt").is_file()
    (tmp_path / "out.horizon.yaml").write_text("node_info: {}  # mine\n")
    proc = run_cli("convert", "-t", "a2000", "--export", "rknn", "-o", out, "--json")
    assert proc.returncode == 0, proc.stderr
    assert _names(tmp_path) == ["out.horizon.yaml", "out.onnx", "out.plan.yaml", "out.report.json",
                                "out.report.md", "out.rknn.yaml"]
    assert set(json.loads(proc.stdout)["artefacts"]) == {"model", "plan", "rknn_custom_quantize_layers",
                                                         "report_json", "report_md"}
    # without the older report: the rknn file npuprep wrote for out.onnx is recognised by its
    # header, the trtexec file by the model it builds
    (tmp_path / "out.report.json").unlink()
    (tmp_path / "out.trtexec.txt").write_text("trtexec --onnx=out.onnx --fp16\n")
    assert run_cli("convert", "-t", "generic", "-o", out, "--export", "none").returncode == 0
    assert _names(tmp_path) == ["out.horizon.yaml", "out.onnx", "out.plan.yaml", "out.report.json",
                                "out.report.md"]
