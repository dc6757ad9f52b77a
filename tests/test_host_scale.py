"""Targets that cannot pin: every node emulated in FP16, output compensation moved to the host."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx
import pytest

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.data import load_samples
from npuprep.model_io import load_model
from npuprep.plan.host_scale import host_scaled_outputs, undo_host_scales
from npuprep.profiles import Pinning, load_profile
from npuprep.rewrite.output_scale import leave_output_scaled
from npuprep.runtime.session import make_session, run
from tests.conftest import model_from_text, run_cli, save_zoo

# x[2,4] -> MatMul(W) -> t -> Mul(t, f) -> y
SCALED = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2,4] x) => (float[2,3] y) <float[4,3] w = {{w}}, float f = {{f}}> {
  t = MatMul(x, w)
  y = Mul(t, f)
}
"""
W = "{" + ", ".join(str(v) for v in np.linspace(-2, 2, 12)) + "}"


def _text(f: str) -> str:
    return SCALED.replace("{{w}}", W).replace("{{f}}", "{" + f + "}")


def test_the_output_mul_moves_to_the_host_exactly():
    model = model_from_text(_text("4.0"))
    done = leave_output_scaled(model, "y")
    assert done and done.details["host_scales"] == {"y": 4.0}
    assert [n.op_type for n in done.model.graph.node] == ["MatMul"]
    onnx.checker.check_model(done.model)
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    before = run(make_session(model), {"x": x})["y"]
    after = run(make_session(done.model), {"x": x})
    np.testing.assert_array_equal(undo_host_scales(after, done.details["host_scales"])["y"], before)


@pytest.mark.parametrize(("text", "reason"), [
    (_text("3.0"), "constant scalar power of two"),
    ("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[2] x) => (float[2] y) { y = Relu(x) }""", "not made by a Mul"),
])
def test_declines_what_is_not_an_exact_output_compensation(text, reason):
    model = model_from_text(text)
    done = leave_output_scaled(model, "y")
    assert not done and reason in done.reason
    assert done.model is model


def test_only_targets_that_cannot_pin_scale_outputs_that_exceed_the_limit():
    rk = load_profile("rk3588")
    assert host_scaled_outputs(["y", "z"], {"y": 1.1e5, "z": 10.0}, rk.resolve()).keys() == {"y"}
    generic = load_profile("generic")
    assert generic.fp32_pinning is Pinning.PER_NODE
    assert host_scaled_outputs(["y"], {"y": 1.1e5}, generic.resolve()) == {}


@pytest.fixture(scope="module")
def guidance(tmp_path_factory):
    """x -> MatMul(Wc) -> eps_c, x -> MatMul(Wu) -> eps_u; y = eps_c + 7.5 (eps_c - eps_u) ~1e5"""
    tmp = tmp_path_factory.mktemp("guidance")
    _, data = save_zoo("guidance", tmp)
    model = load_model(tmp / "m.onnx")
    samples = load_samples(data, model.proto)
    return tmp, model, list(samples), calibrate(model, samples)


def test_convert_for_rk3588_scales_the_output_on_the_host_and_emulates_every_node(guidance):
    _, model, samples, stats = guidance
    result = convert(model, load_profile("rk3588"), samples, stats=stats)
    assert result.passed
    assert result.host_scales == {"y": 4.0}
    assert result.pinned_nodes == ()
    # The device output stays within FP16; times 4 it is the FP32 output.
    out = run(make_session(result.lowered.model), samples[0])["y"]
    assert np.abs(out).max() < 65504
    ref = run(make_session(model.proto), samples[0])["y"]
    assert np.abs(ref).max() > 65504
    np.testing.assert_allclose(undo_host_scales({"y": out}, result.host_scales)["y"], ref,
                               rtol=2e-2, atol=float(np.abs(ref).max()) * 2e-3)


def test_the_same_target_with_pinning_keeps_the_compensation_in_fp32(guidance):
    """generic pins the output's compensating Mul; a copy that cannot pin scales on the host."""
    _, model, samples, stats = guidance
    generic = load_profile("generic")
    pinned = convert(model, generic, samples, stats=stats)
    assert pinned.passed and pinned.host_scales == {} and pinned.pinned_nodes
    cannot = replace(generic, fp32_pinning=Pinning.NONE)
    result = convert(model, cannot, samples, stats=stats)
    assert result.passed and result.host_scales == {"y": 4.0} and result.pinned_nodes == ()


def test_cli_writes_the_host_scale_into_report_and_constraint_files(guidance, tmp_path):
    src = guidance[0]
    done = run_cli("convert", src / "m.onnx", "--target", "rk3588", "--data", src / "data",
                   "-o", tmp_path / "out.onnx", "--export", "rknn,yaml", "-v")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads((tmp_path / "out.report.json").read_text())["host_scales"] == {"y": 4.0}
    for name in ("out.rknn.yaml", "out.precision.yaml"):
        assert 'host_scales:\n  "y": 4.0' in (tmp_path / name).read_text()
    assert "multiply it by 4 on the host" in done.stdout


def test_compare_refuses_a_pin_on_a_target_that_cannot_pin(guidance):
    src = guidance[0]
    done = run_cli("compare", src / "m.onnx", "--emulate", "--target", "rk3588",
                   "--pin", "guide", "--data", src / "data")
    assert done.returncode == 2 and "cannot keep nodes in FP32" in done.stderr
