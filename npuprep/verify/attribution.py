"""Which node's FP16 rounding the output error comes from: each candidate alone in the target
format, every other node FP32, `error(y) <- only Conv_7 rounded`.

A precision failure with no overflow is FP16's rounding carried to the outputs. The first
node whose tensor diverges says where the error became visible, not where it came from: in a
recogniser it is the final Softmax, and pinning it buys nothing. Rounding one layer at a time
measures each layer's own share: independent roundings add up in squared error, so a layer
holding most of the sum is worth keeping in FP32, and a sum spread thinly over dozens of
layers is FP16's precision over the whole model, which no pin within a FLOPs budget fixes
(Polygraphy's `debug precision` bisects for the same answer; this ranks every candidate).
Candidates are layers and elementwise ops alike: `x + 1000 - 1000` loses x in the Add's
rounding, and only keeping both nodes FP32 gets it back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from npuprep.graph import node_label, walk_graphs
from npuprep.numerics import NumberFormat
from npuprep.verify.output_errors import worst_pooled_rel_l2

# A node holding less of the squared error than this is not worth a pin, however cheap.
MIN_SHARE = 0.01
# One session per measured set: past this many candidates, contiguous groups of them are
# measured first, then one by one only the nodes of the groups holding most of the error.
MAX_ONE_BY_ONE = 64
GROUPS = 16


@dataclass(frozen=True)
class LayerError:
    """One candidate's own FP16 error at the outputs (rel L2, worst output, pooled over the
    samples), its share of all candidates' squared error, and its FLOPs."""

    node: str
    op_type: str
    rel_l2: float
    share: float
    flops: int

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "op_type": self.op_type, "rel_l2": self.rel_l2,
                "share": self.share, "flops": self.flops}


@dataclass(frozen=True)
class Attribution:
    """Candidates ranked by their own error, largest first, on `samples` samples; of
    `candidates` asked, those in `layers` were measured one by one."""

    layers: tuple[LayerError, ...]
    samples: int
    candidates: int = 0
    fmt: str = "fp16"  # the format each candidate was rounded to

    def pins_for(self, error: float, rtol: float, room: float) -> tuple[LayerError, ...]:
        """The nodes whose shares, taken out of `error`, leave a predicted rel L2 within
        `rtol` for the fewest FLOPs within `room`, among nodes holding at least MIN_SHARE of
        it; () when no such set exists or `error` is within `rtol` already. Two greedy
        orders (largest share first, most share per FLOP first), each pruned of what it does
        not need; the cheaper wins."""
        if error <= rtol:
            return ()
        needed = 1.0 - (rtol / error) ** 2
        worth = [x for x in self.layers if x.share >= MIN_SHARE]
        orders = (sorted(worth, key=lambda x: (-x.share, x.node)),
                  sorted(worth, key=lambda x: (-x.share / max(x.flops, 1), -x.share, x.node)))
        sets = [s for s in (_greedy(order, needed, room) for order in orders) if s]
        return min(sets, key=lambda s: (sum(x.flops for x in s), len(s))) if sets else ()

    def to_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "candidates": self.candidates, "format": self.fmt,
                "layers": [layer.to_dict() for layer in self.layers]}


def _greedy(order: Sequence[LayerError], needed: float, room: float) -> tuple[LayerError, ...]:
    """Nodes taken in `order` until they hold `needed` within `room` FLOPs, then the costliest
    dropped again where the rest still hold it; () when `order` cannot reach it."""
    chosen: list[LayerError] = []
    held, spent = 0.0, 0
    for layer in order:
        if held >= needed and chosen:
            break
        if spent + layer.flops <= room:
            chosen.append(layer)
            held, spent = held + layer.share, spent + layer.flops
    if not chosen or held < needed:
        return ()
    for layer in sorted(chosen, key=lambda x: (-x.flops, x.share)):
        if len(chosen) > 1 and held - layer.share >= needed:
            chosen.remove(layer)
            held -= layer.share
    return tuple(chosen)


