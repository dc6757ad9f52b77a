"""The notes an 8-bit conversion gives of its stages: what was balanced, equalised or centred
and what that measured, the share/error curve the search tried, the decided scores held by
chance."""

from __future__ import annotations

from collections.abc import Sequence

from npuprep.formatting import ratio
from npuprep.report.output_verdicts import chance_said
from npuprep.verify.channel_shift import Centred
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.qdq_model import EQUALISE_MIN_GAIN, Balanced, Equalised
from npuprep.verify.widening import CurvePoint


def chance_notes(check: OutputCheck) -> list[str]:
    """A note per score output whose decided calibration scores all held where a redraw of the
    samples would more likely than not flip one (npuprep.verify.detection_odds): the search
    keeps the most 8-bit head that holds, so its luck is selected, and unseen samples meet it."""
    return [f"{name}: every decided score held on the calibration samples, but "
            f"{chance_said(row)} on a redraw of them: unseen samples may flip some"
            for name, row in check.outputs.items() if row.get("detect_held_by_chance")]


def curve_note(curve: Sequence[CurvePoint], runs: int, chosen_rel_l2: float) -> str:
    """The share/error points the search tried, in the order tried, the chosen one marked:
    the last tried whose error is the chosen check's (with two searches, or a shorter head
    tried after it, the last passing point need not be the one kept)."""
    chosen = next((p for p in reversed(curve) if p.rel_l2 == chosen_rel_l2 and not p.at_least),
                  None)
    points = ", ".join(f"{p.share:.0%}{'*' if p is chosen else ''} -> "
                       f"{'>=' if p.at_least else ''}{p.rel_l2:.3g}" for p in curve)
    return (f"8-bit share -> outputs' rel L2 on the calibration samples, as tried ({runs} "
            f"trial run{'' if runs == 1 else 's'}, a session per phase; * chosen): {points}")


def centred_note(done: Centred) -> str:
    """What the centring kept, how far it narrowed INT8's span and what its layers measured."""
    worst = max(done.errors.values(), key=lambda e: e[0])
    return (f"{len(done.tensors)} INT8 layer input(s) centred per channel (x - c, each an Add "
            f"over the tensor in the wider format; their layers' biases take W.c back, less "
            f"the 8-bit weight's error at the centred input's mean: the OS+ shift), what INT8 "
            f"spans narrowed "
            f"{ratio(min(g for _, g in done.tensors.values()))}-"
            f"{ratio(max(g for _, g in done.tensors.values()))}; kept by their layers' error "
            f"alone on samples neither the centres nor the clips were fitted to (worst "
            f"{worst[0]:.3g} -> {worst[1]:.3g}){lifted_note(done)}")


def lifted_note(done: Balanced | Equalised | Centred) -> str:
    """What the rescaled tensors' clips keep for unseen samples, where any keeps more than the
    spread of their samples' abs-maxima gives."""
    raised = sorted(done.unseen_raise.values())
    if not raised:
        return ""
    span = f"{raised[0]:.2g}x" if len(raised) == 1 else f"{raised[0]:.2g}-{raised[-1]:.2g}x"
    return (f"; {len(raised)} of them keep the headroom a calibration sample left out of the fit "
            f"showed (clips raised {span}), where that erred less on the unfitted samples")


def equalised_note(done: Equalised) -> str:
    """What the equalisation kept, or why it kept nothing, with the error it measured."""
    count = len({c.tensor for c in done.chains})
    measured = (f"outputs' rel L2 with every layer in INT8 on samples neither the factors nor the "
                f"clips were fitted to {'at most ' if done.stopped else ''}{done.before:.3g} -> "
                f"{done.after:.3g}")
    return (f"{count} Conv input(s) equalised into their producers (each channel's range raised "
            f"to the largest's): {measured}{lifted_note(done)}" if count else
            f"Conv inputs' channels not equalised: {measured} (kept only where it takes "
            f"{EQUALISE_MIN_GAIN:.0%} off)")
