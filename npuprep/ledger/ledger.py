"""The ledger: estimated time per format, what the pins cost, the costliest nodes, the bound mix.

Rows, all on one graph (the converted one where given): all FP32; TF32 (Conv/MatMul/Gemm, the
rest FP32) where the target has it, the baseline GPUs run FP32 as; all in the target's
precision (FP16) and in BF16 where the target runs it fast; an 8-bit plan per fast 8-bit format
(Conv/MatMul/Gemm in INT8 or FP8, the rest in the target's precision); and the plan as
converted (its pins and the Casts at their borders, FP32 graph inputs and outputs included).
A row whose time needs a figure the profile lacks gets the speed-up range the known and
assumed figures allow (ranges.py). An estimate from published peaks: the board kit measures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx

from npuprep.flops import node_flops, tensor_shapes
from npuprep.formatting import percent, ratio
from npuprep.graph import node_label, tensor_types
from npuprep.ledger.formats import converted_costs, planned_costs
from npuprep.ledger.ranges import SpeedupRange, speedup_range
from npuprep.ledger.roofline import Estimate, NodeCost
from npuprep.ops import MAC_OPS
from npuprep.profiles import Pinning, ResolvedTarget, TargetProfile, Throughput

SCHEMA_VERSION = 1
KIND = "ledger"
CAVEAT = ("estimate: roofline max(FLOPs / dense peak, bytes / bandwidth) per node, from published "
          "figures, scaled by the profile's sustained efficiency, plus the launch cost of its op "
          "class and a per-run cost; no caching. Measure on the board (--export-kit), fit with --measured.")
EIGHT_BIT = ("int8", "fp8_e4m3", "fp8_e5m2")
CONVERTED = "converted"


@dataclass(frozen=True)
class Ledger:
    """Estimates per way of running one model on one target; the first is all FP32."""

    model: str
    target: str
    precision: str
    throughput: Throughput
    estimates: tuple[Estimate, ...]
    pinned: tuple[str, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)
    # The converted graph itself with every node in the target's precision and no Casts: what
    # the pins and casts are measured against (a converted model's rewrites change its nodes).
    baseline: Estimate | None = None
    # Computed tensors shape inference could not size: each counts as one element.
    unsized: tuple[str, ...] = ()

    def get(self, label: str) -> Estimate | None:
        return next((e for e in self.estimates if e.label == label), None)

    @property
    def fp32_ms(self) -> float | None:
        return self.estimates[0].estimated_ms

    def speedup(self, estimate: Estimate) -> float | None:
        if estimate is self.estimates[0]:
            return 1.0
        ms = estimate.estimated_ms
        return self.fp32_ms / ms if ms and self.fp32_ms is not None else None

    def speedup_vs_tf32(self, estimate: Estimate) -> float | None:
        tf32 = self.get("tf32")
        ms = estimate.estimated_ms
        base = tf32.estimated_ms if tf32 is not None else None
        return base / ms if base is not None and ms else None

    def _tf32_range(self, estimate: Estimate) -> dict[str, Any]:
        """`speedup_vs_tf32_range` where TF32's or the row's time is unknown (the two formats'
        assumed ranges taken independently: a wider range than the die allows, never narrower)."""
        tf32 = self.get("tf32")
        if tf32 is None or estimate is tf32 or self.speedup_vs_tf32(estimate) is not None:
            return {}
        span = speedup_range(tf32, estimate, self.throughput)
        return ({"speedup_vs_tf32_range": [span.low.speedup, span.high.speedup]}
                if isinstance(span, SpeedupRange) else {})

    def why(self, estimate: Estimate, span: SpeedupRange | str | None) -> str:
        """One sentence: where the row's speed-up comes from."""
        s = self.speedup(estimate)
        if estimate is self.estimates[0]:
            return "the baseline"
        if s is not None:
            share = estimate.memory_bound_share or 0.0
            return (f"{ratio(s)}: {percent(share)} of the estimated {estimate.label} time is "
                    f"memory-bound at this batch")
        if isinstance(span, SpeedupRange):
            low, high = ratio(span.low.speedup), ratio(span.high.speedup)
            return (f"{low if low == high else f'{low} to {high}'} (FP32 moves "
                    f"{ratio(span.bytes_ratio)} its bytes): low end at {span.low.because()}; "
                    f"high end at {span.high.because()}")
        return f"no figure: {span}" if span else "no figure"

    @property
    def focus(self) -> Estimate:
        """The row the costliest nodes come from: the converted plan, else the target's precision."""
        return self.get(CONVERTED) or self.get(self.precision) or self.estimates[0]

    def pins_cost(self) -> dict[str, Any] | None:
        """What the converted plan costs over running everything in the target's precision:
        its FP32 pins and its Casts, in ms and as a share of the converted total."""
        converted, uniform = self.get(CONVERTED), self.baseline or self.get(self.precision)
        if converted is None or uniform is None:
            return None
        c_ms, u_ms = converted.estimated_ms, uniform.estimated_ms
        pinned = set(self.pinned)
        pins_ms = converted.ms_where(lambda n: n.node in pinned or n.fmt == "fp32" and not n.cast)
        casts_ms = converted.ms_where(lambda n: n.cast)
        extra = c_ms - u_ms if c_ms is not None and u_ms is not None else None
        return {"converted_ms": c_ms, "uniform_ms": u_ms, "extra_ms": extra,
                "extra_share": extra / c_ms if extra is not None and c_ms else None,
                "fp32_nodes_ms": pins_ms, "casts_ms": casts_ms, "casts": converted.casts,
                "fp32_nodes": sum(1 for n in converted.nodes if n.fmt == "fp32" and not n.cast
                                  and n.bound != "free"),
                "unknown": converted.unknown or uniform.unknown}

    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for e in self.estimates:
            counts = e.bound_counts()
            span: SpeedupRange | str | None = None
            if self.speedup(e) is None:
                span = speedup_range(self.estimates[0], e, self.throughput)
            rows.append({"format": e.label, "estimated_ms": e.estimated_ms,
                         "speedup_vs_fp32": self.speedup(e),
                         **(span.to_dict() if isinstance(span, SpeedupRange) else {}),
                         "speedup_vs_tf32": self.speedup_vs_tf32(e),
                         **self._tf32_range(e), "why": self.why(e, span),
                         "fused_nodes": sum(1 for n in e.nodes if n.fused),
                         "memory_bound_share": e.memory_bound_share,
                         "compute_bound_nodes": counts["compute"], "memory_bound_nodes": counts["memory"],
                         "casts": e.casts, "flops": sum(n.flops for n in e.nodes),
                         "bytes": sum(n.bytes for n in e.nodes), "unknown": e.unknown})
        return rows

    def to_dict(self, *, nodes: bool = True) -> dict[str, Any]:
        """`nodes`: every node of every row too (the ledger command's --json; convert's report
        keeps the totals and the costliest)."""
        focus = self.focus
        return {"schema_version": SCHEMA_VERSION, "kind": KIND, "model": self.model,
                "target": self.target, "precision": self.precision, "estimate": True,
                "caveat": CAVEAT, "throughput": self.throughput.to_dict(),
                "sources": dict(self.sources), "formats": self.rows(), "pins": self.pins_cost(),
                "pinned_nodes": list(self.pinned), "costliest_of": focus.label,
                "unsized_tensors": list(self.unsized),
                "costliest": [n.to_dict() for n in focus.costliest(10)],
                **({"nodes": {e.label: [n.to_dict() for n in e.nodes if n.bound != "free"]
                              for e in self.estimates}} if nodes else {})}


