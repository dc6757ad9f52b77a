"""Where no head of the 8-bit search meets its aim (the gate with a margin), the point kept is
the least-erring one that meets the gate itself, not the least-erring point of all."""

from __future__ import annotations

import math

from npuprep.numerics import eight_bit_format
from npuprep.plan.layer_precision import LayerPrecision
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.output_errors import output_passes
from npuprep.verify.qdq_model import Sensitivity
from npuprep.verify.widening import widen_by_ranking

INT8 = eight_bit_format("int8")
COST = {"a": 0.1, "b": 0.3, "c": 0.6}
ALONE = {"a": 0.05, "b": 0.03, "c": 0.02}


def _search(flips_when_wider: set[str], *, gate: bool) -> tuple[list[str], float, bool]:
    """widen_by_ranking on a decided output: errors add in power; every decision holds at 1x
    except where exactly `flips_when_wider` are kept FP16; at the search's 2x margin some
    decision flips everywhere (no head meets the aim). The layers kept FP16, the error, and
    whether the kept point's decisions hold."""
    def check(layers: list[LayerPrecision]) -> OutputCheck:
        error = math.sqrt(sum(ALONE[x.node] ** 2 for x in layers if x.precision == "int8"))
        wider = {x.node for x in layers if x.precision == "fp16"}
        held = 0.875 if wider == flips_when_wider else 1.0
        return OutputCheck(rtol=0.01, samples=8, outputs={"y": {
            "nonfinite": 0, "rel_l2": error, "max_abs_error": 0.0, "top_k": 1,
            "top_k_agreement": held, "top_k_agreement_at_margin": 0.875}})

    def rank(nodes: list[str], layers: list[LayerPrecision]) -> list[Sensitivity]:
        every = check(layers).worst_rel_l2
        rest = {n: math.sqrt(max(every ** 2 - ALONE[n] ** 2, 0.0)) for n in nodes}
        return [Sensitivity(n, rest[n], every - rest[n], ALONE[n]) for n in nodes]

    layers = [LayerPrecision(n, "int8", "") for n in COST]
    done = widen_by_ranking(
        layers, INT8, check(layers), rank=rank, trial=check,
        judged=lambda c: all(output_passes(o, 0.01, at_margin=True) for o in c.outputs.values()),
        share=lambda ls: sum(COST[x.node] for x in ls if x.precision == "int8"),
        cost=COST.__getitem__, min_share=0.5,
        gate=(lambda c: all(output_passes(o, 0.01) for o in c.outputs.values())) if gate else None)
    assert done.check == check(done.layers)
    return done.widened, done.check.worst_rel_l2, done.check.outputs["y"]["top_k_agreement"] == 1.0


def test_the_least_erring_point_that_changes_a_decision_is_not_kept():
    # Heads: [a] 0.036, [a, b] 0.02 (60% 8-bit; [a, b, c] would leave 0%): none meets the aim.
    widened, error, held = _search({"a", "b"}, gate=True)
    assert widened == ["a"] and math.isclose(error, math.hypot(0.03, 0.02)) and held
    # Without the gate the search keeps its least-erring head, whose decisions change.
    widened, error, held = _search({"a", "b"}, gate=False)
    assert widened == ["a", "b"] and not held


def test_where_the_least_erring_point_meets_the_gate_it_is_kept():
    widened, error, held = _search({"a"}, gate=True)
    assert widened == ["a", "b"] and math.isclose(error, 0.02) and held
