"""One count of FP32 nodes, one meaning: `pinned_nodes` -> `2 pinned by the plan, 2 kept FP32 by lowering`.

A conversion's `pinned_nodes` holds every node it keeps FP32; only the plan's pins (plan.yaml,
verification rounds included) are decisions a person can change. The rest are kept by rewriting
(a shift's subtraction, a rescale's exit) or forced by lowering (shape computations, integer
lookups, FP32-only types) and are said apart, so `4 pinned nodes` never meets a plan with none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def pin_counts(report: Mapping[str, Any]) -> tuple[int, int, int]:
    """(pinned by the plan, kept FP32 by rewriting, forced FP32 by lowering) of a convert report."""
    every = set(report.get("pinned_nodes") or ())
    plan = report.get("plan") or {}
    planned = {n for a in plan.get("actions") or () if a.get("action") == "pin_fp32"
               for n in a.get("nodes") or ()}
    lowering = set(report.get("forced_fp32") or {}) - planned
    return len(every & planned), len(every - planned - lowering), len(every & lowering)


def pins_said(report: Mapping[str, Any]) -> str:
    """`0 pinned by the plan, 2 kept FP32 by lowering` (parts that are 0 left out, but the plan's)."""
    planned, rewriting, lowering = pin_counts(report)
    parts = [f"{planned} pinned by the plan"]
    if rewriting:
        parts.append(f"{rewriting} kept FP32 by rewriting")
    if lowering:
        parts.append(f"{lowering} kept FP32 by lowering")
    return ", ".join(parts)
