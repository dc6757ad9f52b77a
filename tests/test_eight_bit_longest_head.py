"""The widening tries the longest head the budget takes first: a search that cannot pass
costs one check; one that can finds the head it found before."""

from __future__ import annotations

import math

from npuprep.numerics import eight_bit_format
from npuprep.plan.layer_precision import LayerPrecision
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.qdq_model import Sensitivity
from npuprep.verify.widening import widen_by_ranking

INT8 = eight_bit_format("int8")
AIM = 0.04


def _search(alone: dict[str, float], cost: dict[str, float], min_share: float
            ) -> tuple[list[str], float, int, int]:
    """widen_by_ranking on layers whose errors add in power, each left-out gain measured by
    a run (as the pipeline's leave_one_out): the layers kept FP16, the outputs' error, the
    checks run and the layers left out."""
    checks, left_out = [0], [0]

    def error(layers: list[LayerPrecision]) -> float:
        return math.sqrt(sum(alone[x.node] ** 2 for x in layers if x.precision == "int8"))

    def check(layers: list[LayerPrecision]) -> OutputCheck:
        checks[0] += 1
        return OutputCheck(rtol=0.05, samples=1, outputs={
            "y": {"nonfinite": 0, "rel_l2": error(layers), "max_abs_error": 0.0}})

    def sensitivity(n: str, every: float) -> Sensitivity:
        rest = math.sqrt(max(every ** 2 - alone[n] ** 2, 0.0))
        return Sensitivity(n, rest, every - rest, alone[n])

    layers = [LayerPrecision(n, "int8", "") for n in cost]
    every = error(layers)

    def rank(nodes: list[str], chosen: list[LayerPrecision]) -> list[Sensitivity]:
        return [sensitivity(n, every) for n in nodes]

    def leave_out(nodes: list[str]) -> list[Sensitivity]:
        left_out[0] += len(nodes)
        return [sensitivity(n, every) for n in nodes]

    done = widen_by_ranking(layers, INT8, check(layers), rank=rank, trial=check,
                            judged=lambda c: c.outputs["y"]["rel_l2"] <= AIM,
                            share=lambda c: sum(cost[x.node] for x in c if x.precision == "int8"),
                            cost=cost.__getitem__, min_share=min_share, leave_out=leave_out)
    return done.widened, error(done.layers), checks[0], left_out[0]


# Sixteen layers of equal cost: one erring 0.05 alone, the rest 0.02 each (0.09 all in INT8).
COST = {f"l{i:02d}": 1 / 16 for i in range(16)}
ALONE = {"l00": 0.05, **{f"l{i:02d}": 0.02 for i in range(1, 16)}}


def test_a_search_no_head_of_which_passes_costs_one_check_and_no_left_out_run():
    # 75% at least in 8 bits: four layers may be kept FP16, leaving 11 at 0.02 (0.066): the
    # longest head fails, so no shorter one is tried (the doubling tried 1, 2 and 4, and left
    # out the four layers they reached).
    widened, err, checks, left_out = _search(ALONE, COST, 0.75)
    assert checks == 2 and left_out == 0  # the start and the longest head
    assert len(widened) == 4 and err > AIM  # the longest failing head, as the doubling kept it


def test_where_the_longest_head_passes_the_search_finds_the_shortest_head_as_before():
    # 50%: the longest head (8 layers FP16) leaves 8 x 0.008 = 0.023 and passes; the heads
    # are then tried as before.
    alone = {"l00": 0.05, **{f"l{i:02d}": 0.008 for i in range(1, 16)}}
    widened, err, checks, _ = _search(alone, COST, 0.5)
    # l00 alone kept FP16 leaves 15 x 0.008 = 0.031: the shortest head, one layer.
    assert widened == ["l00"] and err <= AIM
    # The start, the longest head (8 layers) and the head of one.
    assert checks == 3
