"""Run probes on a backend and classify each against its FP32 reference.

`run_micro_probes(backend, fmt)` -> ProbeReport with one verdict per unit and an overall one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from npuprep.numerics import NumberFormat
from npuprep.probe.backends import Backend, _session_run, expose
from npuprep.probe.classify import Classification, Overall, overall
from npuprep.probe.micro import ProbeModel, micro_probes


@dataclass(frozen=True)
class ProbeResult:
    """One probe's verdict on one backend, with the evidence."""

    name: str
    unit: str
    output: str
    classification: Classification
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return str(self.classification.verdict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "unit": self.unit, "output": self.output,
                **self.classification.to_dict(), **self.details}


@dataclass(frozen=True)
class ProbeReport:
    """Verdicts of several probes on one backend and format."""

    fmt: NumberFormat
    backend: str
    results: tuple[ProbeResult, ...]

    @property
    def overall(self) -> Overall:
        return overall((r.name, r.classification.verdict) for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.fmt.name,
            "max": self.fmt.max,
            "threshold": self.fmt.overflow_threshold,
            "backend": self.backend,
            "overall": self.overall.to_dict(),
            "probes": [r.to_dict() for r in self.results],
        }


def reference_outputs(probe: ProbeModel, tensors: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """The FP32 reference: the probe's reference graph on onnxruntime in FP32."""
    return _session_run(expose(probe.reference, tensors), probe.feeds)


def classify_probe(probe: ProbeModel, reference: dict[str, np.ndarray],
                   observed: dict[str, np.ndarray], fmt: NumberFormat) -> ProbeResult:
    """Classify the probe's (first) output; the observed array must match the reference in size."""
    from npuprep.probe.classify import classify

    name = probe.outputs[0]
    return ProbeResult(probe.name, probe.unit, name, classify(reference[name], observed[name], fmt))


def run_micro_probes(backend: Backend, fmt: NumberFormat,
                     names: tuple[str, ...] | None = None) -> ProbeReport:
    """Every micro-probe (or those named) on `backend`, each with its own verdict."""
    results = []
    for probe in micro_probes(fmt, names):
        results.append(classify_probe(probe, reference_outputs(probe), backend.run(probe), fmt))
    return ProbeReport(fmt, backend.name, tuple(results))
