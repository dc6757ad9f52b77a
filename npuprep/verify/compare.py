"""Layer-by-layer compare: `ref, cand, samples -> CompareResult` naming the first divergent node.

Both models run in one merged onnxruntime graph that reduces every shared tensor's error
to a few scalars per sample (see verify/compare_graph.py); the scalars are merged across samples
associatively (sums and maxima), so memory does not grow with the samples or the model's
activations. Tensors whose sample shows Inf/NaN or values at the format's max get a
second, targeted pass that counts them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx

from npuprep.calibrate.run import plan_streams
from npuprep.detections import Decision
from npuprep.errors import NpuprepError
from npuprep.graph import infer_tensors, node_label, producers, topological_order, walk_graphs
from npuprep.model_io import fingerprint, model_opset
from npuprep.numerics import FLOAT_ONNX_TYPES, NumberFormat
from npuprep.plan.host_scale import undo_host_scales
from npuprep.profiles import ResolvedTarget
from npuprep.verify.compare_graph import (
    BASE_COLUMNS,
    DETAIL_COLUMNS,
    ISO_COLUMNS,
    Layout,
    Pair,
    merged_graph,
)
from npuprep.verify.output_errors import OutputErrors, output_passes

SCHEMA_VERSION = 1
Feed = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class TensorCompareResult:
    """One tensor's error over all samples; truthy when it passes its thresholds.

    `rel_l2` is ||cand/s - ref|| / ||ref||, `max_abs_error` max |cand/s - ref|;
    `cand_absmax` is the candidate's stored magnitude, judged against `limit` (the
    format's max): `headroom` = limit / cand_absmax. Counts and `ref_absmax` are measured
    in a second pass, only for tensors that showed Inf/NaN or values at the limit
    (elsewhere the counts are 0 by construction and `ref_absmax` is None). `isolated_*` are the same errors with
    the node fed the reference's inputs (its own error), when isolation ran.
    """

    tensor: str
    node: str
    op_type: str
    order: int
    elements: int
    max_abs_error: float
    rel_l2: float
    cosine: float
    cand_absmax: float
    ref_absmax: float | None
    limit: float | None
    inf_count: int
    nan_count: int
    ref_nonfinite_count: int
    saturated_count: int
    scale: float
    rtol: float
    atol: float
    passed: bool
    reason: str
    isolated_max_abs_error: float | None = None
    isolated_rel_l2: float | None = None

    def __bool__(self) -> bool:
        return self.passed

    @property
    def headroom(self) -> float | None:
        if self.limit is None:
            return None
        if not math.isfinite(self.cand_absmax):
            return 0.0
        return math.inf if self.cand_absmax == 0 else self.limit / self.cand_absmax

    @property
    def severity_key(self) -> tuple[bool, int, int, bool, float]:
        """Sort key, worst first when reversed: failing, non-finite, saturated, relative error
        (a passing row whose reference is non-finite, a mask, sorts below every failure)."""
        rel = self.rel_l2 if not math.isnan(self.rel_l2) else math.inf
        return (not self.passed, self.ref_nonfinite_count == 0, self.inf_count + self.nan_count,
                self.saturated_count, rel)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "tensor": self.tensor, "node": self.node, "op_type": self.op_type,
            "order": self.order, "elements": self.elements,
            "max_abs_error": _num(self.max_abs_error), "rel_l2": _num(self.rel_l2),
            "cosine": _num(self.cosine), "cand_absmax": _num(self.cand_absmax),
            "ref_absmax": _num(self.ref_absmax), "limit": _num(self.limit),
            "headroom": _num(self.headroom), "inf_count": self.inf_count,
            "nan_count": self.nan_count, "ref_nonfinite_count": self.ref_nonfinite_count,
            "saturated_count": self.saturated_count, "scale": self.scale,
            "rtol": self.rtol, "atol": self.atol, "passed": self.passed, "reason": self.reason,
        }
        if self.isolated_rel_l2 is not None:
            d["isolated"] = {"max_abs_error": _num(self.isolated_max_abs_error),
                             "rel_l2": _num(self.isolated_rel_l2)}
        return d


@dataclass(frozen=True)
class OutputGate:
    """A conversion's own gate, from its record (npuprep.provenance): the graph `outputs`
    decide as they did in convert (no Inf/NaN, pooled rel L2 within `rtol`, or the same top-K
    decisions for outputs in `top_k`; `host_scales` multiplied back first); internal tensors
    that cross the thresholds are where to look, not failures."""

    outputs: tuple[str, ...]
    rtol: float
    atol: float
    source: str
    top_k: dict[str, Decision] = field(default_factory=dict)
    host_scales: dict[str, float] = field(default_factory=dict)

    def judge(self, reference: Sequence[Mapping[str, np.ndarray]],
              candidate: Sequence[Mapping[str, np.ndarray]]) -> dict[str, dict[str, Any]]:
        """Each output's errors over the samples, measured as convert's output check does."""
        errors = OutputErrors(top_k=self.top_k, tie_rtol=self.rtol)
        for ref, cand in zip(reference, candidate, strict=True):
            cand = undo_host_scales(cand, self.host_scales)
            for name in self.outputs:
                if name in ref and name in cand:
                    errors.add(name, ref[name], cand[name])
        return errors.result()

    def to_dict(self) -> dict[str, Any]:
        return {"outputs": list(self.outputs), "rtol": self.rtol, "atol": self.atol,
                "top_k": dict(sorted(self.top_k.items())),
                "host_scales": dict(sorted(self.host_scales.items())), "source": self.source}


@dataclass(frozen=True)
class CompareResult:
    """All compared tensors in topological order; truthy when every one passes, or, judged
    by a conversion's `gate`, when every graph output does."""

    fingerprint: str
    candidate_fingerprint: str
    tensors: tuple[TensorCompareResult, ...]
    samples: int
    samples_description: str
    rtol: float
    atol: float
    overrides: dict[str, tuple[float, float]]
    fmt: str | None
    isolate: bool
    worst_count: int = 5
    unobserved: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    gate: OutputGate | None = None
    # With a gate: each output's errors as convert measures them (OutputGate.judge).
    output_errors: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def failing_outputs(self) -> list[str]:
        """The gate's outputs that fail it (one not measured fails)."""
        if self.gate is None:
            return []
        return [o for o in self.gate.outputs
                if o not in self.output_errors or not output_passes(self.output_errors[o], self.gate.rtol)]

    @property
    def passed(self) -> bool:
        if self.gate is not None:
            return not self.failing_outputs
        return all(self.tensors)

    def __bool__(self) -> bool:
        return self.passed

    @property
    def first_divergent(self) -> TensorCompareResult | None:
        """The first failing tensor in the reference's topological order."""
        return next((t for t in self.tensors if not t), None)

    @property
    def worst(self) -> tuple[TensorCompareResult, ...]:
        ranked = sorted(self.tensors, key=lambda t: (t.severity_key, -t.order), reverse=True)
        return tuple(ranked[: self.worst_count])

    def tensor(self, name: str) -> TensorCompareResult:
        for t in self.tensors:
            if t.tensor == name:
                return t
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergent
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "compare",
            "fingerprint": self.fingerprint,
            "candidate_fingerprint": self.candidate_fingerprint,
            "passed": self.passed,
            "format": self.fmt,
            "isolate": self.isolate,
            "samples": {"count": self.samples, "description": self.samples_description},
            "thresholds": {"rtol": self.rtol, "atol": self.atol,
                           "overrides": {k: list(v) for k, v in sorted(self.overrides.items())}},
            "first_divergent": first.to_dict() if first is not None else None,
            "worst": [t.to_dict() for t in self.worst],
            "tensors": [t.to_dict() for t in self.tensors],
            "unobserved": dict(sorted(self.unobserved.items())),
            "notes": list(self.notes),
            "gate": self.gate.to_dict() if self.gate is not None else None,
            "output_errors": {k: dict(v) for k, v in sorted(self.output_errors.items())},
        }


