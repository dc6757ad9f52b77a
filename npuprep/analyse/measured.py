"""Measured ranges against the target format: range.nonfinite, range.mask, range.overflow, range.headroom, range.underflow."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import onnx

from npuprep.analyse.finding import Finding, Findings
from npuprep.calibrate.layout import OVER_FORMATS, SCOPES, scope_of
from npuprep.calibrate.stats import CalibrationStats, RangeStats
from npuprep.errors import NpuprepError
from npuprep.graph import to_array, walk_graphs
from npuprep.model_io import Model
from npuprep.numerics import NumberFormat
from npuprep.ops import MAC_OPS, PASSTHROUGH_OPS
from npuprep.profiles import ResolvedTarget, Severity

# A tensor underflows when at least this share of its nonzero finite values lies below the
# format's smallest normal (those lose precision or flush to zero).
UNDERFLOW_SHARE = 0.01


def measured_findings(
    model: Model, target: ResolvedTarget, stats: CalibrationStats, *, as_stored: bool = False,
) -> Findings:
    """One finding per tensor whose measured range leaves the format (or its headroom).

    `as_stored`: a converted model that already stores some tensors in a low format decided
    to compute the others in FP32, and their ranges are not held against the target format
    (`check` of a conversion). Crosscheck leaves it off: there the compiler's report, not the
    ONNX types, says what ran in FP16.
    """
    profile, fmt = target.profile, target.fmt
    covered = scope_of(stats.detail).formats if stats.detail in SCOPES else OVER_FORMATS
    if fmt.name in OVER_FORMATS and fmt.name not in covered:
        raise NpuprepError(f"statistics calibrated with detail {stats.detail!r} count values past the "
                           f"max of {' and '.join(covered)} only, not {fmt.name}: calibrate with detail "
                           "'auto' for it")
    ops = _producer_ops(model)
    stored_fp32 = kept_fp32(model) if as_stored else set()
    found: list[Finding] = []
    masks: list[tuple[RangeStats, str]] = []
    from_masks = downstream_of_mask_constants(model)
    from_large_masks = _downstream_of_large_masks(model, fmt)
    inputs = {(scope.path, i.name) for scope in walk_graphs(model.graph) for i in scope.graph.input}
    for key in sorted(stats.tensors):
        s = stats.tensors[key]
        if (s.scope, s.tensor) not in ops and (s.scope, s.tensor) not in inputs:
            continue  # measured on the source, gone from this graph (a folded sum)
        op = ops.get((s.scope, s.tensor), "")
        where = dict(node=s.node, op_type=op, tensor=s.tensor, scope=s.scope)
        base = _evidence(s, target, stats)
        if (s.tensor in from_masks and is_mask_like(s)) or (
                s.tensor in from_large_masks and _large_mask_like(s, fmt, target.limit)):
            masks.append((s, op))
            continue
        if s.nan_count or s.inf_count:
            found.append(Finding(
                rule="range.nonfinite", severity=profile.severity["overflow"], **where,
                message=f"{s.tensor} already holds {s.nan_count} NaN and {s.inf_count} Inf values in FP32"
                        f"{_on(stats)}; no target format can fix that",
                evidence=base, remedy="none",
                remedy_text="find where the FP32 model produces them (bad inputs, division by zero, log of 0)",
            ))
            continue
        if fmt.name == "fp32" or s.tensor in stored_fp32:
            continue
        remedy = "rescale" if op in MAC_OPS else "pin_fp32"
        remedy_text = (
            "scale the producer's weights by 2^-k so the tensor fits, or pin it to FP32"
            if remedy == "rescale" else "pin the producing node to FP32, or clamp it where the values are bounded"
        )
        limit = target.limit
        if s.absmax > fmt.max:
            n_over = s.over.get(fmt.name, 0)
            samples_over = sum(1 for v in s.per_sample_absmax if v > fmt.max)
            found.append(Finding(
                rule="range.overflow", severity=profile.severity["overflow"], **where,
                message=f"{s.tensor} reaches {s.absmax:.4g}, above {fmt.name} max {fmt.max:g} "
                        f"({n_over} values, {_share(n_over / s.count)}; {samples_over} of "
                        f"{len(s.per_sample_absmax)} samples){_outlier(samples_over, s)}{_on(stats)}",
                evidence=base | {"count_above_max": n_over, "share_above_max": n_over / s.count,
                                 "samples_above_max": samples_over},
                remedy=remedy, remedy_text=remedy_text,
            ))
        elif s.absmax > limit:
            share = s.fraction_above(limit)
            samples_over = sum(1 for v in s.per_sample_absmax if v > limit)
            found.append(Finding(
                rule="range.headroom", severity=profile.severity["headroom"], **where,
                message=f"{s.tensor} reaches {s.absmax:.4g}, {100 * s.absmax / fmt.max:.0f}% of {fmt.name} "
                        f"max, beyond headroom {profile.headroom:g} x max = {limit:g} "
                        f"({samples_over} of {len(s.per_sample_absmax)} samples){_on(stats)}",
                evidence=base | {"share_above_limit": share, "samples_above_limit": samples_over},
                remedy=remedy, remedy_text=remedy_text,
            ))
        under = _underflow_share(s, fmt)
        if under is not None and under >= UNDERFLOW_SHARE:
            found.append(Finding(
                rule="range.underflow", severity=profile.severity["underflow"], **where,
                message=f"{_share(under)} of {s.tensor}'s nonzero values lie below {fmt.name}'s smallest "
                        f"normal {fmt.min_normal:.3g} (abs-max {s.absmax:.3g}){_on(stats)}",
                evidence=base | {"share_below_min_normal": under, "count_below_min_normal": s.under[fmt.name],
                                 "min_normal": fmt.min_normal},
                remedy="rescale",
                remedy_text="scale the tensor up by 2^k (exact) so its values clear the smallest normal",
            ))
    if masks:
        found.append(_mask_finding(masks, fmt))
    return Findings(tuple(sorted(found, key=lambda f: (-int(f.severity), f.rule, f.tensor))))


def kept_fp32(model: Model) -> set[str]:
    """Tensors computed in FP32 by a model that stores others in FP16/BF16 (a conversion's
    islands); empty for a model that is FP32 throughout."""
    from onnx import TensorProto

    from npuprep.graph import infer_tensors

    types = infer_tensors(model.proto).types
    # Node outputs, not initialisers: a source with BF16 weights behind Casts is FP32 throughout.
    computed = {o for scope in walk_graphs(model.proto.graph) for n in scope.graph.node for o in n.output}
    if not any(types.get(o) in (TensorProto.FLOAT16, TensorProto.BFLOAT16) for o in computed):
        return set()
    # A Cast to FP32 (at an island border or an output) carries values that went through FP16.
    casts = {o for scope in walk_graphs(model.proto.graph) for n in scope.graph.node
             if n.op_type == "Cast" for o in n.output}
    return {name for name, t in types.items() if t == TensorProto.FLOAT and name not in casts}


def _evidence(s: RangeStats, target: ResolvedTarget, stats: CalibrationStats) -> dict:
    per_sample = [v for v in s.per_sample_absmax if not math.isnan(v)]
    fmt = target.fmt
    return {
        "format": fmt.name,
        "absmax": s.absmax,
        "min": s.min,
        "max": s.max,
        "format_max": fmt.max,
        "limit": target.limit,
        "headroom": target.profile.headroom,
        "use_of_max": s.absmax / fmt.max if not math.isnan(s.absmax) else None,
        "nan_count": s.nan_count,
        "inf_count": s.inf_count,
        "count": s.count,
        "samples": len(per_sample),
        "median_sample_absmax": statistics.median(per_sample) if per_sample else None,
        "synthetic": stats.synthetic,
    }


def _underflow_share(s: RangeStats, fmt: NumberFormat) -> float | None:
    """Share of detailed, nonzero, finite values below the smallest normal; None if unmeasured."""
    if fmt.name not in s.under:
        return None
    nonzero = s.detailed_count - s.zero_count - s.nan_count - s.inf_count
    return s.under[fmt.name] / nonzero if nonzero > 0 else None


def _producer_ops(model: Model) -> dict[tuple[str, str], str]:
    ops: dict[tuple[str, str], str] = {}
    for scope in walk_graphs(model.graph):
        for node in scope.graph.node:
            for out in node.output:
                ops[(scope.path, out)] = node.op_type
    return ops


def _share(v: float) -> str:
    return f"{100 * v:.3g}%"


def _on(stats: CalibrationStats) -> str:
    return " [synthetic samples, not real data]" if stats.synthetic else ""


def _outlier(samples_over: int, s: RangeStats) -> str:
    if samples_over == 1 and len(s.per_sample_absmax) > 2:
        return "; a single outlier sample"
    return ""


def mask_tensors(model: Model, stats: CalibrationStats) -> set[str]:
    """The measured tensors that hold an intentional -inf mask (computed from a mask constant,
    -inf their only non-finite value): labelled `mask` and listed last, never a failure."""
    from_masks = downstream_of_mask_constants(model)
    return {s.tensor for s in stats.tensors.values() if s.tensor in from_masks and is_mask_like(s)}


def is_mask_like(s: RangeStats) -> bool:
    """-Inf and no other non-finite value: what an additive attention mask (or a -inf fill
    in a Where) gives, which softmax turns into exact zeros."""
    return s.inf_count > 0 and s.nan_count == 0 and s.min == -math.inf and math.isfinite(s.max)


def _large_mask_like(s: RangeStats, fmt: NumberFormat, limit: float) -> bool:
    """Finite, beyond the format only below (where a -1e9 mask value was added), within the
    limit above: lowering stores the mask constant as -max, and these values follow it."""
    return (s.nan_count == 0 and s.inf_count == 0 and s.min < -fmt.max
            and math.isfinite(s.min) and s.max <= limit)


# Ops that carry an additive mask's large negative values on to where they are added
# (Softmax, a MatMul... end it: what they make is no mask any more).
_MASK_PATH = PASSTHROUGH_OPS | {"Where", "Concat", "Tile", "Slice", "Gather", "Add", "Sub", "Mul",
                                "Min", "Max"}


def _downstream_of_large_masks(model: Model, fmt: NumberFormat) -> set[str]:
    """Tensors made along _MASK_PATH from a constant whose only values beyond `fmt` are
    negative (a -1e9 mask where FP16 tops out at 65504; -inf is downstream_of_mask_constants')."""

    def large_mask(t: onnx.TensorProto) -> bool:
        if t.data_type not in (1, 10, 11, 16) or t.data_location == onnx.TensorProto.EXTERNAL:
            return False
        value = to_array(t).astype("float64")
        return value.size > 0 and bool((value < -fmt.max).any()) and bool((value <= fmt.max).all())

    return _downstream_of(model, large_mask, ("Constant",), _MASK_PATH)


def _mask_finding(masks: list[tuple[RangeStats, str]], fmt: NumberFormat) -> Finding:
    """One warning for every tensor holding only -inf (or a large negative mask value) beyond
    the format."""
    first, op = masks[0]
    names = [s.tensor for s, _ in masks]
    finite_absmax = max((max(abs(s.max), 0.0) for s, _ in masks), default=0.0)
    return Finding(
        rule="range.mask", severity=Severity.WARNING, node=first.node, op_type=op,
        tensor=first.tensor, scope=first.scope,
        message=f"{len(masks)} tensor(s) hold -inf or a mask value below -{fmt.max:.6g} and "
                f"nothing else beyond {fmt.name} (first: "
                f"{first.tensor}): an additive mask, intentional; lowering stores mask "
                f"constants as {fmt.name}'s -max",
        evidence={"tensors": names, "count": len(masks), "largest_finite": finite_absmax},
        remedy="none",
        remedy_text="nothing to do if these are masks; check that -max survives the compiler",
    )


# A constant at or below this is a mask value (-inf, or FP32's lowest used instead).
_MASK_VALUE = -1e30


def downstream_of_mask_constants(model: Model) -> set[str]:
    """Tensors computed from a constant holding -inf (or FP32 lowest), every scope: where
    their -inf comes from, it was put there on purpose (a Log of 0 is not among them)."""

    def holds_mask(t: onnx.TensorProto) -> bool:
        # Weights left on disk (calibrate does not load them) are no mask constants.
        if t.data_type not in (1, 10, 11, 16) or t.data_location == onnx.TensorProto.EXTERNAL:
            return False
        value = to_array(t)
        return value.size > 0 and bool((value.astype("float64") <= _MASK_VALUE).any())

    return _downstream_of(model, holds_mask, ("Constant", "ConstantOfShape"), None)


def _downstream_of(model: Model, is_source: Callable[[onnx.TensorProto], bool], constant_ops: tuple[str, ...],
                   path_ops: frozenset[str] | set[str] | None) -> set[str]:
    """Tensors computed from a constant (initialiser or `constant_ops`' value) that
    `is_source` accepts, through `path_ops` (None: through every op), every scope."""
    from npuprep.graph import attribute

    tainted: set[str] = set()
    for scope in walk_graphs(model.graph):
        tainted |= {i.name for i in scope.graph.initializer if is_source(i)}
        for node in scope.graph.node:
            value = attribute(node, "value") if node.op_type in constant_ops else None
            if value is not None and hasattr(value, "data_type") and is_source(value):
                tainted.update(o for o in node.output if o)
    changed = bool(tainted)
    while changed:
        changed = False
        for scope in walk_graphs(model.graph):
            for node in scope.graph.node:
                if (path_ops is None or node.op_type in path_ops) \
                        and any(i in tainted for i in node.input) \
                        and not all(o in tainted for o in node.output if o):
                    tainted.update(o for o in node.output if o)
                    changed = True
    return tainted

