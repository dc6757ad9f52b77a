"""The verification strategy on its own: when a pin is kept, when none is proposed, and what for.

(convert's rounds run it end to end in test_convert, test_precision_limited and
test_verify_attribution; here its decisions are checked on hand-made checks.)
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from onnx import parser

from npuprep.plan import Plan
from npuprep.profiles import Pinning, load_profile
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.pin_rounds import Build, PinRounds, improved

# x -> Exp[big] -> e -> Relu[after] -> y
GRAPH = parser.parse_model("""
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 4] x) => (float[1, 4] y) {
    [big] e = Exp (x)
    [after] y = Relu (e)
}
""")


def _check(rel_l2: float, nonfinite: int = 0) -> OutputCheck:
    return OutputCheck(rtol=1e-2, samples=1, outputs={"y": {"rel_l2": rel_l2, "nonfinite": nonfinite,
                                                            "max_abs_error": rel_l2}})


def _build(check: OutputCheck, first: object, pinned: frozenset[str] = frozenset()) -> Build:
    return Build(rewritten=GRAPH, lowered=None, tensor_scales={}, pinned=pinned,
                 layers=SimpleNamespace(first_divergent=first), output_check=check, holdout=None,
                 declined=(), notes=(), host_scales={}, boundary=frozenset(), fp32_reasons={})


def _plan() -> Plan:
    return Plan(fingerprint="f", target="generic", precision="fp16", actions=())


def _overflow_at(node: str) -> SimpleNamespace:
    return SimpleNamespace(node=node, op_type="Exp", rel_l2=1.0, max_abs_error=float("inf"),
                           inf_count=4, nan_count=0, saturated_count=0)


def test_a_pin_is_kept_when_it_passes_lowers_the_nonfinite_count_or_the_error_by_a_tenth():
    assert improved(_check(0.5), _check(0.001))  # passes now
    assert improved(_check(0.5, nonfinite=4), _check(0.9, nonfinite=1))
    assert improved(_check(0.05), _check(0.045))
    assert not improved(_check(0.05), _check(0.046))
    # As many Inf/NaN as before: the finite values' error says nothing of the failure.
    assert not improved(_check(0.5, nonfinite=4), _check(0.1, nonfinite=4))


def test_an_overflow_pins_the_first_divergent_node_or_the_producers_of_a_pinned_one():
    rounds = PinRounds(load_profile("generic").resolve(), samples=[], rtol=1e-2, max_fp32_share=0.1)
    pin = rounds.propose(_build(_check(1.0, nonfinite=4), _overflow_at("big")), _plan(), 1)
    assert pin is not None and pin.nodes == ("big",) and not pin.request
    assert "first divergent node big" in pin.why and "pinned big and retried" in rounds.notes[-1]
    # Already FP32 where it diverges: the rounding came in through its input.
    pin = rounds.propose(_build(_check(1.0, nonfinite=4), _overflow_at("after"), frozenset({"after"})),
                         _plan(), 2)
    assert pin is not None and pin.nodes == ("big",)


def test_no_pin_when_nothing_diverges_or_the_target_cannot_pin_or_the_plan_forbids_it():
    generic = load_profile("generic")
    rounds = PinRounds(generic.resolve(), samples=[], rtol=1e-2, max_fp32_share=0.1)
    assert rounds.propose(_build(_check(1.0), None), _plan(), 1) is None
    forbidden = dataclasses.replace(_plan(), forbid_pin=("big",))
    assert rounds.propose(_build(_check(1.0, nonfinite=4), _overflow_at("big")), forbidden, 1) is None
    no_pin = PinRounds(dataclasses.replace(generic, fp32_pinning=Pinning.NONE).resolve(), samples=[],
                       rtol=1e-2, max_fp32_share=0.1)
    assert no_pin.propose(_build(_check(1.0, nonfinite=4), _overflow_at("big")), _plan(), 1) is None
    assert no_pin.notes == ["verification failed at 'big'; the target cannot pin FP32"]


def test_a_pin_that_bought_too_little_is_dropped_and_its_attribution_marked():
    rounds = PinRounds(load_profile("generic").resolve(), samples=[], rtol=1e-2, max_fp32_share=0.1)
    rounds.attributions.append({"round": 1, "pinned": ["big"], "dropped": False})
    before, after = _build(_check(0.05), None), _build(_check(0.048), None)
    assert not rounds.keeps(before, after, 2)
    assert rounds.attributions[0]["dropped"] and "did not improve the outputs" in rounds.notes[-1]
    assert rounds.keeps(before, _build(_check(0.004), None), 2)


def test_an_attributed_pin_that_bought_too_little_is_widened_by_the_ranking_until_none_is_wider():
    from npuprep.plan import PinFp32
    from npuprep.verify.attribution import Attribution, LayerError

    ranked = Attribution((LayerError("big", "Exp", 0.03, 0.6, 4), LayerError("after", "Relu", 0.02, 0.4, 4)),
                         samples=1)
    rounds = PinRounds(load_profile("generic").resolve(), samples=[], rtol=1e-2, max_fp32_share=1.0,
                       _ranked=(ranked, 0.03, 100.0, PinFp32(nodes=("big",), why="verification round 1: x")),
                       _model=GRAPH)
    pin = rounds.widen(2, _plan())
    assert pin is not None and pin.nodes == ("big", "after") and "widened after round 2" in pin.why
    assert "widened the attributed pin from 1 to 2 layer(s)" in rounds.notes[-1]
    # Both ranked nodes are pinned now: nothing wider to take, and the failure stands.
    assert rounds.widen(3, _plan()) is None and "no wider set" in rounds.notes[-1]
    # Nor without an attributed pin to start from.
    assert PinRounds(load_profile("generic").resolve(), samples=[], rtol=1e-2,
                     max_fp32_share=1.0).widen(2, _plan()) is None


# x -> Mul(x, x) [sq] -> v -> Add(v, eps)[add] -> ve -> Sqrt[root] -> s -> Div(x, s)[div] -> y
CHAIN = parser.parse_model("""
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 4] x) => (float[1, 4] y) {
    [sq] v = Mul (x, x)
    [add] ve = Add (v, eps)
    [root] s = Sqrt (ve)
    [div] y = Div (x, s)
}
""")


def test_a_divergent_pin_that_bought_nothing_reaches_back_to_its_inputs_producers():
    generic = load_profile("generic").resolve()
    rounds = PinRounds(generic, samples=[], rtol=1e-2, max_fp32_share=1.0)
    nan_at_div = SimpleNamespace(node="div", op_type="Div", rel_l2=1.0, max_abs_error=float("nan"),
                                 inf_count=0, nan_count=4, saturated_count=0)
    failed = dataclasses.replace(_build(_check(1.0, nonfinite=4), nan_at_div), rewritten=CHAIN)
    pin = rounds.propose(failed, _plan(), 1)
    assert pin is not None and pin.nodes == ("div",)
    # The Div pinned still reads a Sqrt of 0: the pin reaches back one producer at a time.
    wider = rounds.upstream(2, _plan())
    assert wider is not None and wider.nodes == ("div", "root") and "inputs' producers" in wider.why
    wider = rounds.upstream(3, _plan())
    assert wider is not None and wider.nodes == ("div", "root", "add")
    wider = rounds.upstream(4, _plan())
    assert wider is not None and wider.nodes == ("div", "root", "add", "sq")
    assert rounds.upstream(5, _plan()) is None  # the widenings are spent
    # An attributed pin is widened by its ranking, not up the graph.
    assert PinRounds(generic, samples=[], rtol=1e-2, max_fp32_share=1.0).upstream(2, _plan()) is None


def test_a_pinned_divergent_node_pins_the_nearest_unpinned_producers_up_its_inputs():
    rounds = PinRounds(load_profile("generic").resolve(), samples=[], rtol=1e-2, max_fp32_share=1.0)
    nan_at_div = SimpleNamespace(node="div", op_type="Div", rel_l2=1.0, max_abs_error=float("nan"),
                                 inf_count=0, nan_count=4, saturated_count=0)
    failed = dataclasses.replace(_build(_check(1.0, nonfinite=4), nan_at_div,
                                        frozenset({"div", "root"})), rewritten=CHAIN)
    pin = rounds.propose(failed, _plan(), 2)
    assert pin is not None and pin.nodes == ("add",)
