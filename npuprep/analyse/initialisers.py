"""Float constants the target format cannot hold: beyond its max, flushed to zero, or mask values."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import onnx

from npuprep.analyse.context import Context, ScopeView
from npuprep.analyse.finding import Finding
from npuprep.graph import attribute, node_label, to_array
from npuprep.numerics import FLOAT_ONNX_TYPES, MASK_SCALE, NumberFormat
from npuprep.ops import MAC_OPS, PASSTHROUGH_OPS
from npuprep.profiles import Severity

# Values are scanned in slices so a multi-GB weight never needs a second full-size copy.
_CHUNK = 1 << 22
# A few flushed weights are normal (pruned or vanishing weights): they carry almost none of the
# tensor's magnitude. When values below min normal carry this share of sum(|x|) or more, the
# layer loses a visible part of what its weights contribute and the finding is raised.
UNDERFLOW_MASS = 0.01
# Consumers through which an additive mask reaches its Add unchanged in value.
_MASK_CARRIERS = PASSTHROUGH_OPS | {"Where", "Concat", "Tile"}
# BatchNormalization inputs: 1 scale, 2 bias, 3 mean, 4 variance.
_BN_INPUTS = {1: "scale", 2: "bias", 3: "mean", 4: "variance"}


@dataclass(frozen=True)
class ValueSummary:
    """What rounding a constant into one format does to it."""

    size: int
    nonzero: int
    overflow: int  # finite values that become Inf (|x| >= overflow threshold)
    worst: float  # the finite value of largest magnitude (signed)
    negative_overflow: int
    neg_inf: int
    pos_inf: int
    nan: int
    flush: int  # non-zero values that round to 0
    subnormal: int  # non-zero values that land among the subnormals
    smallest: float  # the non-zero finite value of smallest magnitude (signed), 0 when none
    mass: float  # sum of |x| over finite values
    tiny_mass: float  # sum of |x| over the values below min normal (flushed or subnormal)

    @property
    def tiny_share(self) -> float:
        """Share of the tensor's magnitude held by values the format flushes or denormalises."""
        return self.tiny_mass / self.mass if self.mass else 0.0


def summarise(value: np.ndarray, fmt: NumberFormat) -> ValueSummary:
    flat = np.asarray(value).reshape(-1)
    wide = np.float64 if flat.dtype == np.float64 else np.float32
    counts = dict(nonzero=0, overflow=0, negative_overflow=0, neg_inf=0, pos_inf=0, nan=0,
                  flush=0, subnormal=0)
    worst = 0.0
    smallest = 0.0
    mass = 0.0
    tiny_mass = 0.0
    flush_below = fmt.min_subnormal / 2
    for start in range(0, flat.size, _CHUNK):
        x = flat[start:start + _CHUNK].astype(wide, copy=False)
        a = np.abs(x)
        nonzero = np.count_nonzero(a)
        hi = a.max()
        if not np.isfinite(hi) or hi >= fmt.overflow_threshold:
            # Rare: only chunks holding huge or non-finite values pay for the detailed count.
            finite = np.isfinite(x)
            nan, pos_inf = int(np.isnan(x).sum()), int(np.isposinf(x).sum())
            neg_inf = int(np.isneginf(x).sum())
            over = finite & (a >= fmt.overflow_threshold)
            counts["nan"] += nan
            counts["pos_inf"] += pos_inf
            counts["neg_inf"] += neg_inf
            counts["overflow"] += int(over.sum())
            counts["negative_overflow"] += int((over & (x < 0)).sum())
            nonzero -= nan + pos_inf + neg_inf
            mass += float(a[finite].sum(dtype=np.float64))
            if finite.any():
                i = int(np.argmax(np.where(finite, a, -1)))
                if abs(float(x[i])) > abs(worst):
                    worst = float(x[i])
        else:
            mass += float(a.sum(dtype=np.float64))
            if hi > abs(worst):
                worst = float(x[int(np.argmax(a))])
        counts["nonzero"] += nonzero
        tiny = (a < fmt.min_normal) & (a > 0)
        if tiny.any():
            small = a[tiny]
            tiny_mass += float(small.sum(dtype=np.float64))
            counts["flush"] += int((small <= flush_below).sum())
            counts["subnormal"] += int((small > flush_below).sum())
            i = int(np.flatnonzero(tiny)[np.argmin(small)])
            if smallest == 0 or abs(float(x[i])) < abs(smallest):
                smallest = float(x[i])
    return ValueSummary(size=int(flat.size), worst=worst, smallest=smallest, mass=mass,
                        tiny_mass=tiny_mass, **counts)


