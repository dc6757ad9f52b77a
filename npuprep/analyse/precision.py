"""Precision rules: where the resolved format's significand, not its range, breaks a result.

    a = x + 30 (x in [0, 4]), y = a - 30  ->  |a| <= 34, |y| <= 4: y inherits a's rounding
    (BF16: a step of 0.25 at 32) at 34 / 4 = 8.5x its own scale: 3% where FP16 gives 0.4%

An Add or Sub whose output is much smaller than its inputs cancels: the inputs' rounding,
small relative to them, is `gain` times larger relative to the result. Measured, so that
only real cancellation counts: gain = the inputs' largest abs-max / the output's abs-max.
The rule fires where gain x the format's unit roundoff (half its eps) exceeds
INHERITED_ERROR, the relative error a result may inherit: BF16's 8 significant bits (unit
roundoff 2^-8) reach it at a gain of 2, FP16's 11 bits at 16, FP32 never in practice. Range
findings say nothing here: BF16 has FP32's range, and its hazard is this one.
"""

from __future__ import annotations

import numpy as np
import onnx

from npuprep.analyse.finding import Finding, Findings
from npuprep.calibrate.stats import CalibrationStats
from npuprep.graph import node_label, to_array, walk_graphs
from npuprep.model_io import Model
from npuprep.profiles import ResolvedTarget

# Relative error a result may inherit from the rounding of what it is computed from: past
# it, a 1% output gate is at risk from one op. plan.context's Exp input bound is the same
# number (an Exp turns an absolute input error into this relative one).
INHERITED_ERROR = 2.0**-7
CANCELLING_OPS = ("Add", "Sub")
# Constants with more elements than this are weights: their abs-max is not read here.
_CONSTANT_MAX_ELEMENTS = 4096


def cancellation_gain(inputs_absmax: float, output_absmax: float) -> float | None:
    """How much larger an input's rounding is, relative to the output, than relative to
    the input; None where the output is zero or not finite (nothing to be relative to)."""
    if not (np.isfinite(output_absmax) and np.isfinite(inputs_absmax)) or output_absmax <= 0:
        return None
    return inputs_absmax / output_absmax


def cancellation_findings(model: Model, target: ResolvedTarget, stats: CalibrationStats,
                          skip: set[str] | frozenset[str] = frozenset()) -> Findings:
    """One `precision.cancellation` finding per measured Add/Sub whose cancellation makes its
    inputs' rounding in `target.fmt` a relative error above INHERITED_ERROR of its output.
    `skip`: output tensors computed in FP32 by the model as stored (a conversion's islands)."""
    fmt = target.fmt
    half_ulp = fmt.unit_roundoff
    found: list[Finding] = []
    for scope in walk_graphs(model.graph):
        constants = _small_constants(scope.graph)
        for node in scope.graph.node:
            if node.op_type not in CANCELLING_OPS or len(node.input) != 2 or not node.output:
                continue
            out = node.output[0]
            measured = _absmax(stats, out)
            sides = [_absmax(stats, i) if i not in constants else constants[i] for i in node.input]
            if out in skip or measured is None or any(s is None for s in sides):
                continue
            largest = max(float(s) for s in sides if s is not None)
            gain = cancellation_gain(largest, measured)
            if gain is None or gain * half_ulp <= INHERITED_ERROR:
                continue
            label = node_label(node)
            found.append(Finding(
                rule="precision.cancellation", severity=target.profile.severity["hazard"],
                node=label, op_type=node.op_type, tensor=out, scope=scope.path,
                message=(f"{label} cancels: inputs up to {largest:.4g}, output up to "
                         f"{measured:.4g}; {fmt.name}'s rounding of the inputs is "
                         f"{gain * half_ulp:.2g} of the output ({gain:.3g}x its own scale)"),
                evidence={"format": fmt.name, "gain": gain, "inputs_absmax": largest,
                          "absmax": measured, "relative_error": gain * half_ulp,
                          "significand_bits": fmt.significand_bits},
                remedy="pin_fp32",
                remedy_text=(f"keep {label} and the elementwise producers of its inputs in FP32 "
                             f"(or use a format with more than {fmt.significand_bits} "
                             "significant bits)"),
            ))
    return Findings(tuple(found))


def _absmax(stats: CalibrationStats, tensor: str) -> float | None:
    r = stats.tensors.get(tensor)
    return float(r.absmax) if r is not None and r.count else None


def _small_constants(graph: onnx.GraphProto) -> dict[str, float]:
    """abs-max of the graph's small initialisers and Constant outputs (eps, offsets)."""
    values: dict[str, float] = {}
    for init in graph.initializer:
        if int(np.prod(init.dims)) <= _CONSTANT_MAX_ELEMENTS:
            values[init.name] = _abs_max_of(to_array(init))
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None and int(np.prod(value.dims)) <= _CONSTANT_MAX_ELEMENTS:
                values[node.output[0]] = _abs_max_of(to_array(value))
    return values


def _abs_max_of(array: np.ndarray) -> float:
    if array.size == 0 or not np.issubdtype(array.dtype, np.floating):
        return 0.0
    return float(np.max(np.abs(array.astype(np.float64))))
