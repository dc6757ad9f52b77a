"""Stats of a source model onto its conversion: `stats(source)` -> `stats(converted)`, tensor by name.

A tensor the conversion kept under its name takes the source's statistics, multiplied by the
scale the rewrite recorded for it (npuprep.provenance: a power of two, so the exponent
histogram shifts exactly). A float Cast or Identity the conversion inserted carries the
statistics of the tensor on its other side (`x -> Cast -> x__to_fp16`, `y__fp16 -> Cast -> y`),
and a Mul by a positive scalar constant (a rescale's exit, `y__scaled * 2 -> y`) those of its
other side divided or multiplied by that constant. Every other float tensor the conversion
introduced (a shifted softmax's `e__shifted`, a ReduceMax, a fused hard-swish's gate) has no
source statistics: it is counted as unmapped, never guessed.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx

from npuprep.calibrate.layout import OVER_FORMATS
from npuprep.calibrate.stats import CalibrationStats, RangeStats, read_stats_doc, stats_from_dict
from npuprep.errors import NpuprepError
from npuprep.graph import node_label, tensor_types, to_array, walk_graphs
from npuprep.model_io import Model
from npuprep.numerics import FLOAT_ONNX_TYPES, get_format
from npuprep.provenance import Source, find_source

# Ops whose float output holds the values of their float input (up to the target's rounding).
_SAME_VALUES = ("Cast", "Identity")


def map_to_conversion(stats: CalibrationStats, model: Model, source: Source) -> CalibrationStats:
    """`stats` of `source.fingerprint`'s model, re-keyed for `model`, its conversion.

    The result belongs to `model` (its fingerprint); `mapping` says how many tensors were
    mapped by name, rescaled, carried through Casts, and how many have no statistics.
    """
    by_name = {(s.scope, s.tensor): s for s in stats.tensors.values()}
    types = tensor_types(model.proto)
    mapped: dict[tuple[str, str], RangeStats] = {}
    floats: dict[tuple[str, str], str] = {}  # (scope, tensor) -> its producer's label ("" for inputs)
    # (input, output, factor): the output holds the input's values times factor.
    links: list[tuple[tuple[str, str], tuple[str, str], float]] = []
    scaled = 0
    for scope in walk_graphs(model.graph):
        g = scope.graph
        scalars = _positive_scalars(g)
        for v in g.input:
            if types.get(v.name) in FLOAT_ONNX_TYPES and v.name not in {i.name for i in g.initializer}:
                floats[(scope.path, v.name)] = ""
        for node in g.node:
            label = node_label(node)
            for out in node.output:
                if out and types.get(out) in FLOAT_ONNX_TYPES:
                    floats[(scope.path, out)] = label
            link = _link(node, types, scalars)
            if link is not None:
                links.append(((scope.path, link[0]), (scope.path, node.output[0]), link[1]))
    for key, producer in floats.items():
        s = by_name.get(key)
        if s is None:
            continue
        scale = source.tensor_scales.get(key[1], 1.0)
        scaled += scale != 1.0
        mapped[key] = replace(scaled_stats(s, scale), node=producer)
    direct = len(mapped)
    changed = True
    while changed:
        changed = False
        for src, dst, factor in links:
            for have, want, by in ((src, dst, factor), (dst, src, 1.0 / factor)):
                if have in mapped and want not in mapped:
                    mapped[want] = replace(scaled_stats(mapped[have], by), tensor=want[1],
                                           scope=want[0], node=floats.get(want, ""))
                    changed = True
    unmapped = sorted(t for (_, t) in floats.keys() - mapped.keys())
    seen = {s.tensor for s in mapped.values()}
    present = {t for _, t in floats}
    keys = {k: (k[1] if sum(t == k[1] for t in seen) == 1 else f"{k[0]}/{k[1]}") for k in mapped}
    return replace(
        stats,
        fingerprint=model.fingerprint,
        tensors={keys[k]: s for k, s in sorted(mapped.items())},
        unobserved={t: why for t, why in stats.unobserved.items() if t.split('/')[-1] in present},
        mapping={"source": source.fingerprint, "by_name": direct, "rescaled": scaled,
                 "through_casts": len(mapped) - direct, "unmapped": len(unmapped),
                 "unmapped_tensors": unmapped},
    )


def with_scaled_entries(stats: CalibrationStats, model: onnx.ModelProto) -> CalibrationStats:
    """`stats` (measured on the source, kept by name) plus the tensors a rewrite of it made as
    a measured tensor times a positive scalar, each scaled exactly: a rescale's entry at a
    graph input (`audio -> Mul 2 -> audio__scaled`) is read by a layer an 8-bit plan
    quantises (an STFT Conv on quiet audio), which needs its range."""
    types = tensor_types(model)
    found = dict(stats.tensors)
    for scope in walk_graphs(model.graph):
        scalars = _positive_scalars(scope.graph)
        for node in scope.graph.node:
            link = _link(node, types, scalars)
            if (link is not None and node.op_type == "Mul" and link[0] in found
                    and node.output[0] not in found):
                found[node.output[0]] = replace(scaled_stats(found[link[0]], link[1]),
                                                tensor=node.output[0], node=node_label(node))
    return replace(stats, tensors=found) if len(found) > len(stats.tensors) else stats


def _link(node: onnx.NodeProto, types: dict[str, int],
          scalars: dict[str, float]) -> tuple[str, float] | None:
    """(input, factor) when `node`'s float output is its float input times a known factor."""
    if not node.output or types.get(node.output[0]) not in FLOAT_ONNX_TYPES:
        return None
    floats = [i for i in node.input if i and types.get(i) in FLOAT_ONNX_TYPES]
    if node.op_type in _SAME_VALUES and floats:
        return floats[0], 1.0
    if node.op_type == "Mul" and len(node.input) == 2:
        a, b = node.input
        if b in scalars and a not in scalars:
            return a, scalars[b]
        if a in scalars and b not in scalars:
            return b, scalars[a]
    return None


