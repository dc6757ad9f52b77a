"""8-bit widening ranks the layers once by their errors alone and their gains, and spends the budget
by gain per multiply-add."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
from onnx import numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import eight_bit_format, get_format
from npuprep.pipeline import convert
from npuprep.pipeline.quantise_and_verify import JUDGE_MARGIN
from npuprep.profiles import load_profile
from npuprep.runtime.session import make_session, run
from npuprep.scale_rules import DEFAULT_RULE
from npuprep.verify.qdq_model import Sensitivity, quantise
from npuprep.verify.qdq_trials import Trials, Variant, switched_qdq
from npuprep.verify.ranking import rank_layers
from npuprep.verify.widening import MIN_COST, by_gain_per_cost

RNG = np.random.default_rng(5)
FP8 = eight_bit_format("fp8_e4m3")

# x -> MatMul(W) in three layers d, a, b (the same weights: the same 8-bit error e);
# y = Concat(10 d + a, 4 b): the error is (11e, 4e) with all three in 8 bits
THREE = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[16, 8] x) => (float[16, 8] y) {
    [d] hd = MatMul (x, Wd)
    [a] ha = MatMul (x, Wa)
    [b] hb = MatMul (x, Wb)
    sd = Mul (hd, ten)
    u = Add (sd, ha)
    v = Mul (hb, four)
    y = Concat <axis = 1> (u, v)
}
"""


def _setup() -> tuple[onnx.ModelProto, Model, list[dict[str, np.ndarray]]]:
    proto = parser.parse_model(THREE)
    w = RNG.standard_normal((8, 4))
    for name, value in {"Wd": w, "Wa": w, "Wb": w, "ten": np.array(10.0),
                        "four": np.array(4.0)}.items():
        proto.graph.initializer.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
    feeds = [{"x": RNG.standard_normal((16, 8)).astype(np.float32)} for _ in range(4)]
    return proto, Model(proto=proto, path="m.onnx", digest=fingerprint(proto)), feeds


def _error(proto: onnx.ModelProto, quantised: list[str], stats: object,
           feeds: list[dict[str, np.ndarray]]) -> float:
    built = quantise(proto, quantised, stats, FP8, saturate=False, headroom=2.0).model
    ref, got = make_session(proto), make_session(built)
    num = sum(float(np.sum((run(got, f)["y"] - run(ref, f)["y"]) ** 2)) for f in feeds)
    return float(np.sqrt(num / sum(float(np.sum(run(ref, f)["y"] ** 2)) for f in feeds)))


def test_the_gains_rank_the_wrong_second_layer_and_the_errors_alone_the_right_one():
    proto, model, feeds = _setup()
    stats = calibrate(model, feeds, detail="all")
    # One session for both rankings: every layer behind its own switch.
    every = dict.fromkeys(["d", "a", "b"], "fp8_e4m3")
    switched = switched_qdq(proto, list(every), stats, [Variant(FP8, (DEFAULT_RULE,), False, 2.0)])
    trials = Trials(proto, switched, get_format("fp32"), (), feeds, saturate=False)
    first = rank_layers(trials, list(every), every, {})
    # With d in 8 bits its error (10e) dominates: a (along it) ranks above b (across it).
    assert [s.node for s in first] == ["d", "a", "b"]
    # Once d is wider the order turns: a alone leaves (0, 4e), b alone (e, 0).
    again = rank_layers(trials, ["a", "b"], {"a": "fp8_e4m3", "b": "fp8_e4m3"}, {})
    assert [s.node for s in again] == ["b", "a"]
    with_a, with_b = _error(proto, ["b"], stats, feeds), _error(proto, ["a"], stats, feeds)
    assert with_a > 3 * with_b  # 4e against e
    rtol = np.sqrt(with_a * with_b) / JUDGE_MARGIN  # between the two
    assert with_a > JUDGE_MARGIN * rtol > with_b
    # FP8 alone (the A2000's INT8 would hold a layer FP8 cannot: tests/test_eight_bit_mixed.py)
    a2000 = load_profile("a2000")
    fp8_only = replace(a2000, fast_dtypes=tuple(d for d in a2000.fast_dtypes if d != "int8"))
    result = convert(model, fp8_only, feeds, precision="fp8_e4m3", stats=stats,
                     rtol=float(rtol), min_8bit_share=0.3)
    # Ranked by gain alone, the head would keep d and a wider (rel L2 with_a, over the aim) and
    # then be out of budget. Each layer's error alone (10e, e, 4e) does not hide behind d's:
    # one ranking by error alone per multiply-add keeps d and b, within, with no re-ranking.
    assert result.eight_bit.kept_wider == ("d", "b")
    assert [s.node for s in result.eight_bit.sensitivity] == ["d", "b", "a"]
    alone = {s.node: s.alone for s in result.eight_bit.sensitivity}
    assert alone["d"] > 2 * alone["b"] > 4 * alone["a"]  # 10e, 4e, e
    assert len(result.eight_bit.sensitivity) == 3  # one ranking
    assert result.output_check and result.output_check.outputs["y"]["rel_l2"] < JUDGE_MARGIN * rtol
    # Three ranked alone, all and none in 8 bits, and the two layers the heads reached left
    # out (their gains measured, not estimated)
    assert result.eight_bit.rank_runs == 7
    assert abs(result.eight_bit.mac_share["fp8_e4m3"] - 1 / 3) < 1e-6


