"""A written-out softmax on a target that cannot pin: the planner's exact max shift, never a clamp."""

from __future__ import annotations

import numpy as np
import onnx

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.data import load_samples
from npuprep.examples.zoo import ZOO
from npuprep.model_io import load_model
from npuprep.plan.actions import SoftmaxShift
from npuprep.profiles import load_profile


def test_convert_for_rk3588_shifts_the_zoo_softmax_and_passes(tmp_path):
    """exp_logits: logits ~20 into Exp -> ReduceSum -> Div; a clamp at 10.4 would break it,
    and rk3588 runs every node in FP16, so the shift must hold in FP16 too."""
    zoo = ZOO["exp_logits"]()
    onnx.save(zoo.model, str(tmp_path / "m.onnx"))
    (tmp_path / "d").mkdir()
    for i, s in enumerate(zoo.samples):
        np.savez(tmp_path / "d" / f"s{i}.npz", **s)
    model = load_model(tmp_path / "m.onnx")
    samples = load_samples(tmp_path / "d", model.proto)
    result = convert(model, load_profile("rk3588"), list(samples), stats=calibrate(model, samples))
    assert [a.exp for a in result.plan.actions if isinstance(a, SoftmaxShift)] == ["exp"]
    assert not result.plan.clamps()
    assert result.passed and result.output_check.outputs["y"]["rel_l2"] < 1e-2
