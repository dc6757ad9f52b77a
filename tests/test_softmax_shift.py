"""The exact softmax max-shift, and its choice over a clamp on targets that cannot pin."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from npuprep.numerics import get_format
from npuprep.plan import Clamp, Plan
from npuprep.plan.softmax_shift import shifts_instead_of_clamps
from npuprep.profiles import load_profile
from npuprep.rewrite.softmax_shift import shift_softmax
from npuprep.runtime.session import make_session, run
from npuprep.verify.emulate import emulate
from tests.conftest import model_from_text

# x[2,6] -> Exp -> e -> ReduceSum(-1, keepdims) -> s ; Div(e, s) -> y
SOFTMAX = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2,6] x) => (float[2,6] y) <int64[1] ax = {-1}> {
  e = Exp(x)
  s = ReduceSum<keepdims=1>(e, ax)
  y = Div(e, s)
}
"""
# the same, but e is also an output: the shift would change it
LEAKY = SOFTMAX.replace("(float[2,6] y)", "(float[2,6] y, float[2,6] e)")


def test_the_shift_is_exact_and_keeps_fp16_finite():
    model = model_from_text(SOFTMAX)
    done = shift_softmax(model, _exp(model))
    assert done, done.reason
    x = np.random.default_rng(0).uniform(5, 20, (2, 6)).astype(np.float32)
    ref = run(make_session(model), {"x": x})["y"]
    np.testing.assert_allclose(run(make_session(done.model), {"x": x})["y"], ref, rtol=1e-6)
    fp16 = get_format("fp16")
    naive = run(make_session(emulate(model, fp16, saturate=False).model), {"x": x})["y"]
    shifted = run(make_session(emulate(done.model, fp16, saturate=False).model), {"x": x})["y"]
    assert not np.isfinite(naive).all()
    np.testing.assert_allclose(shifted, ref, rtol=5e-3, atol=1e-3)


def test_declines_when_the_exp_is_used_beyond_the_softmax():
    model = model_from_text(LEAKY)
    done = shift_softmax(model, _exp(model))
    assert not done and "used beyond the softmax" in done.reason


def test_only_a_target_that_cannot_pin_trades_the_clamp_for_the_shift():
    model = model_from_text(SOFTMAX)
    clamp = Clamp(tensor="x", lo=None, hi=10.4, kind="exp")
    plan = Plan(fingerprint="f", target="rk3588", precision="fp16", actions=(clamp,))
    kept, shifts = shifts_instead_of_clamps(model, plan, load_profile("generic"))
    assert kept is plan and shifts == ()
    kept, shifts = shifts_instead_of_clamps(model, plan, load_profile("rk3588"))
    assert kept.clamps() == [] and shifts == (_exp(model),)
    leaky = model_from_text(LEAKY)
    assert shifts_instead_of_clamps(leaky, replace(plan), load_profile("rk3588"))[1] == ()


def _exp(model) -> str:
    from npuprep.graph import node_label

    return next(node_label(n) for n in model.graph.node if n.op_type == "Exp")


def test_convert_for_rk3588_shifts_the_zoo_softmax_and_passes(tmp_path):
    """exp_logits: logits ~20 into Exp -> ReduceSum -> Div; a clamp at 10.4 would break it."""
    import onnx

    from npuprep.calibrate import calibrate
    from npuprep.convert import convert
    from npuprep.data import load_samples
    from npuprep.examples.zoo import ZOO
    from npuprep.model_io import load_model

    zoo = ZOO["exp_logits"]()
    onnx.save(zoo.model, str(tmp_path / "m.onnx"))
    (tmp_path / "d").mkdir()
    for i, s in enumerate(zoo.samples):
        np.savez(tmp_path / "d" / f"s{i}.npz", **s)
    model = load_model(tmp_path / "m.onnx")
    samples = load_samples(tmp_path / "d", model.proto)
    result = convert(model, load_profile("rk3588"), list(samples), stats=calibrate(model, samples))
    assert result.softmax_shifts == ("exp",)
    assert result.passed and result.output_check.outputs["y"]["rel_l2"] < 1e-2