def test_the_budget_goes_to_the_most_gain_per_multiply_add_and_layers_that_lose_go_last():
    macs = {"big": 0.6, "small": 0.05, "free": 0.0, "worse": 0.01}
    ranking = [Sensitivity("big", 0.1, 0.03), Sensitivity("small", 0.11, 0.02),
               Sensitivity("free", 0.129, 1e-4), Sensitivity("worse", 0.14, -0.01)]
    ordered = by_gain_per_cost(ranking, macs.__getitem__)
    # small: 0.02 / 0.05 = 0.4 per share; big: 0.05; free counts as MIN_COST: 1e-4 / 1e-3 = 0.1
    assert [s.node for s in ordered] == ["small", "free", "big", "worse"]
    assert 1e-4 / MIN_COST < 0.02 / 0.05


def test_errors_alone_order_the_budget_and_a_layer_that_cancels_goes_last():
    macs = {"branch": 0.3, "noisy": 0.3, "small": 0.3}
    # branch: alone 0.3, and kept wider alone it raises the error by 0.25 (it cancels another);
    # noisy: a gain of -0.001 is noise beside its error alone, 0.02: it holds error.
    ranking = [Sensitivity("branch", 0.35, -0.25, 0.3), Sensitivity("small", 0.1, 0.001, 0.01),
               Sensitivity("noisy", 0.1, -0.001, 0.02)]
    ordered = by_gain_per_cost(ranking, macs.__getitem__)
    assert [s.node for s in ordered] == ["noisy", "small", "branch"]
    assert ranking[0].cancels and not ranking[2].cancels


def test_a_head_is_measured_before_it_is_tried_and_a_layer_measured_to_cancel_goes_last():
    from npuprep.verify.widening import _Ranking

    macs = dict.fromkeys(["branch", "noisy", "small", "tail"], 0.25)
    # Estimated (from the layers alone): nothing cancels; measured: branch does.
    estimated = [Sensitivity("branch", 0.1, 0.01, 0.3), Sensitivity("noisy", 0.1, 0.01, 0.02),
                 Sensitivity("small", 0.1, 0.01, 0.01), Sensitivity("tail", 0.1, 0.01, 0.005)]
    measured = {"branch": Sensitivity("branch", 0.35, -0.25, 0.3),
                "noisy": Sensitivity("noisy", 0.1, 0.005, 0.02),
                "small": Sensitivity("small", 0.1, 0.002, 0.01)}
    asked: list[list[str]] = []

    def leave_out(nodes: list[str]) -> list[Sensitivity]:
        asked.append(nodes)
        return [measured[n] for n in nodes]

    ranking = _Ranking(estimated, macs.__getitem__, leave_out)
    assert [s.node for s in ranking.peek(1)] == ["branch"]  # the estimate's order
    assert [s.node for s in ranking.head(1)] == ["noisy"]  # branch measured: it cancels
    assert asked == [["branch"], ["noisy"]]
    assert [s.node for s in ranking.head(2)] == ["noisy", "small"] and asked[-1] == ["small"]
    # The whole ranking is a set: nothing more to measure; tail was never left out.
    assert {s.node for s in ranking.head(4)} == set(macs) and len(asked) == 3
    assert [s.node for s in ranking.order] == ["noisy", "small", "tail", "branch"]
