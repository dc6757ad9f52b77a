"""Which 8-bit layers to keep wider: one ranking, then the shortest head of it that passes.

The layers are ranked once by their error alone in 8 bits and by what keeping each wider
alone gains with every other layer in 8 bits (npuprep.verify.qdq_trials: two runs per layer
on one session), ordered by the error power each holds per share of the multiply-adds (the
layers that cancel another's error last). A layer's error alone does not hide behind a
dominant layer's, so no re-ranking after widening the head is needed. Heads of 1, 2, 4, ...
of that order are tried until one passes (or the longest the budget takes); the shortest
passing head is then found by halving between the last failing and the first passing, and
its last layer swapped for a later one holding fewer multiply-adds where that passes too. On a
target with a second 8-bit format (INT8 and FP8), the heads are tried in that format first
(where the whole ranking in it passes): they stay in 8 bits. Where it does not pass but errs
less than the asked format, the heads kept FP16 are tried from both, in step (heads of at
most 1, 2, 4, ... from each until one passes), and the better search kept. Where no head
passes within the budget, the heads of the layers by their errors alone (no gain read: far
from the aim, a leave-one-out gain can be negative with nothing cancelling) are tried too.
Every head tried is a point of the share/error curve the result reports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from npuprep.numerics import EightBitFormat, eight_bit_format
from npuprep.plan.layer_precision import LayerPrecision
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.qdq_model import Sensitivity

# A layer holding less of the multiply-adds than this counts as this much: a free layer
# that gains little does not take a round's place ahead of one that gains much.
MIN_COST = 1e-3
# The last layer of the passing head is swapped for a cheaper one only where that keeps at
# least this much more of the multiply-adds in 8 bits (ppocr_det: six trials of layers
# holding 0.001% each gained nothing worth their time).
MIN_SWAP_GAIN = 0.01
# A cheaper-last swap is not tried where the layer swapped in holds less than this share of the
# error power the head short of its last layer errs past the aim: kept wider, it could take
# that excess off only where errors add far from power (ddddocr_det INT8: 63 swaps tried,
# 0.055 each against an aim of 0.04, none passing).
SWAP_POWER_SHARE = 0.25


@dataclass(frozen=True)
class CurvePoint:
    """One trial of the search: how many layers left the conversion's 8-bit format and for
    what (`to`: fp16, or the target's other 8-bit format), the 8-bit share of the
    multiply-adds, the outputs' worst rel L2 on the calibration samples, and whether the aim
    was met."""

    changed: int
    to: str
    share: float
    rel_l2: float
    passed: bool
    # rel_l2 is a lower bound: the check stopped once it failed (a swap's, never kept)
    at_least: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"changed": self.changed, "to": self.to, "share": self.share,
                "rel_l2": self.rel_l2, "passed": self.passed,
                **({"at_least": True} if self.at_least else {})}


@dataclass
class Widening:
    """The layers chosen and their check, every ranking, and every point tried."""

    layers: list[LayerPrecision]
    check: OutputCheck
    rankings: list[list[Sensitivity]] = field(default_factory=list)
    widened: list[str] = field(default_factory=list)  # kept FP16
    alternative: list[str] = field(default_factory=list)  # in the other 8-bit format
    needs_more: list[str] = field(default_factory=list)  # ranked next, over the budget
    rank_runs: int = 0
    curve: list[CurvePoint] = field(default_factory=list)


@dataclass
class _Heads:
    """The heads of one ranking tried: the shortest passing, the longest failing within the
    budget, each one's layers and check, and the layers past the budget."""

    passing: int = 0
    failing: int = 0
    tried: dict[int, tuple[list[LayerPrecision], OutputCheck]] = field(default_factory=dict)
    over_budget: list[str] = field(default_factory=list)
    order: list[Sensitivity] = field(default_factory=list)  # the ranking, a cheaper last swapped in


def widen_by_ranking(layers: Sequence[LayerPrecision], fmt: EightBitFormat, check: OutputCheck,
                     *, rank: Callable[[list[str], list[LayerPrecision]], list[Sensitivity]],
                     trial: Callable[[list[LayerPrecision]], OutputCheck],
                     judged: Callable[[OutputCheck], bool],
                     share: Callable[[list[LayerPrecision]], float],
                     cost: Callable[[str], float], min_share: float,
                     alternative: str | None = None,
                     leave_out: Callable[[list[str]], list[Sensitivity]] | None = None,
                     stopping: Callable[[list[LayerPrecision]], OutputCheck] | None = None,
                     aim: float | None = None,
                     gate: Callable[[OutputCheck], bool] | None = None,
                     failing: Callable[[list[LayerPrecision]], OutputCheck] | None = None
                     ) -> Widening:
    """Keep the fewest 8-bit layers wider for `judged(check)`, while `share` (the 8-bit share
    of the multiply-adds) stays at or above `min_share`. With an `alternative` 8-bit format
    (a target that runs INT8 and FP8), the heads of each ranking are first tried in it: a
    layer INT8 cannot hold may hold in FP8 (or the reverse) and stays in 8 bits.

    `rank(nodes, layers)` gives each of `nodes` (those still in `fmt` in `layers`) with its
    `gain` when kept wider alone; `trial(layers)` checks the outputs of that choice. With
    `leave_out(nodes)` (their gains measured, each left out by a run), `rank`'s gains are
    estimates, measured for the layers of each head before it is tried (_Ranking).
    `stopping(layers)`: `trial` where a check may stop once it fails, its rel L2 then a
    lower bound (the cheaper-last swaps: a failing one is never kept). `aim`: the outputs'
    rel L2 `judged` passes at (None: decisions judge them), for the swaps not tried
    (SWAP_POWER_SHARE). `gate`: the user's gate itself, without `judged`'s margin: where no
    head meets `judged`, the point kept is the least-erring one tried that meets the gate
    (_at_gate), else the search's least-erring. `failing(layers)`: `trial` where a check may
    stop once it fails the gate itself (its rel L2 then a lower bound past it), for the FP16
    heads: such a head is kept by no rule (neither the aim nor the gate), so its exact error
    is not needed (basic_pitch FP8: heads at rel L2 0.10-0.17 against a gate of 0.05); only
    where no point passes the gate is the search's least-erring failing head read from
    these bounds."""
    done = Widening(list(layers), check)
    done.curve.append(CurvePoint(0, fmt.name, share(done.layers), check.worst_rel_l2,
                                 judged(check)))
    left = [x.node for x in layers if x.precision == fmt.name]
    if judged(check) or not left:
        return done
    ranking = _Ranking(rank(left, list(layers)), cost, leave_out)

    def heads(to: str) -> _Heads:
        return _shortest_head(done, ranking, list(layers), fmt, to, trial=trial, judged=judged,
                              share=share, min_share=min_share, whole_first=to == alternative,
                              stopping=stopping, aim=aim)

    starts = [(list(layers), fmt, check)]
    alt = _Heads()
    if alternative is not None:
        found = alt = heads(alternative)
        if found.passing:
            done.layers, done.check = found.tried[found.passing]
            done.alternative = [s.node for s in ranking.head(found.passing)]
            return ranking.done(done)
        whole = found.tried.get(len(ranking))
        if whole is not None and whole[1].worst_rel_l2 < check.worst_rel_l2:
            # Every layer in the other format errs less than in this one (the example's
            # guidance in INT8: 0.059 against FP8's 0.156): heads kept FP16 are also tried
            # from there, and the better of the two searches is kept (from FP8, MiniLM's
            # spread error needs more layers FP16 than from INT8).
            starts.append((whole[0], eight_bit_format(alternative, fmt.activations) or fmt,
                           whole[1]))
    # The searches go in step: heads of at most 1, 2, 4, ... from every start, until one
    # passes. A trial checked before is not run again (its check is kept), so each round
    # runs only its new heads: dnsmos_p835 INT8 passed from FP8 with one layer FP16, after
    # six heads and a swap from INT8 had gone to eight.
    cap = 1 if len(starts) > 1 else len(ranking)
    while True:
        searches = []
        longest = len(ranking)
        for start, start_fmt, start_check in starts:
            found = _shortest_head(done, ranking, start, start_fmt, "fp16", trial=trial,
                                   judged=judged, share=share, min_share=min_share,
                                   longest=min(cap, longest), stopping=stopping, aim=aim,
                                   failing=failing)
            searches.append((_ended(found, start_check), found, start_fmt, start, start_check))
            # A later search is kept only where it passes with fewer layers wider (or as
            # many, erring less): no longer head of it is tried (ppocr_det's heads from FP8
            # went to 53 layers, each failing, after those from INT8 passed at 15).
            longest = min(longest, found.passing or longest)
        if cap >= len(ranking) or any(f.passing for _, f, *_ in searches):
            break
        cap = min(2 * cap, len(ranking))
    # The better search: one that passes, with fewer layers kept wider; else the one whose
    # chosen head errs less.
    _, found, start_fmt, start, start_check = min(searches, key=lambda x: x[0])
    alone = None if found.passing else ranking.by_errors_alone()
    again = None
    if alone is not None:
        # No head passed within the budget: the heads by errors alone, no gain read. From an
        # all-8-bit start far off the aim, leaving one layer out can raise the error without
        # any cancellation (ddddocr_det INT8 from 0.227: the four backbone layers erring most
        # alone filed as cancelling, ranked last, past the budget; kept FP16 with two more,
        # the model errs 0.036-0.044 at 93% INT8).
        again = _shortest_head(done, alone, list(layers), fmt, "fp16", trial=trial,
                               judged=judged, share=share, min_share=min_share,
                               stopping=stopping, aim=aim, failing=failing)
        if again.passing:
            done.layers, done.check = again.tried[again.passing]
            done.widened = [s.node for s in (again.order or alone.head(again.passing))
                            [:again.passing]]
            ranking.done(done).rankings.append(alone.order)
            return done
    if not found.passing and gate is not None:
        tried = [t for f in (alt, *(x[1] for x in searches), again or _Heads())
                 for t in f.tried.values()]
        kept_at_gate = _at_gate(layers, fmt, check, tried, gate=gate, share=share)
        if kept_at_gate is not None:
            done.layers, done.check, done.widened, done.alternative = kept_at_gate
            done.needs_more = found.over_budget
            return ranking.done(done)
    done.layers, done.check = start, start_check
    done.needs_more = [] if found.passing else found.over_budget
    kept = found.passing or found.failing
    if kept:
        done.layers, done.check = found.tried[kept]
        done.widened = [s.node for s in (found.order or ranking.head(kept))[:kept]]
    if start_fmt is not fmt:
        done.alternative = [s.node for s in ranking.order if s.node not in done.widened]
    return ranking.done(done)


class _Ranking:
    """The ranking by gain per multiply-add, whose leave-one-out gains may be estimates
    (npuprep.verify.ranking.rank_layers) until a head reaches them: `head(n)` measures
    the first n (`leave_out`) and orders again until the first n are measured. A layer
    measured to cancel another's error goes last (by_gain_per_cost), as with every gain
    measured; the other layers keep their places (ordered by their errors alone), so every
    head tried is the head the fully measured ranking has."""

    def __init__(self, estimated: list[Sensitivity], cost: Callable[[str], float],
                 leave_out: Callable[[list[str]], list[Sensitivity]] | None) -> None:
        self.order, self.cost, self.leave_out = by_gain_per_cost(estimated, cost), cost, leave_out
        self.measured: set[str] = set() if leave_out else {s.node for s in estimated}
        self.estimated = len(estimated)

    def __len__(self) -> int:
        return len(self.order)

    def head(self, n: int) -> list[Sensitivity]:
        """The first n, their gains measured (the whole ranking needs none: it is a set)."""
        while n < len(self.order) and self.leave_out is not None:
            todo = [s.node for s in self.order[:n] if s.node not in self.measured]
            if not todo:
                break
            found = {s.node: s for s in self.leave_out(todo)}
            self.measured |= set(found)
            self.order = by_gain_per_cost([found.get(s.node, s) for s in self.order], self.cost)
        return self.order[:n]

    def by_errors_alone(self) -> _Ranking | None:
        """The same layers by the error power each holds alone per share of the multiply-adds,
        no gain read (those not measured alone after, as ranked): None where that is this
        order, or nothing was measured alone."""
        alone = sorted((s for s in self.order if s.alone is not None),
                       key=lambda s: -(s.alone or 0.0) ** 2 / max(self.cost(s.node), MIN_COST))
        order = alone + [s for s in self.order if s.alone is None]
        if not alone or [s.node for s in order] == [s.node for s in self.order]:
            return None
        ranked = _Ranking([], self.cost, None)
        ranked.order, ranked.measured, ranked.estimated = order, {s.node for s in order}, self.estimated
        return ranked

    def peek(self, n: int) -> list[Sensitivity]:
        """The first n as ranked so far (for a budget check, not a trial)."""
        return self.order[:n]

    def done(self, widening: Widening) -> Widening:
        widening.rankings.append(self.order)
        # Each layer alone, all of them and none (npuprep.verify.ranking.rank_layers),
        # and each layer a head reached left out.
        widening.rank_runs += self.estimated + 2 + (len(self.measured) if self.leave_out else 0)
        return widening


def _at_gate(layers: Sequence[LayerPrecision], fmt: EightBitFormat, check: OutputCheck,
             tried: Sequence[tuple[list[LayerPrecision], OutputCheck]], *,
             gate: Callable[[OutputCheck], bool],
             share: Callable[[list[LayerPrecision]], float],
             ) -> tuple[list[LayerPrecision], OutputCheck, list[str], list[str]] | None:
    """Where no head met the search's aim: of the points tried (and the start) that meet the
    gate itself, the least erring (the most margin left for unseen samples; at equal error the
    most in 8 bits), its layers kept FP16 and those moved to the other 8-bit format; None
    where none does. The least-erring head of all can change a decision the gate judges where
    one erring more does not (ppocrv5_rec INT8: 97.2% at rel L2 0.060 changed 1 of 8 texts)."""
    points = [(list(layers), check), *tried]
    passing = [(chosen, c) for chosen, c in points if gate(c)]
    if not passing:
        return None
    chosen, c = min(passing, key=lambda p: (p[1].worst_rel_l2, -share(p[0])))
    was = {x.node: x.precision for x in layers}
    moved = [x for x in chosen if was.get(x.node) == fmt.name and x.precision != fmt.name]
    return (chosen, c, [x.node for x in moved if x.precision == "fp16"],
            [x.node for x in moved if x.precision != "fp16"])


def _ended(found: _Heads, start: OutputCheck) -> tuple[bool, int, float]:
    """How a search ended, smaller is better: failing, the layers kept wider where it
    passes, the chosen head's error (the start's where no head was tried)."""
    kept = found.passing or found.failing
    error = found.tried[kept][1].worst_rel_l2 if kept in found.tried else start.worst_rel_l2
    return (not found.passing, found.passing, error)


def _shortest_head(done: Widening, ranking: _Ranking, start: list[LayerPrecision],
                   fmt: EightBitFormat, to: str, *,
                   trial: Callable[[list[LayerPrecision]], OutputCheck],
                   judged: Callable[[OutputCheck], bool],
                   share: Callable[[list[LayerPrecision]], float], min_share: float,
                   whole_first: bool = False, longest: int | None = None,
                   stopping: Callable[[list[LayerPrecision]], OutputCheck] | None = None,
                   aim: float | None = None,
                   failing: Callable[[list[LayerPrecision]], OutputCheck] | None = None
                   ) -> _Heads:
    """Heads of 1, 2, 4, ... of `ranking` moved `to`, until one passes or leaves less than
    `min_share` in 8 bits; then the shortest passing one, halving. Each trial is a point.
    `whole_first`: the whole ranking is tried first, and no head when it fails (the other
    8-bit format errs like this one on a model whose error is spread over every layer).
    `longest`: no head longer is tried, as if the budget ended there. `failing`: the trial
    of a head (not the whole first: its error decides a start) that may stop past the gate."""
    found = _Heads()
    last = len(ranking) if longest is None else longest

    def within(n: int) -> bool:
        return n <= last and share(_widen(start, ranking.peek(n), fmt, to)) >= min_share

    def attempt(n: int, exact: bool = False) -> bool | None:
        if not within(n):
            return None
        chosen = _widen(start, ranking.head(n), fmt, to)
        if share(chosen) < min_share:
            return None
        found.tried[n] = (chosen, (trial if exact or failing is None else failing)(chosen))
        check = found.tried[n][1]
        point = CurvePoint(n, to, share(chosen), check.worst_rel_l2, judged(check),
                           at_least=check.samples < done.check.samples)
        # A head an earlier round of the searches tried is one point (widen_by_ranking).
        if point not in done.curve:
            done.curve.append(point)
        return judged(check)

    if whole_first and not attempt(len(ranking), exact=True):
        return found
    n = 1
    while True:
        ok = attempt(n)
        if ok is None:
            found.over_budget = [s.node for s in ranking.peek(n)[found.failing:]]
            # The longest head the budget still takes, between the last failing and this one.
            taken = next((k for k in range(n - 1, found.failing, -1) if within(k)), 0)
            ok = attempt(taken) if taken else None
            if ok:
                found.passing = taken
            elif ok is not None:
                found.failing = taken
            break
        if ok:
            found.passing = n
            break
        found.failing = n
        if n == len(ranking):
            break
        n = min(2 * n, len(ranking))
    while found.passing and found.passing - found.failing > 1:
        mid = (found.failing + found.passing) // 2
        if attempt(mid):
            found.passing = mid
        else:
            found.failing = mid
    if found.passing:
        _cheaper_last(found, ranking, start, fmt, to, trial=stopping or trial, judged=judged,
                      share=share, done=done, aim=aim, exact=trial)
    return found


def _cheaper_last(found: _Heads, ranking: _Ranking, start: list[LayerPrecision],
                  fmt: EightBitFormat, to: str, *,
                  trial: Callable[[list[LayerPrecision]], OutputCheck],
                  judged: Callable[[OutputCheck], bool],
                  share: Callable[[list[LayerPrecision]], float], done: Widening,
                  aim: float | None = None,
                  exact: Callable[[list[LayerPrecision]], OutputCheck] | None = None) -> None:
    """The shortest passing head with its last layer swapped for a later one that holds
    fewer multiply-adds, the cheapest first, where that passes: the order buys error per
    multiply-add, but the head's last step may buy more error than the aim needs
    (mtcnn_pnet INT8: the bbox head and conv2d_1 kept FP16 pass at 78% 8-bit, the bbox head
    and conv2d at 82%). One trial per cheaper layer, until one passes; among layers of equal
    share the one erring most alone first (it takes the most error away where errors add).
    None is skipped for erring less than one whose swap failed: errors need not add
    (minilm_l6 INT8 lost its passing swap that way, 71% -> 67%). With the `aim` (outputs
    judged by rel L2), a layer is skipped where its error alone holds less than
    SWAP_POWER_SHARE of the error power the head short of its last layer (tried: it failed)
    errs past the aim: independent layers' errors add in power, so keeping it wider instead
    could not take that excess off unless they add far from it. `exact`: the whole check of
    a head, where the one short of the last stopped once it failed the gate."""
    n = found.passing
    head = found.tried[n][0]
    short = found.tried.get(n - 1)
    excess = None if aim is not None and short else 0.0
    # The head's first n - 1 are measured (the head of n was tried); the later layers are a
    # set here, whatever their gains.
    first, rest = ranking.head(n - 1), ranking.order[n - 1:]
    later = sorted(((share(_widen(start, [*first, s], fmt, to)), s.alone or 0.0, k)
                    for k, s in enumerate(rest[1:], start=n)), reverse=True)
    for kept, _, k in later:
        if kept < share(head) + MIN_SWAP_GAIN:
            break
        swapped = rest[k - n + 1]
        if excess is None:
            assert short is not None and aim is not None
            # A head that stopped once it failed the gate holds a lower bound of its error:
            # checked whole (once, where a swap is in question), it skips what it always did.
            got = (exact(short[0]) if exact is not None
                   and short[1].samples < found.tried[n][1].samples else short[1])
            excess = got.worst_rel_l2 ** 2 - aim ** 2
        if excess > 0 and (swapped.alone or 0.0) ** 2 < SWAP_POWER_SHARE * excess:
            continue
        order = [*first, swapped]
        chosen = _widen(start, order, fmt, to)
        check = trial(chosen)
        done.curve.append(CurvePoint(n, to, kept, check.worst_rel_l2, judged(check),
                                     at_least=check.samples < found.tried[n][1].samples))
        if judged(check):
            found.order = [*order, *(s for s in rest if s is not swapped)]
            found.tried[n] = (chosen, check)
            return


def by_gain_per_cost(ranking: Sequence[Sensitivity],
                     cost: Callable[[str], float]) -> list[Sensitivity]:
    """The budget buys the most error per multiply-add: layers by the error power they hold
    per share of the multiply-adds (at least MIN_COST): their error alone squared where it
    was measured (errors of independent layers add in power), else their gain; then the
    layers that do not gain, and last those that cancel another's error."""
    def held(s: Sensitivity) -> float:
        return s.alone ** 2 if s.alone is not None else s.gain

    gaining = [s for s in ranking if not s.cancels and held(s) > 0 and
               (s.alone is not None or s.gain > 0)]
    rest = [s for s in ranking if s not in gaining]
    return (sorted(gaining, key=lambda s: -held(s) / max(cost(s.node), MIN_COST))
            + sorted(rest, key=lambda s: (s.cancels, -s.gain)))


def _widen(layers: Sequence[LayerPrecision], best: Sequence[Sensitivity], fmt: EightBitFormat,
           to: str) -> list[LayerPrecision]:
    why = {s.node: f"sensitivity: kept wider alone, the outputs' rel L2 falls by "
                   f"{s.gain:.3g} to {s.rel_l2:.3g}"
                   + ("" if s.alone is None else f"; alone in 8 bits {s.alone:.3g}")
                   + f"; in {to}" for s in best}
    return [LayerPrecision(x.node, to, why[x.node]) if x.node in why and
            x.precision == fmt.name else x for x in layers]