def _unknown(profile: TargetProfile, throughput: Throughput, costs: Sequence[NodeCost]) -> str:
    missing = [f"throughput.peak_tflops.{f}" for f in dict.fromkeys(c.fmt for c in costs
                                                                     if c.bound != "free")
               if throughput.peak(f) is None]
    if throughput.bandwidth_gbs is None:
        missing.append("throughput.bandwidth_gbs")
    if not missing:
        return ""
    return f"{profile.name} publishes no {', '.join(missing)} (ask the vendor, or set it)"


def build_ledger(model: onnx.ModelProto, target: ResolvedTarget, *, name: str = "",
                 input_shapes: Mapping[str, tuple[int, ...]] | None = None,
                 throughput: Throughput | None = None, pinned: Sequence[str] | None = None,
                 converted: onnx.ModelProto | None = None) -> Ledger:
    """The ledger of the FP32 `model` on `target` in its resolved format (`--precision bf16`
    rows are BF16's); the converted row from `pinned` (a plan's FP32 nodes, Casts at their
    borders) or from a `converted` model as written."""
    profile = target.profile
    tp = throughput or profile.throughput
    # Every row is costed on one graph: the converted one where given (its rewrites change its
    # nodes), so "all FP16" and "converted" differ only by the pins and their Casts.
    graph = converted if converted is not None else model
    shapes = tensor_shapes(graph, input_shapes)
    types = tensor_types(graph)
    flops = node_flops(graph, input_shapes, shapes=shapes)
    precision = target.fmt.name

    def mixed(label: str, mac: str, rest: str) -> Estimate:
        costs = planned_costs(graph, lambda n, _: mac if n.op_type in MAC_OPS else rest, tp, shapes,
                              types, flops, casts=False)
        return Estimate(label, tuple(costs), _unknown(profile, tp, costs), tp.run_us / 1e3)

    estimates = [mixed("fp32", "fp32", "fp32")]
    # Ampere and later run FP32 Conv/MatMul as TF32 by default (TensorRT, cuDNN, cuBLAS).
    if "tf32" in (*profile.fast_dtypes, *profile.supported_dtypes) and precision != "tf32":
        estimates.append(mixed("tf32", "tf32", "fp32"))
    estimates.append(mixed(precision, precision, precision))
    if "bf16" in profile.fast_dtypes and precision != "bf16" and tp.peak("bf16") is not None:
        estimates.append(mixed("bf16", "bf16", "bf16"))
    for eight in EIGHT_BIT:
        if eight in profile.fast_dtypes and eight != precision:
            estimates.append(mixed(f"{eight} plan", eight, precision))
    costs_c: list[NodeCost] | None = None
    baseline = None
    if converted is not None:
        # A target that cannot pin runs the converted model's FP32 nodes in its own precision.
        cannot_pin = profile.fp32_pinning is Pinning.NONE
        costs_c = converted_costs(converted, tp, shapes, types, flops,
                                  fp32_runs_as=precision if cannot_pin else None)
        baseline = estimates[[e.label for e in estimates].index(precision)]
    elif pinned is not None:
        keep = set(pinned)
        costs_c = planned_costs(model, lambda n, label: "fp32" if label in keep else precision,
                                tp, shapes, types, flops, casts=True)
    if costs_c is not None:
        estimates.append(Estimate(CONVERTED, tuple(costs_c), _unknown(profile, tp, costs_c),
                                  tp.run_us / 1e3))
    sources = {k: v for k, v in profile.sources.items()
               if k in ("peak", "bandwidth", "throughput", "efficiency", "fusion", "assumed")}
    computed = {n.node for n in estimates[0].nodes if n.bound != "free"}
    unsized = tuple(o for node in graph.graph.node if node_label(node) in computed
                    for o in node.output if o and o not in shapes)
    return Ledger(name, profile.name, precision, tp, tuple(estimates), tuple(sorted(pinned or ())),
                  sources, baseline, unsized)
