"""Which 8-bit layers to keep wider: `rank -> widen the best -> re-rank the rest -> ...`.

Each round keeps the best-ranked layers wider (1, 2, 4, ... in all) and, while the outputs
still fail, ranks the layers left in 8 bits again with those kept wider: one layer that
dominates the error hides how the others' errors add or cancel, so the first ranking's order
below its head is not the order once the head is wider. A re-ranking costs one verification
run per layer left in 8 bits, plus one; at most `max_rounds` - 1 of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import onnx

from npuprep.numerics import EightBitFormat
from npuprep.plan.layer_precision import LayerPrecision
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.qdq_model import Sensitivity

# A layer holding less of the multiply-adds than this counts as this much: a free layer
# that gains little does not take a round's place ahead of one that gains much.
MIN_COST = 1e-3


@dataclass
class Widening:
    """What the rounds kept wider, the last model built and its check, and every ranking."""

    layers: list[LayerPrecision]
    built: onnx.ModelProto
    check: OutputCheck
    rounds: int = 1
    rankings: list[list[Sensitivity]] = field(default_factory=list)
    widened: list[str] = field(default_factory=list)
    needs_more: list[str] = field(default_factory=list)  # ranked next, over the budget
    rank_runs: int = 0


def widen_in_rounds(layers: Sequence[LayerPrecision], fmt: EightBitFormat, built: onnx.ModelProto,
                    check: OutputCheck, *,
                    rank: Callable[[list[str]], list[Sensitivity]],
                    build: Callable[[list[LayerPrecision]], tuple[onnx.ModelProto, OutputCheck]],
                    judged: Callable[[OutputCheck], bool],
                    share: Callable[[list[LayerPrecision]], float],
                    cost: Callable[[str], float],
                    min_share: float, max_rounds: int) -> Widening:
    """Keep 8-bit layers wider in rounds until `judged(check)`, `share` (the 8-bit share of
    the multiply-adds) would fall under `min_share`, or `max_rounds` rounds have run.

    `rank(nodes)` gives each of `nodes` (those still in 8 bits) with its `gain` when kept
    wider alone, largest first; `build(layers)` the model and its check."""
    done = Widening(list(layers), built, check)
    count = 1
    while not judged(done.check) and done.rounds <= max_rounds:
        left = [x.node for x in done.layers if x.precision == fmt.name]
        if not left:
            break
        ranking = by_gain_per_cost(rank(left), cost)
        done.rankings.append(ranking)
        done.rank_runs += len(left) + 1
        add = min(count - len(done.widened), len(ranking))
        # The most of the ranking's head the budget still takes, at least one layer.
        fits = [n for n in range(add, 0, -1)
                if share(_widen(done.layers, ranking[:n], fmt, len(done.rankings))) >= min_share]
        if not fits:
            done.needs_more = [s.node for s in ranking[:add]]
            break
        trial = _widen(done.layers, ranking[:fits[0]], fmt, len(done.rankings))
        done.rounds += 1
        done.built, done.check = build(trial)
        done.layers = trial
        done.widened += [s.node for s in ranking[:fits[0]]]
        count = 2 * len(done.widened)
    return done


def by_gain_per_cost(ranking: Sequence[Sensitivity],
                     cost: Callable[[str], float]) -> list[Sensitivity]:
    """Layers that gain, by gain per share of the multiply-adds they hold (at least
    MIN_COST), then the rest by gain: the budget buys the most error per multiply-add."""
    gaining = [s for s in ranking if s.gain > 0]
    return (sorted(gaining, key=lambda s: -s.gain / max(cost(s.node), MIN_COST))
            + sorted((s for s in ranking if s.gain <= 0), key=lambda s: -s.gain))


def _widen(layers: Sequence[LayerPrecision], best: Sequence[Sensitivity], fmt: EightBitFormat,
           ranking: int) -> list[LayerPrecision]:
    after = "" if ranking == 1 else f" (ranking {ranking}, after the wider ones before it)"
    why = {s.node: f"sensitivity{after}: kept wider alone, the outputs' rel L2 falls by "
                   f"{s.gain:.3g} to {s.rel_l2:.3g}" for s in best}
    return [LayerPrecision(x.node, "fp16", why[x.node]) if x.node in why and
            x.precision == fmt.name else x for x in layers]