def _num(x: float | None) -> float | str | None:
    """JSON has no Inf/NaN: write them as strings a reader can tell apart."""
    if x is None:
        return None
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return float(x)


def compare_models(
    ref: onnx.ModelProto,
    cand: onnx.ModelProto,
    samples: Iterable[Feed],
    *,
    rtol: float,
    atol: float,
    overrides: Mapping[str, tuple[float, float]] | None = None,
    tensor_scales: Mapping[str, float] | None = None,
    channel_scales: Mapping[str, np.ndarray] | None = None,
    fmt: NumberFormat | None = None,
    isolate: bool = False,
    worst: int = 5,
    threads: int | None = None,
    streams: int = 1,
    reference_outputs: list[dict[str, np.ndarray]] | None = None,
    candidate_outputs: list[dict[str, np.ndarray]] | None = None,
    fingerprints: tuple[str, str] | None = None,
) -> CompareResult:
    """Compare every float tensor the two models share by name, on the same samples.

    A tensor fails when its relative L2 error exceeds `rtol` and its max abs error exceeds
    `atol` (per-tensor `overrides` {name: (rtol, atol)}), when the candidate holds Inf/NaN
    where the reference is finite, or when it holds values pinned at `fmt`'s max where the
    reference goes beyond it. `tensor_scales` {name: s} means candidate = s * reference;
    `channel_scales` {name: s} the same with an array s that broadcasts against the tensor
    (a rewrite's per-channel rescale: the equalisation's, the balancing's), undone as well.
    `samples` should be re-iterable (a SampleSet or a list): a second pass counts Inf/NaN
    and saturated values where the first one saw any; a one-shot iterator is listed first.
    `reference_outputs`, a list, receives the reference's graph outputs of each sample (the
    output check needs no reference run of its own on them); `candidate_outputs` the
    candidate's, by the same names (nor an emulation run of its own). `fingerprints` (reference,
    candidate) name models the caller already knows (hashing a model reads all its weights).
    `threads`: each run's intra-op threads; `streams`: samples run at once (one by default).
    """
    from npuprep.runtime.session import release_freed_memory, run_in_streams

    overrides = dict(overrides or {})
    scales = dict(tensor_scales or {})
    if iter(samples) is samples:  # a one-shot iterator; the count pass needs a second look
        samples = list(samples)
    ref, cand = _same_opset(ref, cand)
    pairs, order, unobserved = _pairs(ref, cand, scales, channel_scales or {})
    for name in overrides:
        if name not in order:
            raise NpuprepError(f"--tol names tensor '{name}', which the reference does not compute")
    pairs, aliases = _layout_aliases(ref, cand, pairs, overrides)
    limit = fmt.max if fmt is not None else None
    acc = _Accumulator(pairs, isolate)
    flagged: dict[int, set[int]] = {}
    n_samples = 0
    if pairs:
        keep = [o.name for o in ref.graph.output] if reference_outputs is not None else []
        model, layout = merged_graph(
            ref, cand, pairs, limit=limit, isolate=isolate, keep=keep,
            keep_candidate=[o.name for o in cand.graph.output] if candidate_outputs is not None else ())
        theirs = layout.candidate_outputs
        # One sample at a time by default: the merged graph holds two models' activations and
        # rounded weights per run (a second stream cost the 227 MB transformer 50 MB, 12% of
        # its peak).
        session = _session(model, threads)
        del model  # the session holds the weights now
        names = list(layout.stats) + [n for row in sorted(layout.sizes) for n in layout.sizes[row]]
        fetch = names + keep + sorted(set(theirs.values()) - set(keep))
        for index, values in enumerate(run_in_streams(session, samples, fetch, streams)):
            if reference_outputs is not None:
                reference_outputs.append({n: values[n] for n in keep})
            if candidate_outputs is not None:
                candidate_outputs.append({n: values[merged] for n, merged in theirs.items()})
            rows = acc.add([values[n] for n in layout.stats], _sizes(layout, values), limit)
            if rows:
                flagged[index] = rows
            n_samples += 1
        del session
        release_freed_memory()
        if flagged:
            _count_pass(ref, cand, pairs, flagged, samples, acc, limit, threads)
    else:
        n_samples = sum(1 for _ in samples)
    if n_samples == 0:
        raise NpuprepError("no samples to compare on")

    by_name = {}
    for row, pair in enumerate(pairs):
        node, op_type, pos = order[pair.name]
        t_rtol, t_atol = overrides.get(pair.name, (rtol, atol))
        by_name[pair.name] = acc.result(row, pair, node, op_type, pos, t_rtol, t_atol, limit)
    for name, source in aliases.items():
        node, op_type, pos = order[name]
        own = 0.0 if isolate else None
        by_name[name] = replace(by_name[source], tensor=name, node=node, op_type=op_type, order=pos,
                                isolated_max_abs_error=own, isolated_rel_l2=own)
    results = sorted(by_name.values(), key=lambda t: (t.order, t.tensor))
    return CompareResult(
        fingerprint=fingerprints[0] if fingerprints else fingerprint(ref),
        candidate_fingerprint=fingerprints[1] if fingerprints else fingerprint(cand),
        tensors=tuple(results), samples=n_samples,
        samples_description=getattr(samples, "describe", lambda: f"{n_samples} samples")(),
        rtol=rtol, atol=atol, overrides=overrides, fmt=fmt.name if fmt else None,
        isolate=isolate, worst_count=worst, unobserved=unobserved,
    )