def _constants(view: ScopeView) -> Iterator[tuple[str, str, np.ndarray]]:
    """(tensor name, dtype name, values) of float initialisers and Constant values, read lazily."""
    for init in view.graph.initializer:
        if init.data_type in FLOAT_ONNX_TYPES:
            yield init.name, FLOAT_ONNX_TYPES[init.data_type], to_array(init)
    for node in view.graph.node:
        if node.op_type != "Constant" or not node.output:
            continue
        value = attribute(node, "value")
        if value is not None and value.data_type in FLOAT_ONNX_TYPES:
            yield node.output[0], FLOAT_ONNX_TYPES[value.data_type], to_array(value)
        elif attribute(node, "value_float") is not None or attribute(node, "value_floats") is not None:
            yield node.output[0], "fp32", view.constant(node.output[0])


def _feeds_add(view: ScopeView, name: str, depth: int = 4, scalar: bool = False) -> bool:
    """Whether the tensor reaches an Add (or Sub) through mask-carrying ops; a `scalar` mask
    value also through the Mul that spreads it over a 0/1 mask (`(1 - m) * -1e9`)."""
    for user in view.consumer.get(name, []):
        if user.op_type in ("Add", "Sub"):
            return True
        if depth and (user.op_type in _MASK_CARRIERS or (scalar and user.op_type == "Mul")):
            if any(_feeds_add(view, out, depth - 1) for out in user.output if out):
                return True
    return False


def _role(view: ScopeView, name: str) -> tuple[onnx.NodeProto | None, str]:
    """The first consumer and how it uses the tensor (`BatchNormalization variance`, ...)."""
    users = view.consumer.get(name, [])
    for user in users:
        if user.op_type == "BatchNormalization":
            pos = list(user.input).index(name)
            return user, f"BatchNormalization {_BN_INPUTS.get(pos, 'input')}"
    for user in users:
        if user.op_type in MAC_OPS:
            return user, f"{user.op_type} weight"
    return (users[0], users[0].op_type) if users else (None, "unused")


