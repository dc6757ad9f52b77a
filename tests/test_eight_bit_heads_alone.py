"""The widening's fallback: where no head of the ranking passes within the budget, the heads of
the layers by their errors alone (no leave-one-out gain read) are tried."""

from __future__ import annotations

import math

from npuprep.numerics import eight_bit_format
from npuprep.plan.layer_precision import LayerPrecision
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.qdq_model import Sensitivity
from npuprep.verify.widening import widen_by_ranking

INT8 = eight_bit_format("int8")
# ddddocr_det's shape: two backbone layers erring most (5% of the multiply-adds each) whose
# errors do not add, and cheap-to-err layers holding the rest.
COST = {"stage_a": 0.05, "stage_b": 0.05, "c1": 0.225, "c2": 0.225, "c3": 0.225, "c4": 0.225}
ALONE = {"stage_a": 0.2, "stage_b": 0.2, "c1": 0.01, "c2": 0.01, "c3": 0.01, "c4": 0.01}
AIM = 0.04


def _error(layers: list[LayerPrecision]) -> float:
    """Either stage layer alone in INT8 errs more than both together (far from the aim,
    leaving one out raises the error: nothing cancels, both need FP16); the rest add in power."""
    int8 = {x.node for x in layers if x.precision == "int8"}
    stages = len(int8 & {"stage_a", "stage_b"})
    rest = math.sqrt(sum(ALONE[n] ** 2 for n in int8 if n.startswith("c")))
    return rest + {0: 0.0, 1: 0.35, 2: 0.2}[stages]


def _check(layers: list[LayerPrecision]) -> OutputCheck:
    return OutputCheck(rtol=0.05, samples=1, outputs={
        "y": {"nonfinite": 0, "rel_l2": _error(layers), "max_abs_error": 0.0}})


def _rank(nodes: list[str], layers: list[LayerPrecision]) -> list[Sensitivity]:
    every = _error(layers)
    out = []
    for n in nodes:
        without = _error([LayerPrecision(x.node, "fp16" if x.node == n else x.precision, "")
                          for x in layers])
        out.append(Sensitivity(n, without, every - without, ALONE[n]))
    return out


def test_layers_filed_as_cancelling_far_from_the_aim_are_tried_first_by_their_errors_alone():
    layers = [LayerPrecision(n, "int8", "") for n in COST]
    ranked = _rank(list(COST), layers)
    # Leaving either stage layer out raises the error by 0.15: filed as cancelling, ranked last.
    assert all(s.cancels for s in ranked if s.node.startswith("stage"))
    done = widen_by_ranking(layers, INT8, _check(layers), rank=_rank, trial=_check,
                            judged=lambda c: c.outputs["y"]["rel_l2"] <= AIM,
                            share=lambda c: sum(COST[x.node] for x in c if x.precision == "int8"),
                            cost=COST.__getitem__, min_share=0.5)
    # By gain, the budget (50%) runs out on the cheap layers first (0.2 + 0.02 left); by errors
    # alone the two stage layers go first and pass together at 90% INT8.
    assert sorted(done.widened) == ["stage_a", "stage_b"] and done.check.outputs["y"]["rel_l2"] <= AIM
    assert math.isclose(_error(done.layers), 0.02)
    assert not done.needs_more and len(done.rankings) == 2
    assert any(not p.passed and p.share < 0.8 for p in done.curve)  # the gain-ranked heads tried