def compare_emulated(
    model: onnx.ModelProto,
    target: ResolvedTarget,
    samples: Iterable[Feed],
    *,
    pinned_nodes: Iterable[str] = (),
    rtol: float | None = None,
    atol: float | None = None,
    overrides: Mapping[str, tuple[float, float]] | None = None,
    isolate: bool = False,
    worst: int = 5,
) -> CompareResult:
    """Compare `model` with its own emulation on `target` (a profile resolved to a format).

    Overflow behaviour comes from the profile (`target.saturate`); an `unknown` profile
    is emulated as the loud case, and the result's notes say the board must be probed.
    """
    from npuprep.verify.emulate import emulate

    fmt = target.fmt
    emulation = emulate(model, fmt, saturate=target.saturate, pinned_nodes=pinned_nodes,
                        weights_in_graph=True)
    result = compare_models(
        model, emulation.model, samples,
        rtol=default_rtol(fmt) if rtol is None else rtol,
        atol=DEFAULT_ATOL if atol is None else atol,
        overrides=overrides, fmt=fmt, isolate=isolate, worst=worst,
    )
    return replace(result, notes=result.notes + emulation_notes(target, emulation.saturate)
                   + upgrade_notes(emulation))


def upgrade_notes(emulation: Any) -> tuple[str, ...]:
    """A note when the emulation had to upgrade the model's opset (its nodes need 13; FP8
    Cast needs 19)."""
    if emulation.upgraded_from_opset is None:
        return ()
    need = 19 if emulation.fmt.name.startswith("fp8") else 13
    return (f"the model declares opset {emulation.upgraded_from_opset}; the emulation needs opset "
            f"{need}, so it ran on a copy upgraded by onnx's version converter (tensor names kept)",)