def find(ctx: Context) -> list[Finding]:
    fmt = ctx.fmt
    profile = ctx.profile
    findings: list[Finding] = []
    for view in ctx.views():
        quiet_underflow: list[tuple[str, ValueSummary]] = []
        for name, dtype, values in _constants(view):
            summary = summarise(values, fmt)
            user, role = _role(view, name)
            node = node_label(user) if user is not None else name
            op_type = user.op_type if user is not None else "initializer"
            base = {"format": fmt.name, "size": summary.size, "consumer": role,
                    "dtype": dtype}

            mask_values = summary.neg_inf + summary.negative_overflow
            is_mask = (mask_values > 0 and summary.overflow == summary.negative_overflow
                       and summary.pos_inf == 0 and _feeds_add(
                           view, name, scalar=summary.size == 1 and summary.worst <= MASK_SCALE))
            if is_mask:
                most_negative = -np.inf if summary.neg_inf else summary.worst
                findings.append(Finding(
                    rule="init.mask_constant", severity=profile.severity["hazard"],
                    node=node, op_type=op_type, tensor=name, scope=view.path,
                    message=f"additive mask value {most_negative:.3g} is not finite in {fmt.name}",
                    evidence={**base, "mask_value": most_negative, "count": mask_values,
                              "target_value": -fmt.max},
                    remedy="clamp",
                    remedy_text=(f"make the mask value the target's -max ({-fmt.max:.6g}) where it "
                                 "is added: -inf turns a fully masked row into NaN; do not let "
                                 "lowering clip it silently"),
                ))
            elif summary.overflow:
                if role.startswith("BatchNormalization"):
                    remedy, text = "fold", (
                        "fold the BatchNormalization into the preceding Conv, or keep it in FP32; "
                        "clipping its statistics changes the output")
                elif role.endswith("weight"):
                    remedy, text = "rescale", (
                        f"scale the weights by a power of two below {fmt.max:.6g} and absorb the "
                        "factor downstream, or keep the layer in FP32")
                else:
                    remedy, text = "pin_fp32", "keep this constant and its consumers in FP32"
                findings.append(Finding(
                    rule="init.out_of_range", severity=profile.severity["overflow"],
                    node=node, op_type=op_type, tensor=name, scope=view.path,
                    message=(f"{summary.overflow} value(s) beyond {fmt.name} max {fmt.max:.6g} "
                             f"(worst {summary.worst:.4g})"),
                    evidence={**base, "count": summary.overflow,
                              "fraction": summary.overflow / summary.size,
                              "worst": summary.worst, "max": fmt.max,
                              "overflow_threshold": fmt.overflow_threshold},
                    remedy=remedy, remedy_text=text,
                ))

            if summary.flush or summary.subnormal:
                if summary.tiny_share < UNDERFLOW_MASS:
                    quiet_underflow.append((name, summary))
                    continue
                fraction = (summary.flush + summary.subnormal) / summary.nonzero
                flushes = "; subnormals flush too on this target" if profile.subnormals == "flush" else ""
                findings.append(Finding(
                    rule="init.underflow", severity=profile.severity["underflow"],
                    node=node, op_type=op_type, tensor=name, scope=view.path,
                    message=(f"{summary.tiny_share:.1%} of the magnitude lies below {fmt.name} min "
                             f"normal {fmt.min_normal:.3g}: {summary.flush} value(s) flush to zero, "
                             f"{summary.subnormal} become subnormal{flushes}"),
                    evidence={**base, "flush_count": summary.flush,
                              "subnormal_count": summary.subnormal,
                              "nonzero": summary.nonzero, "fraction": fraction,
                              "mass_fraction": summary.tiny_share,
                              "worst": summary.smallest, "min_normal": fmt.min_normal,
                              "min_subnormal": fmt.min_subnormal,
                              "subnormals": profile.subnormals},
                    remedy="rescale" if role.endswith("weight") else "pin_fp32",
                    remedy_text=("scale the weights up by a power of two (exact) and absorb the "
                                 "factor downstream, or keep the layer in FP32"),
                ))
        if quiet_underflow:
            findings.append(_quiet_underflow(view, quiet_underflow, fmt))
    return findings


def _quiet_underflow(view: ScopeView, entries: list[tuple[str, ValueSummary]],
                     fmt: NumberFormat) -> Finding:
    """One info line for the constants where only a negligible share flushes."""
    flush = sum(s.flush for _, s in entries)
    subnormal = sum(s.subnormal for _, s in entries)
    nonzero = sum(s.nonzero for _, s in entries)
    name, worst = min(entries, key=lambda e: abs(e[1].smallest))
    users = view.consumer.get(name, [])
    return Finding(
        rule="init.underflow", severity=Severity.INFO,
        node=node_label(users[0]) if users else name,
        op_type=users[0].op_type if users else "initializer", tensor=name, scope=view.path,
        message=(f"{flush} value(s) flush to zero and {subnormal} become subnormal in {fmt.name} "
                 f"across {len(entries)} constant(s), under {UNDERFLOW_MASS:.0%} of each one's magnitude"),
        evidence={"format": fmt.name, "flush_count": flush, "subnormal_count": subnormal,
                  "nonzero": nonzero, "fraction": (flush + subnormal) / max(nonzero, 1),
                  "worst": worst.smallest, "min_subnormal": fmt.min_subnormal,
                  "tensors": sorted(n for n, _ in entries)},
        remedy="none", remedy_text="usually harmless: tiny weights contribute little",
    )
