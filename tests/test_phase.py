"""A timestep embedding `Sin(t * freq)` with t up to 1000: the phase and Sin/Cos stay FP32."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.analyse import findings_for
from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.model_io import Model
from npuprep.plan.actions import Hazard
from npuprep.plan.plan import load_plan, save_plan
from npuprep.plan.planner import make_plan
from npuprep.profiles import load_profile

HALF = 16


def _embedding() -> onnx.ModelProto:
    # t -> Mul(freqs) -> Sin | Cos -> Concat -> MatMul -> Sigmoid*x -> MatMul -> y
    rng = np.random.default_rng(0)
    freqs = np.exp(-np.log(10000.0) * np.arange(HALF) / HALF).reshape(1, HALF)
    inits = [numpy_helper.from_array(freqs.astype(np.float32), "freqs"),
             numpy_helper.from_array(rng.standard_normal((2 * HALF, 32)).astype(np.float32) * 0.2,
                                     "w1"),
             numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32) * 0.2, "w2")]
    nodes = [
        helper.make_node("Mul", ["t", "freqs"], ["phase"], name="phase_mul"),
        helper.make_node("Sin", ["phase"], ["s"], name="sin"),
        helper.make_node("Cos", ["phase"], ["c"], name="cos"),
        helper.make_node("Concat", ["s", "c"], ["emb"], name="emb", axis=1),
        helper.make_node("MatMul", ["emb", "w1"], ["h"], name="lin1"),
        helper.make_node("Sigmoid", ["h"], ["g"], name="gate"),
        helper.make_node("Mul", ["h", "g"], ["a"], name="silu"),
        helper.make_node("MatMul", ["a", "w2"], ["y"], name="lin2"),
    ]
    graph = helper.make_graph(nodes, "timestep_embedding",
                              [helper.make_tensor_value_info("t", TensorProto.FLOAT, [4, 1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _timesteps(n: int, seed: int, top: float = 1000.0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"t": rng.uniform(0, top, (4, 1)).astype(np.float32)} for _ in range(n)]


def _model() -> Model:
    return Model(proto=_embedding(), path="embedding.onnx", digest="embedding")


def test_timestep_embedding_passes_on_held_out_timesteps():
    # t in [0, 1000]: phase_mul, sin, cos pinned from the measured phase; held-out t pass
    model, samples = _model(), _timesteps(6, 1)
    result = convert(model, load_profile("generic"), samples, stats=calibrate(model, samples),
                     holdout=_timesteps(4, 2), max_fp32_share=1.0)
    assert {"phase_mul", "sin", "cos"} <= set(result.plan.pinned_nodes())
    assert result.rounds == 1
    assert result.holdout, result.holdout.to_dict()
    (y,) = result.holdout.outputs.values()
    assert y["rel_l2"] <= 1e-2
    # Without the pin the held-out timesteps are noise: the hazard is real.
    plain = convert(model, load_profile("generic"), samples, stats=None,
                    holdout=_timesteps(4, 2), max_rounds=1, max_fp32_share=1.0)
    assert not plain.holdout


def test_small_phases_stay_fp16_and_a_target_that_cannot_pin_records_the_pin_it_needs(tmp_path):
    # t in [0, 3]: no pin; t in [0, 1000] on rk3588: an Unpinnable naming the pin it cannot
    # have, kept through plan.yaml
    model = _model()
    small = _timesteps(4, 1, top=3.0)
    stats = calibrate(model, small)
    generic = load_profile("generic").resolve()
    plan = make_plan(model, generic, stats, findings_for(model, generic, stats))
    assert not plan.pinned_nodes()
    rk = load_profile("rk3588").resolve()
    assert not make_plan(model, rk, stats, findings_for(model, rk, stats)).unpinnable
    big = _timesteps(4, 1)
    stats = calibrate(model, big)
    plan = make_plan(model, rk, stats, findings_for(model, rk, stats))
    (hazard,) = plan.unpinnable
    assert (hazard.hazard, hazard.tensor, hazard.nodes) == (
        Hazard.COARSE_PHASE, "phase", ("phase_mul", "sin", "cos"))
    assert "only an FP32 pin of phase_mul, sin, cos could fix it" in hazard.why
    assert not plan.pinned_nodes() and not any("read phase" in n for n in plan.notes)
    assert load_plan(save_plan(plan, tmp_path / "plan.yaml"), model) == plan