DEFAULT_ATOL = 1e-3


def default_rtol(fmt: NumberFormat | None) -> float:
    """Relative L2 threshold: 1%, or two units of the format's rounding where that is coarser."""
    return 1e-2 if fmt is None else max(1e-2, 2 * fmt.eps)


def emulation_notes(target: ResolvedTarget, saturate: bool) -> tuple[str, ...]:
    """What the emulation assumed: the resolved format (`--precision bf16` says bf16), its
    overflow, and what the profile leaves to a probe."""
    from npuprep.profiles import OverflowMode
    from npuprep.verify.emulate import LIMITS

    profile, fmt = target.profile, target.fmt
    notes = [f"emulated {fmt.name} on target '{profile.name}', overflow "
             f"{'saturates to +-' + format(fmt.max, 'g') if saturate else 'gives Inf/NaN'}",
             LIMITS]
    if fmt.name.startswith("fp8"):
        if profile.fp8_saturate is None:
            notes.append(f"target '{profile.name}' does not say whether FP8 Cast saturates: "
                         "NaN on overflow was assumed; probe the board (npuprep probe)")
    elif profile.overflow is OverflowMode.UNKNOWN:
        notes.append(f"target '{profile.name}' overflow behaviour is unknown: Inf was assumed "
                     "(loud); probe the board (npuprep probe) to learn whether it saturates")
    return tuple(notes)


def _same_opset(ref: onnx.ModelProto, cand: onnx.ModelProto) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """Both models at one default-domain opset, so one merged graph can hold them."""
    from npuprep.opsets import upgrade_opset

    a, b = model_opset(ref), model_opset(cand)
    if a < b:
        ref = upgrade_opset(ref, b, why="the candidate uses a newer opset than the reference")
    elif b < a:
        cand = upgrade_opset(cand, a, why="the reference uses a newer opset than the candidate")
    return ref, cand


