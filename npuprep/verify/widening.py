"""Which 8-bit layers to keep wider: one ranking, then the shortest head of it that passes.

The layers are ranked once by what keeping each wider alone gains with every other layer in
8 bits (npuprep.verify.qdq_trials: one run per layer on one session), ordered by gain per
share of the multiply-adds, and heads of 1, 2, 4, ... of that order are tried until one
passes; the shortest passing head is then found by halving between the last failing and the
first passing. Where no head within the budget passes, the layers left in 8 bits are ranked
once more with the first half of the last failing head kept wider: one layer that dominates
the error hides how the others' errors add or cancel. Every head tried is a point of the
share/error curve the result reports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from npuprep.numerics import EightBitFormat
from npuprep.plan.layer_precision import LayerPrecision
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.qdq_model import Sensitivity

# A layer holding less of the multiply-adds than this counts as this much: a free layer
# that gains little does not take a round's place ahead of one that gains much.
MIN_COST = 1e-3
# Rankings at most: the first, and one with the head that dominated it kept wider.
MAX_RANKINGS = 2


@dataclass(frozen=True)
class CurvePoint:
    """One trial of the search: layers kept wider, the 8-bit share of the multiply-adds, the
    outputs' worst rel L2 on the calibration samples, and whether the aim was met."""

    kept_wider: int
    share: float
    rel_l2: float
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        return {"kept_wider": self.kept_wider, "share": self.share, "rel_l2": self.rel_l2,
                "passed": self.passed}


@dataclass
class Widening:
    """The layers chosen and their check, every ranking, and every point tried."""

    layers: list[LayerPrecision]
    check: OutputCheck
    rankings: list[list[Sensitivity]] = field(default_factory=list)
    widened: list[str] = field(default_factory=list)
    needs_more: list[str] = field(default_factory=list)  # ranked next, over the budget
    rank_runs: int = 0
    curve: list[CurvePoint] = field(default_factory=list)


def widen_by_ranking(layers: Sequence[LayerPrecision], fmt: EightBitFormat, check: OutputCheck,
                     *, rank: Callable[[list[str], list[LayerPrecision]], list[Sensitivity]],
                     trial: Callable[[list[LayerPrecision]], OutputCheck],
                     judged: Callable[[OutputCheck], bool],
                     share: Callable[[list[LayerPrecision]], float],
                     cost: Callable[[str], float], min_share: float) -> Widening:
    """Keep the fewest 8-bit layers wider for `judged(check)`, while `share` (the 8-bit share
    of the multiply-adds) stays at or above `min_share`.

    `rank(nodes, layers)` gives each of `nodes` (those still in 8 bits in `layers`) with its
    `gain` when kept wider alone; `trial(layers)` checks the outputs of that choice."""
    done = Widening(list(layers), check)
    done.curve.append(_point(0, share(done.layers), check, judged))
    start: list[LayerPrecision] = list(layers)
    fixed: list[str] = []
    while not judged(done.check) and len(done.rankings) < MAX_RANKINGS:
        left = [x.node for x in start if x.precision == fmt.name]
        if not left:
            break
        ranking = by_gain_per_cost(rank(left, start), cost)
        done.rankings.append(ranking)
        done.rank_runs += len(left) + 1
        tried: dict[int, tuple[list[LayerPrecision], OutputCheck]] = {}

        def attempt(n: int, ranking: list[Sensitivity] = ranking,
                    start: list[LayerPrecision] = start,
                    tried: dict[int, tuple[list[LayerPrecision], OutputCheck]] = tried,
                    before: int = len(fixed)) -> bool | None:
            chosen = _widen(start, ranking[:n], fmt, len(done.rankings))
            if share(chosen) < min_share:
                return None
            tried[n] = (chosen, trial(chosen))
            done.curve.append(_point(before + n, share(chosen), tried[n][1], judged))
            return judged(tried[n][1])

        failing, passing, n = 0, 0, 1
        while True:
            ok = attempt(n)
            if ok is None:
                done.needs_more = [s.node for s in ranking[failing:n]]
                break
            if ok:
                passing = n
                break
            failing = n
            if n == len(ranking):
                break
            n = min(2 * n, len(ranking))
        if passing:
            while passing - failing > 1:
                mid = (failing + passing) // 2
                if attempt(mid):
                    passing = mid
                else:
                    failing = mid
            done.layers, done.check = tried[passing]
            done.widened = fixed + [s.node for s in ranking[:passing]]
            done.needs_more = []
            break
        if not failing:
            break
        done.layers, done.check = tried[failing]
        done.widened = fixed + [s.node for s in ranking[:failing]]
        head = ranking[:max(1, failing // 2)]
        fixed = fixed + [s.node for s in head]
        start = _widen(start, head, fmt, len(done.rankings))
    return done


def _point(kept: int, share: float, check: OutputCheck,
           judged: Callable[[OutputCheck], bool]) -> CurvePoint:
    worst = max((o.get("rel_l2", 0.0) for o in check.outputs.values()), default=0.0)
    return CurvePoint(kept, share, float(worst), judged(check))


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
