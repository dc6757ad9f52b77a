"""Verdict sentences on a report's output errors: where the error sits, ties.

Pure functions of the dicts that npuprep.verify.output_errors.OutputErrors measures (and the
convert report stores, with the outputs that failed), so the terminal, the Markdown report
and convert's notes say the same; the rule that passes an output is `output_passes` there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def describe_worst(errors: Mapping[str, Any]) -> str:
    """'worst sample #4: 62% of its error at 1 of 40 positions', and for class scores
    (probabilities, or an output judged by --top-k) '; at the worst, FP32's top two are
    0.66 / 0.34, decision kept' and how many top-1 decisions agree; '' when the output has
    no such record."""
    w = errors.get("worst_sample")
    if not w:
        return ""
    said = (f"worst sample #{w['sample']} (rel L2 {w['rel_l2']:.3g}): {100 * w['share']:.0f}% of its "
            f"error at {w['positions']} of {w['of']} positions")
    if "top1_agreement" not in errors and "top_k" not in errors:
        return said  # not class scores: no decision to speak of
    top2 = " / ".join(f"{v:.3g}" for v in w["reference_top2"])
    kept = "decision kept" if w["same_decision"] else "decision changed"
    said += f"; at the worst, FP32's top two are {top2}, {kept}"
    if "top1_agreement" in errors:
        rows = errors["top1_positions"]
        ties = errors.get("top1_ties", 0)
        said += (f"; top-1 agrees at {round(errors['top1_agreement'] * rows)} of {rows} "
                 f"{'decided ' if ties else ''}positions over all samples"
                 f"{f' ({ties} FP32 tie(s) within rtol not counted)' if ties else ''}")
    return said


def where_errors_sit(report: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, Any], str]]:
    """(which samples, output, errors, describe_worst) for each output of a convert report
    that failed (as its check recorded) with no Inf/NaN and has a worst-sample record:
    calibration, then holdout."""
    found = []
    for which, key in (("calibration samples", "verification"), ("holdout", "holdout")):
        check = report.get(key) or {}
        failed = set(check.get("failed") or ())
        for name, errors in (check.get("outputs") or {}).items():
            said = describe_worst(errors)
            if said and not errors["nonfinite"] and name in failed:
                found.append((which, name, errors, said))
    return found


def judged_by_decisions(errors: Mapping[str, Any]) -> bool:
    """The output was named to be judged by its decisions (--top-k, --detect, --metric)."""
    return "top_k" in errors or "detect" in errors


def agreement_said(errors: Mapping[str, Any]) -> str:
    """The decisions' cell of an output judged by them, else '': 'top-1 100% (2 ties, 0
    flipped)', 'detections held (41 detections, 5-9 per sample)', '2 of 9120 decided scores
    changed side (...)', 'rel L2 0.012 at 41 detections', or why a detector's rule fell back."""
    if "detect" in errors:
        if "detect_fallback" in errors:
            return f"no detections: rel L2 {errors['rel_l2']:.3g}"
        per = errors["detections"]
        counts = (f"{sum(per)} detection{'s' if sum(per) != 1 else ''}"
                  + (f", {min(per)}-{max(per)} per sample" if len(per) > 1 else ""))
        if "rel_l2_at_detections" in errors:
            return f"rel L2 {errors['rel_l2_at_detections']:.3g} at {counts}"
        ties = errors.get("detect_ties", 0)
        # Counted, not a share: every background entry FP32 decides is in the denominator.
        moved = round((1 - errors["detect_agreement"]) * errors["detect_entries"])
        said = (f"{moved} of {errors['detect_entries']} decided scores changed side" if moved
                else "detections held")
        return (f"{said} ({counts}"
                + (f"; {ties} within rtol, {errors['detect_ties_flipped']} flipped" if ties else "")
                + (f"; by chance: {chance_said(errors)}" if errors.get("detect_held_by_chance")
                   else "")
                + ")")
    if "top_k" not in errors:
        return ""
    return f"{decision_said(errors)} {100 * errors['top_k_agreement']:.4g}%{ties_said(errors)}"


def chance_said(errors: Mapping[str, Any]) -> str:
    """'1.09 flips expected at the error near the threshold (rms 0.083)': a score output whose
    decided scores held while a redraw of its samples would more likely than not flip one."""
    return (f"{errors['detect_expected_flips']:.3g} flips expected at the error near the "
            f"threshold (rms {errors['detect_near_rms']:.2g})")


def detection_failure_said(errors: Mapping[str, Any]) -> str:
    """Why an output judged by a detector's detections failed, in a few words: '2 decided
    scores changed side' or 'rel L2 0.061 at its 41 detections'."""
    if "rel_l2_at_detections" in errors:
        return (f"rel L2 {errors['rel_l2_at_detections']:.3g} at its "
                f"{sum(errors['detections'])} detections")
    moved = round((1 - errors["detect_agreement"]) * errors["detect_entries"])
    return f"{moved} decided score{'s' if moved != 1 else ''} changed side"


def decision_said(errors: Mapping[str, Any]) -> str:
    """How an output judged by its decisions is judged, in words: 'top-K' or 'CTC text'."""
    return "CTC text" if errors.get("ctc_text") else f"top-{errors['top_k']}"


def ties_said(errors: Mapping[str, Any]) -> str:
    """' (2 ties, 1 flipped)' for an output judged by --top-k whose reference had ties, else ''."""
    ties = errors.get("top_k_ties", 0)
    return f" ({ties} tie{'s' if ties != 1 else ''}, {errors['top_k_ties_flipped']} flipped)" if ties else ""
