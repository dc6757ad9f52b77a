"""Each 8-bit layer's sensitivity from one batch of trials: its error alone, and what keeping
it wider alone gains with every other layer in 8 bits, estimated by subtracting its own
deviation (`rank_layers`), or measured by leaving it out (`leave_one_out`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from npuprep.scale_rules import ScaleRule
from npuprep.verify.qdq_model import Sensitivity
from npuprep.verify.qdq_trials import Trials


def rank_layers(trials: Trials, nodes: Sequence[str], assign: Mapping[str, str],
                rules: Mapping[str, ScaleRule]) -> list[Sensitivity]:
    """Each of `nodes` alone in 8 bits (every other layer wider): its own error, which does
    not depend on the others; and what keeping it wider alone gains with every other layer
    of `assign` (layer -> 8-bit format) in 8 bits, estimated from the same run: the output
    deviations of layers quantised together add (to first order), so the outputs without
    layer L are those of all of them less L's own deviation (len(nodes) + 2 runs, where
    leaving each out ran once more per layer). The estimate sees the errors that cancel (two
    guidance branches: tests/test_eight_bit_widening.py) but not every one (ppocr_det: two
    layers of 61); the widening measures the layers its heads reach (`leave_one_out`). Where
    every layer in 8 bits gives Inf/NaN there is nothing to subtract from, and each layer is
    left out by a run. The runs go in batches (on Ray, spread over its actors)."""
    floats = [name for name, v in trials.expected[0].items()
              if np.issubdtype(np.asarray(v).dtype, np.floating)]
    held: dict[int, list[dict[str, np.ndarray]]] = {}

    def keep(i: int, got: list[dict[str, np.ndarray]]) -> None:
        held[i] = [{n: np.asarray(o[n], np.float64) for n in floats} for o in got]

    every, _ = trials.errors([(assign, rules), ({}, rules)], seen=keep)
    if not np.isfinite(every):
        return sorted(leave_one_out(trials, nodes, assign, rules), key=lambda s: -s.gain)
    all_in, none_in = held[0], held[1]
    estimated: dict[int, float] = {}

    def without(i: int, got: list[dict[str, np.ndarray]]) -> None:
        # All in 8 bits, less this layer's own deviation from the wider model.
        rest = [{n: a[n] - (np.asarray(o[n], np.float64) - z[n]) for n in floats}
                for a, o, z in zip(all_in, got, none_in, strict=True)]
        estimated[i] = trials.score(rest, trials.expected[:len(rest)])

    alone = trials.errors([({label: assign[label]}, rules) for label in nodes], seen=without)
    found = []
    for i, (label, own) in enumerate(zip(nodes, alone, strict=True)):
        # An Inf/NaN alone (with every layer finite): no estimate; its own error ranks it.
        rest = estimated[i] if np.isfinite(estimated[i]) else every
        found.append(Sensitivity(label, rest, every - rest, own))
    return sorted(found, key=lambda s: -s.gain)


def leave_one_out(trials: Trials, nodes: Sequence[str], assign: Mapping[str, str],
                  rules: Mapping[str, ScaleRule]) -> list[Sensitivity]:
    """Each of `nodes` kept wider alone, every other layer of `assign` in 8 bits: what that
    gains over all of them in 8 bits, measured (a run each), beside its error alone."""
    every = trials.error(assign, rules)
    alone = trials.errors([({label: assign[label]}, rules) for label in nodes])
    without = trials.errors([({n: f for n, f in assign.items() if n != label}, rules)
                             for label in nodes])
    return [Sensitivity(label, rest, every - rest, own)
            for label, rest, own in zip(nodes, without, alone, strict=True)]
