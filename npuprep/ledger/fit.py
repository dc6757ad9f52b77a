"""`ledger --measured`: one fit of the profile's figures from the kits of one or more models.

The ledger's time of a row is linear in what the fit sets:

    estimate = sum over formats f of s_f * roofline_f  +  sum over launch classes c of n_c * L_c  +  run

`roofline_f` is the row's roofline time of its nodes in format f at the profile's efficiencies
(launches left out); `s_f` divides that format's efficiency (compute and bandwidth alike);
`n_c` counts the nodes of launch class c that launch (ops.LAUNCH_CLASSES), `L_c` is their cost;
`run` is the per-inference cost. The fit minimises the squared *relative* error of every
measured row (each row counts alike, whatever its length) under L_c, run >= 0 and
s_f >= SCALE_FLOOR (non-negative least squares). Where the rows do not tell the figures apart (a class no row
holds, two models with as many nodes as each other), two weak penalties pick the solution:
each class cost shrinks towards one common per-node cost (weight CLASS_SHRINK), and every
figure towards the profile's own (weight PRIOR). Both are small against any measured row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from npuprep.ledger.ledger import Ledger
from npuprep.ledger.roofline import Estimate
from npuprep.profiles import Throughput

# Weights of the penalties against a row's squared relative error (1 for a row 100% off): tie
# breakers, far below any measured row.
CLASS_SHRINK = 1e-6
PRIOR = 1e-8
SCALE_FLOOR = 1e-3  # a fitted efficiency is at most 1000x the profile's
METHOD = ("non-negative least squares of the relative error of every measured row; class "
          "costs shrunk towards one per-node cost, every figure towards the profile's, where "
          "the rows do not tell them apart")


@dataclass(frozen=True)
class FitPoint:
    """One measured row (a kit's model, FP32 or converted) as the fit sees it."""

    kit: str  # the model the kit timed
    row: str  # fp32 | converted
    measured_ms: float
    estimated_ms: float  # with the profile's figures, before the fit
    roofline_ms: dict[str, float]  # per node format, launches left out
    launches: dict[str, int]  # per launch class, the nodes that launch

    def predict(self, scales: Mapping[str, float], launch_us: Mapping[str, float], run_us: float) -> float:
        return (sum(scales.get(f, 1.0) * ms for f, ms in self.roofline_ms.items())
                + sum(n * launch_us[c] / 1e3 for c, n in self.launches.items()) + run_us / 1e3)


def fit_points(kit: str, ledger: Ledger, results: Mapping[str, Any], statistic: str) -> list[FitPoint]:
    """The FP32 and converted rows of one kit's results that have an estimate and the statistic."""
    points = []
    for name, timings in results["models"].items():
        estimate = ledger.get(name)
        measured = timings.get(statistic)
        if estimate is None or estimate.estimated_ms is None or not isinstance(measured, int | float):
            continue
        points.append(_point(kit, name, float(measured), estimate))
    return points


def _point(kit: str, row: str, measured: float, estimate: Estimate) -> FitPoint:
    roofline: dict[str, float] = {}
    launches: dict[str, int] = {}
    for n in estimate.nodes:
        if n.ms is None:
            continue
        if n.ms - n.launch_ms > 0:
            roofline[n.fmt] = roofline.get(n.fmt, 0.0) + n.ms - n.launch_ms
        if n.launches:
            launches[n.launch_class] = launches.get(n.launch_class, 0) + 1
    return FitPoint(kit, row, measured, estimate.estimated_ms or 0.0, roofline, launches)


@dataclass(frozen=True)
class Fit:
    """The fitted figures, the profile's throughput with them, and every row before and after."""

    scales: dict[str, float]  # format -> s_f (efficiency divided by it)
    launch_us: float  # the common per-node cost (classes no row holds take it)
    launch_us_by_class: dict[str, float]
    run_us: float
    throughput: Throughput
    points: tuple[FitPoint, ...]
    statistic: str = "median_ms"
    # Formats whose time the rows put at nothing (the launch costs explain it): their
    # efficiency is the floor's, not a measurement.
    unbounded: tuple[str, ...] = ()

    def fitted_ms(self, point: FitPoint) -> float:
        costs = {c: self.launch_us_by_class.get(c, self.launch_us) for c in point.launches}
        return point.predict(self.scales, costs, self.run_us)

    @property
    def kits(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.kit for p in self.points))

    def to_dict(self) -> dict[str, Any]:
        return {"method": METHOD, "fitted_on": self.statistic, "kits": list(self.kits),
                "efficiency_scale": {f: 1 / s for f, s in self.scales.items()},
                "efficiency_unbounded": list(self.unbounded),
                "launch_us": self.launch_us, "launch_us_by_class": dict(self.launch_us_by_class),
                "run_us": self.run_us, "efficiency": dict(self.throughput.efficiency),
                "rows": [{"kit": p.kit, "model": p.row, "measured_ms": p.measured_ms,
                          "estimated_ms": p.estimated_ms, "fitted_ms": self.fitted_ms(p),
                          "fitted_vs_measured": self.fitted_ms(p) / p.measured_ms}
                         for p in self.points]}


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| over x >= 0 (Lawson and Hanson's active set)."""
    n = a.shape[1]
    free = np.zeros(n, bool)
    x = np.zeros(n)
    for _ in range(3 * n + 10):
        gradient = a.T @ (b - a @ x)
        if free.all() or (gradient[~free] <= 1e-12).all():
            break
        free[int(np.argmax(np.where(free, -np.inf, gradient)))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            # Step back to where the first variable reaches 0, and hold it there.
            blocked = free & (z <= 0)
            step = np.min(x[blocked] / (x[blocked] - z[blocked]))
            x = x + step * (z - x)
            free &= x > 1e-15
    return x


def fit_throughput(points: Sequence[FitPoint], throughput: Throughput, statistic: str = "median_ms",
                   *, class_shrink: float = CLASS_SHRINK, per_run: bool = True) -> Fit | None:
    """One fit over every point (module docstring); None where no point has an estimate.
    `class_shrink`: the weight pulling each class cost towards the common one (large: one
    cost for every class); `per_run`: fit the per-run cost (else the profile's is kept)."""
    if not points:
        return None
    formats = sorted({f for p in points for f in p.roofline_ms})
    classes = sorted({c for p in points for c in p.launches})
    names = [*(f"s:{f}" for f in formats), "launch", *(f"L:{c}" for c in classes), "run"]
    col = {name: i for i, name in enumerate(names)}
    measured = np.array([p.measured_ms for p in points])
    rows = np.zeros((len(points), len(names)))
    for i, p in enumerate(points):
        for f, ms in p.roofline_ms.items():
            rows[i, col[f"s:{f}"]] = ms
        for c, n in p.launches.items():
            rows[i, col[f"L:{c}"]] = n / 1e3  # figures in microseconds, times in ms
        rows[i, col["run"]] = 1 / 1e3 if per_run else 0.0
    rows /= measured[:, None]  # relative error: each row's residual over its own time
    # Held at the profile's, the per-run cost is part of every row's time before the fit.
    target = 1 - (0.0 if per_run else throughput.run_us / 1e3) / measured
    # Penalties in the rows' units: a class cost against a typical node's share of a row, the
    # run cost against a typical row.
    nodes = np.array([max(sum(p.launches.values()), 1) for p in points])
    per_node_us = 1e3 * float(np.mean(measured / nodes))
    per_run_us = 1e3 * float(np.mean(measured))
    penalties, wanted = [], []

    def penalise(weight: float, terms: Mapping[str, float], value: float) -> None:
        row = np.zeros(len(names))
        for name, k in terms.items():
            row[col[name]] = k
        penalties.append(np.sqrt(weight) * row)
        wanted.append(np.sqrt(weight) * value)

    for f in formats:
        penalise(PRIOR, {f"s:{f}": 1.0}, 1.0)
    penalise(PRIOR, {"launch": 1 / per_node_us}, throughput.launch_us / per_node_us)
    for c in classes:
        penalise(class_shrink, {f"L:{c}": 1 / per_node_us, "launch": -1 / per_node_us}, 0.0)
        penalise(PRIOR, {f"L:{c}": 1 / per_node_us}, throughput.launch_of(c) / per_node_us)
    penalise(PRIOR, {"run": 1 / per_run_us}, throughput.run_us / per_run_us)
    a, b = np.vstack([rows, *penalties]), np.concatenate([target, wanted])
    # s_f >= SCALE_FLOOR (solved as SCALE_FLOOR + a non-negative part): where the rows put a
    # format's time at nothing (all of it under the launch costs) the efficiency written is
    # the largest the floor allows, and the fit says so (`unbounded`).
    floor = np.array([SCALE_FLOOR if name.startswith("s:") else 0.0 for name in names])
    solved = nnls(a, b - a @ floor) + floor
    scales = {f: float(solved[col[f"s:{f}"]]) for f in formats}
    unbounded = tuple(f for f, v in scales.items() if v <= SCALE_FLOOR * (1 + 1e-6))
    by_class = {c: round(float(solved[col[f"L:{c}"]]), 4) for c in classes}
    launch, run = round(float(solved[col["launch"]]), 4), round(float(solved[col["run"]]), 4)
    efficiency = dict(throughput.efficiency)
    for f, s in scales.items():
        efficiency[f] = round(throughput.efficiency_of(f) / s, 6)
        efficiency[f"bandwidth_{f}"] = round(throughput.bandwidth_efficiency(f) / s, 6)
    fitted = replace(throughput, efficiency=efficiency, launch_us=launch, run_us=run,
                     launch_us_by_class={**throughput.launch_us_by_class, **by_class})
    return Fit(scales, launch, by_class, run, fitted, tuple(points), statistic, unbounded)