def attribute_error(model: onnx.ModelProto, fmt: NumberFormat, samples: Sequence[Mapping[str, Any]],
                    *, saturate: bool, candidates: Iterable[str],
                    flops: Mapping[str, int]) -> Attribution:
    """Rank `candidates` (node labels of `model`, an FP32 graph, in graph order) by the output
    error each gives when it alone computes in `fmt`, on `samples`, with overflow as
    `saturate` says. Shares are of the candidates' summed squared error; past
    MAX_ONE_BY_ONE candidates, only those of the worst groups are ranked one by one, and the
    other groups count in the sum as wholes. One session serves every measured set: each
    candidate's rounding has its own switch (npuprep.verify.switched)."""
    from npuprep.calibrate.run import session_threads
    from npuprep.runtime.session import make_session, run, run_in_streams
    from npuprep.verify.compare import folds_weight_casts, sample_streams
    from npuprep.verify.switched import switched_emulation

    ops = {node_label(n): n.op_type for s in walk_graphs(model.graph) for n in s.graph.node}
    wanted = [n for n in dict.fromkeys(candidates) if n in ops]
    feeds = [dict(s) for s in samples]
    # Prepacked weights (a second copy) only where the memory-for-speed trades are on.
    prepack = folds_weight_casts(model)
    reference = make_session(model, prepack=prepack, lean=True)
    expected = [run(reference, feed) for feed in feeds]
    del reference
    switched = switched_emulation(model, fmt, saturate=saturate, candidates=wanted)
    streams = sample_streams(len(feeds))
    session = make_session(switched.model, produced="the emulated model", lean=True, prepack=prepack,
                           threads=session_threads(streams))
    outputs = [o.name for o in model.graph.output]

    def error_of(rounded: set[str]) -> float:
        on = switched.feed(rounded)
        got = run_in_streams(session, [feed | on for feed in feeds], outputs, streams)
        return worst_pooled_rel_l2(list(got), expected)

    rest = 0.0
    if len(wanted) > MAX_ONE_BY_ONE:
        groups = [list(g) for g in np.array_split(np.array(wanted, dtype=object), GROUPS)]
        group_errors = sorted(((error_of(set(g)), g) for g in groups), key=lambda x: -x[0])
        wanted = []
        for e, members in group_errors:
            if rest or (wanted and len(wanted) + len(members) > MAX_ONE_BY_ONE):
                rest += e ** 2  # a group not ranked one by one counts as a whole
            else:
                wanted += members
    errors = {node: error_of({node}) for node in wanted}
    total = rest + sum(e ** 2 for e in errors.values())
    layers = sorted((LayerError(node, ops[node], float(e), float(e ** 2 / total) if total else 0.0,
                                int(flops.get(node, 0)))
                     for node, e in errors.items()), key=lambda x: (-x.rel_l2, x.node))
    return Attribution(tuple(layers), len(feeds), len(dict.fromkeys(candidates)), fmt.name)


def describe(attribution: Attribution, pins: Sequence[LayerError], error: float,
             total_flops: int, shown: int = 3) -> str:
    """'FP16 error by node (...): Conv_1 0.006 (12% of the squared error, 0.08% of FLOPs),
    ...' and either which layers a pin takes out (the predicted rel L2) or that no set within
    the FLOPs budget does."""
    from npuprep.formatting import number, percent

    def cost(layers: Sequence[LayerError]) -> str:
        return percent(sum(x.flops for x in layers) / max(total_flops, 1))

    listed = ", ".join(f"{x.node} {number(x.rel_l2)} ({percent(x.share)} of the squared error, "
                       f"{cost([x])} of FLOPs)" for x in attribution.layers[:shown])
    measured = len(attribution.layers)
    which = (f"{measured} nodes within the FLOPs budget" if measured >= attribution.candidates
             else f"the {measured} nodes of the worst groups of {attribution.candidates} "
                  "within the FLOPs budget")
    said = (f"{attribution.fmt.upper()} error by node ({which}, each alone rounded, the rest FP32, on "
            f"{attribution.samples} sample(s)): {listed}")
    if pins:
        held = sum(x.share for x in pins)
        return (f"{said}; keeping {len(pins)} of them in FP32 ({cost(pins)} of FLOPs) takes out "
                f"{percent(held)} of it: rel L2 {number(error)} -> about "
                f"{number(error * (1 - held) ** 0.5)}")
    said += "; no set of them within the FP32 FLOPs budget holds enough of it"
    top = attribution.layers[0] if attribution.layers else None
    if top is not None and top.share >= 0.5:
        return f"{said} (a larger --max-fp32-share lets more of them be kept)"
    return (f"{said}: {attribution.fmt.upper()}'s precision spread over the model, not one layer "
            "to keep in FP32")