def _positive_scalars(graph: onnx.GraphProto) -> dict[str, float]:
    """Initialisers and Constants of one positive finite value (weights not loaded are skipped)."""
    found: dict[str, float] = {}
    tensors = [(t.name, t) for t in graph.initializer]
    tensors += [(n.output[0], a.t) for n in graph.node if n.op_type == "Constant" and n.output
                for a in n.attribute if a.name == "value"]
    for name, t in tensors:
        if math.prod(t.dims) != 1 or t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        value = float(np.asarray(to_array(t), dtype=np.float64).reshape(-1)[0])
        if math.isfinite(value) and value > 0:
            found[name] = value
    return found


def scaled_stats(s: RangeStats, scale: float) -> RangeStats:
    """`s` for the tensor times `scale` (> 0). Exact for a power of two: min, max, the
    exponent histogram and the underflow counts; `over` is exact when the scaled abs-max is
    within a format, else the histogram's bound from above (the source count when the
    detail is incomplete)."""
    if scale == 1.0:
        return s
    mantissa, exponent = math.frexp(scale)
    if mantissa != 0.5:
        # Not a power of two: the histogram cannot move exactly; keep ranges, drop detail.
        hist, detailed = {}, 0
    else:
        hist, detailed = {e + exponent - 1: c for e, c in s.exp_hist.items()}, s.detailed_count
    absmax = s.absmax * scale
    over = {}
    for fmt, n in s.over.items():
        limit = get_format(fmt).max
        if not absmax > limit:
            over[fmt] = 0
        elif detailed == s.count and s.count:
            over[fmt] = sum(c for e, c in hist.items() if 2.0 ** (e + 1) > limit) + s.inf_count
        else:
            over[fmt] = n
    under = {fmt: sum(c for e, c in hist.items() if e < math.log2(get_format(fmt).min_normal))
             for fmt in (*OVER_FORMATS, "fp32")}
    return replace(
        s, min=s.min * scale, max=s.max * scale, absmax=absmax, exp_hist=hist,
        detailed_count=detailed, over=over, under=under,
        per_sample_absmax=tuple(v * scale for v in s.per_sample_absmax), ordinary_hi=s.ordinary_hi * scale,
    )


def load_stats(path: str | Path, model: Model) -> CalibrationStats:
    """Read stats.json; refuse a file that belongs to another model.

    Stats of the model `model` was converted from (its metadata or the conversion report
    beside it names the source, npuprep.provenance) are accepted and mapped onto it by tensor name
    (npuprep.calibrate.mapping; `mapping` holds the counts, `mapping_note` says them).
    """
    path = Path(path)
    stats = stats_from_dict(read_stats_doc(path), path)
    if stats.fingerprint == model.fingerprint:
        return stats
    source = find_source(model)
    if source is not None and source.fingerprint == stats.fingerprint:
        return map_to_conversion(stats, model, source)
    raise NpuprepError(
        f"{path}: stats belong to another model (fingerprint {stats.fingerprint}, "
        f"{model.path or 'the model'} has {model.fingerprint})"
    )