def _layout_aliases(
    ref: onnx.ModelProto, cand: onnx.ModelProto, pairs: list[Pair],
    overrides: Mapping[str, tuple[float, float]],
) -> tuple[list[Pair], dict[str, str]]:
    """Split off tensors whose numbers equal another compared tensor's.

    When both models produce `t` by the same layout op (same attributes, same inputs) from
    a compared tensor `u` with the same scale, t's errors, extremes and counts are u's:
    reducing it again would only cost time. Such a tensor takes u's numbers under its own
    name, and its own (isolated) error is 0 by construction.
    """
    from npuprep.ops import BLOCK_MOVE_OPS, LAYOUT_OPS

    aliased = LAYOUT_OPS | BLOCK_MOVE_OPS
    ref_prod, cand_prod = producers(ref.graph), producers(cand.graph)
    by_name = {p.name: p for p in pairs}
    aliases: dict[str, str] = {}
    for pair in pairs:
        a, b = ref_prod.get(pair.name), cand_prod.get(pair.name)
        if a is None or b is None or a.op_type not in aliased or pair.name in overrides:
            continue
        if (b.op_type, list(b.input), list(b.attribute)) != (a.op_type, list(a.input), list(a.attribute)):
            continue
        source = aliases.get(a.input[0], a.input[0])
        # A per-channel rescale does not follow a layout op's channels: no alias for one.
        if source in by_name and by_name[source].scale == pair.scale and \
                by_name[source].channel_scale is None and pair.channel_scale is None:
            aliases[pair.name] = source
    return [p for p in pairs if p.name not in aliases], aliases


