"""One widening of an 8-bit start on the search's trial sessions, for the search and the plain start.

    start, its check -> rank (own format's session or every format's) -> heads kept wider
        (npuprep.verify.widening) -> the point
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from npuprep.detections import Decision
from npuprep.numerics import EightBitFormat
from npuprep.pipeline.eight_bit_choice import eight_bit_share
from npuprep.pipeline.trial_sessions import TrialSessions, assigned_formats
from npuprep.plan.layer_precision import LayerPrecision
from npuprep.scale_rules import ScaleRule
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.qdq_model import Sensitivity
from npuprep.verify.qdq_trials import Trials
from npuprep.verify.ranking import leave_one_out, rank_layers
from npuprep.verify.widening import Widening, widen_by_ranking


def widen_on(sessions: TrialSessions, start: Sequence[LayerPrecision], fmt: EightBitFormat,
             check: OutputCheck, *, own: bool, rules: Mapping[str, ScaleRule],
             macs: Mapping[str, int], rtol: float, top_k: Mapping[str, Decision], margin: float,
             judged: Callable[[OutputCheck], bool], aim: float,
             gate: Callable[[OutputCheck], bool] | None, fail_past: float, min_share: float,
             alternative: EightBitFormat | None, stage: Callable[[str], None],
             of: str = "") -> Widening:
    """`start` (its `check`) widened in `fmt` by its ranking on `sessions` at `rules`, while
    `min_share` of `macs` stays in 8 bits: ranked on the session of each layer's own format
    (`own`), else on the checks' (every format); a swap's check stops once it errs past the
    `aim` for sure, a head's once past `fail_past` (outputs judged by rel L2); `of` names the
    start in the stages (" of the plain start")."""
    total = sum(macs.values()) or 1
    ranked_from: dict[str, str] = {}

    def trial(chosen: Sequence[LayerPrecision], stop_past: float | None = None) -> OutputCheck:
        return sessions.checks().check(assigned_formats(chosen), rules, rtol=rtol, top_k=top_k,
                                       margin=margin, stop_past=stop_past)

    def trials() -> Trials:
        return sessions.ranking() if own else sessions.checks()

    def rank(nodes: list[str], chosen: list[LayerPrecision]) -> list[Sensitivity]:
        stage(f"ranking {len(nodes)} {fmt.name} layer(s){of} by their own error")
        ranked_from.update(assigned_formats(chosen))
        ranked = rank_layers(trials(), nodes, ranked_from, rules)
        sessions.shared.clear()  # the rule choice's trials the ranking did not take
        stage(f"trying the heads of the ranking{of} ({len(nodes)} layer(s))")
        return ranked

    return widen_by_ranking(
        start, fmt, check, rank=rank, trial=trial, judged=judged,
        share=lambda c: eight_bit_share(c, macs), cost=lambda n: macs.get(n, 0) / total,
        min_share=min_share, alternative=alternative.name if alternative else None,
        leave_out=lambda nodes: leave_one_out(trials(), nodes, ranked_from, rules),
        # A swap's check stops once an output errs past the aim for sure.
        stopping=lambda c: trial(c, stop_past=aim), aim=None if top_k else aim, gate=gate,
        # A head's check stops once an output errs past `fail_past`.
        failing=None if top_k else lambda c: trial(c, stop_past=fail_past))
