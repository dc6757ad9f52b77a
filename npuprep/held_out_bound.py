"""What a passing held-out check of decisions rules out: none changed on n samples -> a share up to 1 - 0.05^(1/n) is not ruled out.

An output judged by its decisions (`--top-k`, `--detect`, `--metric`) passes on held-out
samples whose every decision held, whatever its rel L2. But "none of n changed" says little
when n is small: a model that changes the decisions of 1 sample in 2 holds all of 4 samples
1 time in 16. ppocr_rec in INT8 held every text on its 4 held-out samples and changed 4 of 48
fresh ones (under the same emulation). The bound said is the exact one-sided upper bound on
the share of samples with a changed decision, at CONFIDENCE, when none of n changed
(Clopper-Pearson; about 3 / n, the rule of three), and how many held-out samples would bring
it down to RULED_OUT. It is said only where the verdict rests on the decisions (the output's
rel L2 is over the tolerance) and the bound is over RULED_OUT. Samples, not positions, are
counted: a sample's steps or anchors share its input and do not fail independently.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from npuprep.formatting import number, percent

CONFIDENCE = 0.95
# A share of samples with a changed decision at or under this is ruled out well enough.
RULED_OUT = 0.05


def unseen_share(samples: int, confidence: float = CONFIDENCE) -> float:
    """The largest share of samples with a changed decision that `samples` samples, none
    changed, do not rule out at `confidence` (1.0 with none)."""
    if samples <= 0:
        return 1.0
    return 1.0 - (1.0 - confidence) ** (1.0 / samples)


def samples_to_rule_out(share: float, confidence: float = CONFIDENCE) -> int:
    """Samples, none changed, that rule out a `share` of samples with a changed decision."""
    return math.ceil(math.log(1.0 - confidence) / math.log(1.0 - share))


def resting_on_decisions(samples: int, rtol: float,
                         outputs: Mapping[str, Any]) -> list[str]:
    """The outputs of a held-out check on `samples` samples (OutputCheck.outputs, or its
    report's) that pass by their decisions alone (judged by them, every one held, the rel L2
    over `rtol`) on too few samples to rule out RULED_OUT of them changing; [] otherwise. A
    report's row that is not one (hand-edited) rests on nothing."""
    if not isinstance(samples, int) or unseen_share(samples) <= RULED_OUT or samples <= 0:
        return []
    return sorted(name for name, o in outputs.items()
                  if isinstance(o, Mapping) and ("top_k" in o or "detect" in o)
                  and not o.get("detect_fallback")
                  and isinstance(o.get("rel_l2"), int | float) and o["rel_l2"] > rtol
                  and _all_held(o))


def held_out_bound_note(samples: int, rtol: float,
                        outputs: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The note where `resting_on_decisions` names outputs; None otherwise."""
    resting = resting_on_decisions(samples, rtol, outputs)
    if not resting:
        return None
    names = ", ".join(f"'{n}' (rel L2 {number(outputs[n]['rel_l2'])})" for n in resting)
    return (f"held-out decisions: {names} passed by decisions held on all {samples} "
            f"held-out samples, over the rel L2 tolerance; so few rule out a share of samples "
            f"with a changed decision above {percent(unseen_share(samples))} only "
            f"({percent(CONFIDENCE)} confidence); {samples_to_rule_out(RULED_OUT)} held-out "
            f"samples (--holdout) would rule out {percent(RULED_OUT)}")


def _all_held(errors: Mapping[str, Any]) -> bool:
    if "rel_l2_at_detections" in errors:
        return False  # a box output passes by its rel L2 where FP32 detects, not by decisions
    if "detect" in errors:
        return errors.get("detect_agreement", 1.0) == 1.0
    return errors.get("top_k_agreement") == 1.0