def _broadcasts(factor: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """An array of shape `factor` broadcasts against a tensor of `shape`, leaving it as is."""
    try:
        return np.broadcast_shapes(shape, factor) == tuple(shape)
    except ValueError:
        return False


def _pairs(
    ref: onnx.ModelProto, cand: onnx.ModelProto, scales: dict[str, float],
    channel_scales: Mapping[str, np.ndarray],
) -> tuple[list[Pair], dict[str, tuple[str, str, int]], dict[str, str]]:
    """Shared float tensors, the producer of each reference tensor, what is not compared."""
    _check_inputs(ref, cand)
    ref_info, cand_info = infer_tensors(ref), infer_tensors(cand)
    ref_types, cand_types = ref_info.types, cand_info.types
    ref_shapes, cand_shapes = ref_info.shapes, cand_info.shapes
    cand_produced = {o for n in cand.graph.node for o in n.output if o}
    order: dict[str, tuple[str, str, int]] = {}
    for pos, node in enumerate(topological_order(ref.graph)):
        if node.op_type == "Constant":
            continue
        for out in node.output:
            if out and ref_types.get(out) in FLOAT_ONNX_TYPES:
                order[out] = (node_label(node), node.op_type, pos)
    for name, s in scales.items():
        if name not in order:
            raise NpuprepError(f"tensor_scales names tensor '{name}', which the reference does not compute")
        if not (isinstance(s, int | float) and math.isfinite(s) and s > 0):
            raise NpuprepError(f"tensor_scales['{name}'] = {s!r}: a scale must be a positive number")
    for name, c in channel_scales.items():
        shape = ref_shapes.get(name)
        if name not in order or not np.all(np.isfinite(c) & (c > 0)) or (
                shape is not None and not _broadcasts(c.shape, shape)):
            raise NpuprepError(f"channel_scales['{name}']: expected positive factors that "
                               f"broadcast against a tensor the reference computes, got shape "
                               f"{c.shape} for {shape if name in order else 'no such tensor'}")
    pairs: list[Pair] = []
    unobserved: dict[str, str] = {}
    for name in order:
        if name not in cand_produced:
            unobserved[name] = "not computed by the candidate"
        elif cand_types.get(name) not in FLOAT_ONNX_TYPES:
            unobserved[name] = "not a float tensor in the candidate"
        elif name in ref_shapes and name in cand_shapes and ref_shapes[name] != cand_shapes[name]:
            unobserved[name] = f"shape {ref_shapes[name]} in the reference, {cand_shapes[name]} in the candidate"
        else:
            shape = ref_shapes.get(name) if ref_shapes.get(name) == cand_shapes.get(name) else None
            pairs.append(Pair(name, float(scales.get(name, 1.0)), ref_types[name], cand_types[name],
                              math.prod(shape) if shape is not None else None,
                              channel_scales.get(name)))
    for scope in walk_graphs(ref.graph):
        if scope.is_main:
            continue
        for node in scope.graph.node:
            for out in node.output:
                if out and ref_types.get(out) in FLOAT_ONNX_TYPES:
                    unobserved[out] = f"inside {scope.path}: compared through its owner's outputs"
    return pairs, order, unobserved


def _check_inputs(ref: onnx.ModelProto, cand: onnx.ModelProto) -> None:
    ref_inits = {i.name for i in ref.graph.initializer}
    cand_inits = {i.name for i in cand.graph.initializer}
    ref_inputs = {vi.name for vi in ref.graph.input if vi.name not in ref_inits}
    cand_inputs = {vi.name for vi in cand.graph.input if vi.name not in cand_inits}
    if ref_inputs != cand_inputs:
        odd = sorted(ref_inputs ^ cand_inputs)[0]
        side = "reference" if odd in ref_inputs else "candidate"
        raise NpuprepError(f"input '{odd}' exists only in the {side}; both models must take the same inputs")


class _Accumulator:
    """Per-tensor sums and maxima over samples: associative, so order does not matter."""

    def __init__(self, pairs: list[Pair], isolate: bool) -> None:
        n = len(pairs)
        self.columns = BASE_COLUMNS + (ISO_COLUMNS if isolate else ())
        self.isolate = isolate
        self.static = np.array([p.elements or 0 for p in pairs], np.int64)
        self.d2 = np.zeros((n, 4 if isolate else 3))  # d2, r2, c2[, iso_d2]
        self.peaks = np.full((n, 3 if isolate else 2), -np.inf)  # |d|, |c|[, |iso d|]
        self.elements = np.zeros(n, np.int64)
        self.mismatch = np.zeros(n, bool)
        self.counts = np.zeros((n, 4), np.int64)
        self.ref_peak = np.full(n, np.nan)

    def add(self, stats: list[np.ndarray], sizes: dict[int, np.ndarray], limit: float | None) -> set[int]:
        """Fold one sample in; return the rows that need counting (non-finite, at max)."""
        s = np.array(stats, np.float64).reshape(len(self.elements), len(self.columns))
        col = {c: i for i, c in enumerate(self.columns)}
        sums = [col["d2"], col["r2"], col["c2"]] + ([col["iso_d2"]] if self.isolate else [])
        self.d2 += s[:, sums]
        peaks = [np.maximum(s[:, col["d_max"]], -s[:, col["d_min"]]),
                 np.maximum(s[:, col["c_max"]], -s[:, col["c_min"]])]
        if self.isolate:
            peaks.append(np.maximum(s[:, col["iso_d_max"]], -s[:, col["iso_d_min"]]))
        peak = np.stack(peaks, axis=1)
        self.peaks = np.maximum(self.peaks, peak)
        self.elements += self.static
        for row, (n_ref, n_cand, n_diff) in sizes.items():
            self.elements[row] += n_ref
            self.mismatch[row] |= not n_ref == n_cand == n_diff
        bad = ~np.isfinite(s[:, sums[:3]]).all(axis=1) | ~np.isfinite(peak[:, 1])
        if limit is not None:
            bad |= peak[:, 1] >= limit
        return {int(i) for i in np.flatnonzero(bad)}

    def add_counts(self, rows: list[int], detail: list[np.ndarray]) -> None:
        d = np.array(detail, np.float64).reshape(len(rows), len(DETAIL_COLUMNS))
        self.counts[rows] += d[:, :4].astype(np.int64)
        peak = np.maximum(d[:, 4], -d[:, 5])
        self.ref_peak[rows] = np.fmax(self.ref_peak[rows], peak)

    def result(self, row: int, pair: Pair, node: str, op_type: str, order: int,
               rtol: float, atol: float, limit: float | None) -> TensorCompareResult:
        d2, r2, c2 = (float(x) for x in self.d2[row, :3])
        inf, nan, ref_bad, saturated = (int(x) for x in self.counts[row])
        with np.errstate(all="ignore"):
            rel = _rel(d2, r2)
            cosine = float(np.clip((r2 + c2 - d2) / (2 * math.sqrt(r2 * c2)), -1, 1)) \
                if r2 > 0 and c2 > 0 and math.isfinite(r2 + c2 + d2) else (1.0 if r2 == c2 == 0 else math.nan)
        max_err = float(self.peaks[row, 0])
        if inf + nan > 0 and ref_bad == 0:
            max_err = math.inf if nan == 0 else math.nan
        iso_rel = _rel(float(self.d2[row, 3]), r2) if self.isolate else None
        iso_max = float(self.peaks[row, 2]) if self.isolate else None
        if self.mismatch[row]:
            passed, reason = False, "element counts differ between reference and candidate"
        elif inf + nan > ref_bad:
            passed, reason = False, f"{inf} Inf and {nan} NaN values where the reference is finite"
        elif saturated:
            passed, reason = False, f"{saturated} values pinned at +-{limit:g} where the reference exceeds it"
        elif ref_bad:
            passed, reason = True, "the reference holds non-finite values; error metrics undefined"
        elif not (rel <= rtol) and not (max_err <= atol):
            passed, reason = False, f"rel L2 {rel:.3g} > {rtol:g} and max abs error {max_err:.3g} > {atol:g}"
        else:
            passed, reason = True, ""
        ref_peak = float(self.ref_peak[row])
        return TensorCompareResult(
            tensor=pair.name, node=node, op_type=op_type, order=order,
            elements=int(self.elements[row]), max_abs_error=max_err, rel_l2=rel,
            cosine=cosine, cand_absmax=float(self.peaks[row, 1]),
            ref_absmax=None if math.isnan(ref_peak) else ref_peak,
            limit=limit, inf_count=inf, nan_count=nan, ref_nonfinite_count=ref_bad,
            saturated_count=saturated, scale=pair.scale, rtol=rtol, atol=atol, passed=passed,
            reason=reason, isolated_max_abs_error=iso_max, isolated_rel_l2=iso_rel,
        )


def _sizes(layout: Layout, values: dict[str, np.ndarray]) -> dict[int, np.ndarray]:
    return {row: np.array([int(values[n]) for n in names]) for row, names in layout.sizes.items()}


def _rel(d2: float, r2: float) -> float:
    if not math.isfinite(d2) or not math.isfinite(r2):
        return math.nan if math.isnan(d2) or math.isnan(r2) else math.inf
    if r2 == 0:
        return 0.0 if d2 == 0 else math.inf
    return math.sqrt(d2 / r2)


def sample_streams(count: int | None) -> int:
    """Samples run at once (calibration's rule, npuprep.calibrate.run.plan_streams), or one
    under a memory budget: each stream holds a run's activations."""
    from npuprep.resources import budget

    return 1 if budget() is not None else plan_streams(0, count)


def _count_pass(ref: onnx.ModelProto, cand: onnx.ModelProto, pairs: list[Pair],
                flagged: dict[int, set[int]], samples: Iterable[Feed], acc: _Accumulator,
                limit: float | None, threads: int | None) -> None:
    """Count Inf/NaN/saturated values, only for the tensors and samples that showed any."""
    from npuprep.runtime.session import run

    rows = sorted(set().union(*flagged.values()))
    names = [pairs[r].name for r in rows]
    model, layout = merged_graph(ref, cand, pairs, limit=limit, isolate=False, detail=names, base=False)
    session = _session(model, threads)
    for index, feed in enumerate(samples):
        if index in flagged:
            values = run(session, dict(feed), list(layout.detail))
            acc.add_counts(rows, [values[n] for n in layout.detail])


# Above this many bytes of weights, the compare session keeps memory before speed.
LARGE_WEIGHTS = 64 * 2**20


def _session(model: onnx.ModelProto, threads: int | None) -> Any:
    """A session on the merged model (it holds both models' weights, handed over as arrays),
    without prepacked copies of them. The candidate's weights rounded in the graph are folded
    once by onnxruntime's graph rewrites (a copy of each, and no rounding per run), except
    past LARGE_WEIGHTS, where they are rounded on each run instead and never held twice
    (a 227 MB transformer over 16 samples: 11 s and 2.5 GB folded, 18 s and 2.1 GB not)."""
    from npuprep.runtime.session import make_session

    return make_session(model, threads=threads, prepack=False, optimize=folds_weight_casts(model),
                        lean=True)


def folds_weight_casts(model: onnx.ModelProto) -> bool:
    """Whether a session on `model` may fold the Casts that round or widen its weights into a
    second copy of them: yes up to LARGE_WEIGHTS of weights (speed), no past it or past the
    run's memory budget (npuprep.resources)."""
    from npuprep.graph import weight_bytes
    from npuprep.resources import affordable

    weights = weight_bytes(model)
    return weights < LARGE_WEIGHTS and affordable(2 * weights)
