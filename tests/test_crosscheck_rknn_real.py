"""Crosscheck on error_analysis.txt files rknn-toolkit2 2.5.0 wrote (tests/fixtures/rknn)."""

from __future__ import annotations

from pathlib import Path

import pytest

from npuprep.crosscheck.check import crosscheck
from npuprep.crosscheck.names import NodeIndex
from npuprep.crosscheck.readers import read_report
from npuprep.examples.zoo import ZOO
from npuprep.model_io import Model, load_model
from npuprep.profiles import load_profile
from tests.conftest import run_cli

FIXTURES = Path(__file__).parent / "fixtures" / "rknn"
# conv_bn.onnx: x -> conv1 -> bn1 -> relu1 -> conv2 -> bn2 -> relu2 -> y


@pytest.fixture(scope="module")
def conv_bn() -> Model:
    return load_model(FIXTURES / "conv_bn.onnx")


def _layers(path: Path, model: Model) -> dict:
    return {r.layer: r for r in read_report(path, NodeIndex(model)).records}


def test_a_conv_fused_with_its_batchnorm_maps_to_both(conv_bn):
    layers = _layers(FIXTURES / "conv_bn_overflow.txt", conv_bn)
    assert layers["[Conv] bn1"].onnx_nodes == ("conv1", "bn1")
    assert layers["[Conv] bn2"].onnx_nodes == ("conv2", "bn2")
    assert layers["[Relu] y"].onnx_nodes == ("relu2",)
    assert layers["[Conv] bn2"].metrics["simulator_single_cos"] == "q_inf"
    assert layers["[Conv] bn2"].metrics["markers"] == ["q_inf"]
    assert layers["[Relu] r1"].metrics["simulator_entire_euc"] == pytest.approx(0.00454)


def test_q_inf_layers_are_never_ok_and_fail_the_run(conv_bn):
    report = read_report(FIXTURES / "conv_bn_overflow.txt", NodeIndex(conv_bn))
    result = crosscheck(conv_bn, report, load_profile("rk3588").resolve())
    verdicts = {v.node: v for v in result.verdicts}
    assert {n for n, v in verdicts.items() if v.verdict == "non-finite"} == {"conv2", "bn2", "relu2"}
    assert "the layer itself leaves the range" in verdicts["bn2"].reason
    assert verdicts["conv1"].verdict == "ok"
    assert not result


def test_the_finite_report_passes(conv_bn):
    report = read_report(FIXTURES / "conv_bn_ok.txt", NodeIndex(conv_bn))
    result = crosscheck(conv_bn, report, load_profile("rk3588").resolve())
    assert result and result.counts["non-finite"] == 0 and result.counts["ok"] == 6


@pytest.mark.parametrize("with_stats", [False, True])
def test_cli_exits_1_naming_the_non_finite_layers(tmp_path, with_stats):
    extra = []
    if with_stats:
        stats = tmp_path / "stats.json"
        done = run_cli("calibrate", FIXTURES / "conv_bn.onnx", "--synthetic", "2", "-o", stats)
        assert done.returncode == 0, done.stderr
        extra = ["--stats", str(stats)]
    done = run_cli("crosscheck", FIXTURES / "conv_bn.onnx", "--report",
                   FIXTURES / "conv_bn_overflow.txt", "--target", "rk3588", *extra)
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("FAILED: non-finite in the compiler's run:")
    assert "[Conv] bn2" in last and "[Relu] y" in last and "[Conv] bn1" not in last


def test_cli_passes_the_finite_report():
    done = run_cli("crosscheck", FIXTURES / "conv_bn.onnx", "--report",
                   FIXTURES / "conv_bn_ok.txt", "--target", "rk3588")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("PASSED")


def test_vendor_suffixes_and_instances_map_to_our_nodes(tmp_path):
    """h0_mm (Gemm as Conv), ln0#1, block0#2 (a node name), h1-rs-rs_tp (inserted reshapes)."""
    path = tmp_path / "model.onnx"
    import onnx

    onnx.save(ZOO["residual_outliers"]().model, str(path))
    model = load_model(path)
    layers = _layers(FIXTURES / "zoo_residual_outliers.txt", model)
    assert layers["[Conv] h0_mm"].onnx_nodes == ("embed",)
    assert layers["[exNorm] ln0#1"].onnx_nodes == ("ln0",)
    assert layers["[Conv] block0#2"].onnx_nodes == ("block0",)
    assert layers["[Add] h1-rs-rs_tp"].onnx_nodes == ("residual0",)
    assert "[Reshape] x_rs" not in layers  # the toolkit's reshape of a graph input
    # Named after the tensor it reads: the final LayerNorm, not the Add that wrote h2.
    assert layers["[exNorm] h2_tp_rs_sw"].onnx_nodes == ("ln_final",)
    assert layers["[Add] h2-rs"].onnx_nodes == ("residual1",)
    result = crosscheck(model, read_report(FIXTURES / "zoo_residual_outliers.txt",
                                           NodeIndex(model)), load_profile("rk3588").resolve())
    assert not result and result.counts["unmapped"] == 0
    assert {v.node for v in result.of("non-finite")} >= {"embed", "ln0", "residual0"}
