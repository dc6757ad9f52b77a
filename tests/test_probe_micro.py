"""Micro-probes: every unit gives each overflow class on a real backend, emulation or a board stand-in."""

from __future__ import annotations

import numpy as np
import pytest

from npuprep.numerics import get_format
from npuprep.probe.backends import EmulateBackend, OrtBackend
from npuprep.probe.classify import Verdict
from npuprep.probe.designs import DESIGNS
from npuprep.probe.micro import micro_probes
from npuprep.probe.runner import reference_outputs, run_micro_probes

FP16 = get_format("fp16")
E4M3 = get_format("fp8_e4m3")
OVERFLOWING = tuple(n for n in DESIGNS if n != "softmax")


class WrappingBoard:
    """Board stand-in: computes wide, then wraps into FP16's range like an integer register."""

    name = "wrapping-board"

    def run(self, probe, tensors=()):
        out = reference_outputs(probe)
        return {k: (((v.astype(np.float64) + 65536) % 131072) - 65536).astype(np.float16)
                for k, v in out.items()}


class FlushingBoard:
    """Board stand-in: computes wide, then flushes anything past the FP16 threshold to 0."""

    name = "flushing-board"

    def run(self, probe, tensors=()):
        out = reference_outputs(probe)
        return {k: np.where(np.abs(v) >= FP16.overflow_threshold, 0, v).astype(np.float16)
                for k, v in out.items()}


class WideBoard:
    """Board stand-in: computes in FP32 and returns FP32, whatever the declared format."""

    name = "wide-board"

    def run(self, probe, tensors=()):
        return reference_outputs(probe)


def _by_name(report):
    return {r.name: r for r in report.results}


@pytest.mark.parametrize("name", sorted(DESIGNS))
@pytest.mark.parametrize("fmt", [FP16, E4M3], ids=["fp16", "e4m3"])
def test_design_values_are_exact_and_only_the_unit_overflows(name, fmt):
    design = DESIGNS[name](fmt)
    (probe,) = micro_probes(fmt, (name,))
    for key, value in {**design.inputs, **design.weights}.items():
        if name == "cast":
            continue
        # Every input and weight is exact in the format and in range: only the op can overflow.
        assert np.array_equal(fmt.round(value, saturate=False), value), key
    ref = reference_outputs(probe)["y"]
    if name == "softmax":
        assert np.abs(ref).max() <= 1
    else:
        # Clearly past the threshold, not in the 65505..65519 band that still rounds to max.
        assert np.abs(ref).max() >= 1.45 * fmt.overflow_threshold
        # In-range values sit beside the overflowing ones, so corruption of ordinary values shows.
        assert (np.abs(ref) < fmt.max / 4).any()


@pytest.mark.parametrize(
    ("backend", "fmt", "expected"),
    [
        (OrtBackend(FP16), FP16, Verdict.INF),
        (EmulateBackend(FP16, saturate=False), FP16, Verdict.INF),
        (EmulateBackend(FP16, saturate=True), FP16, Verdict.SATURATE),
        (EmulateBackend(E4M3, saturate=False), E4M3, Verdict.NAN),
        (EmulateBackend(E4M3, saturate=True), E4M3, Verdict.SATURATE),
        (WrappingBoard(), FP16, Verdict.OTHER_FINITE),
        (FlushingBoard(), FP16, Verdict.OTHER_FINITE),
        (WideBoard(), FP16, Verdict.NO_OVERFLOW),
    ],
    ids=["ort-ieee", "emulate-ieee", "emulate-saturate", "e4m3-nosat", "e4m3-sat", "wrap", "flush", "wide"],
)
def test_every_unit_gives_the_backends_class(backend, fmt, expected):
    report = _by_name(run_micro_probes(backend, fmt))
    for name in OVERFLOWING:
        c = report[name].classification
        assert c.verdict is expected, (name, c.reason)
        assert c.over >= 2 and c.in_range_wrong == 0, name
        assert c.pairs, name
    assert run_micro_probes(backend, fmt, OVERFLOWING).overall.verdict == str(expected)


def test_values_at_max_are_exactly_the_saturation_value():
    report = _by_name(run_micro_probes(EmulateBackend(FP16, saturate=True), FP16))
    for name in OVERFLOWING:
        for ref, obs in report[name].classification.pairs:
            assert obs == np.sign(ref) * 65504.0


def test_wide_board_is_reported_as_computed_wider():
    report = _by_name(run_micro_probes(WideBoard(), FP16))
    c = report["exp"].classification
    assert c.wider and c.exact == 2
    assert c.pairs[0][0] == c.pairs[0][1] > 65504


@pytest.mark.parametrize("backend", [OrtBackend(FP16), EmulateBackend(FP16, saturate=True), WideBoard()],
                         ids=["ort", "saturate", "wide"])
def test_softmax_does_not_overflow_internally(backend):
    c = _by_name(run_micro_probes(backend, FP16, ("softmax",)))["softmax"].classification
    assert c.verdict is Verdict.NO_OVERFLOW and not c.wider
    assert c.reference_absmax == pytest.approx(1.0)


def test_mixed_units_are_visible():
    class MacSaturatesVectorInf:
        name = "mac-saturates"

        def __init__(self):
            self.sat = EmulateBackend(FP16, saturate=True)
            self.ieee = EmulateBackend(FP16, saturate=False)

        def run(self, probe, tensors=()):
            mac = probe.name in ("conv", "matmul", "gemm")
            return (self.sat if mac else self.ieee).run(probe, tensors)

    report = run_micro_probes(MacSaturatesVectorInf(), FP16)
    o = report.overall
    assert o.verdict == "mixed"
    assert set(o.by_verdict["saturate"]) == {"conv", "matmul", "gemm"}
    assert "exp" in o.by_verdict["inf"]


def test_target_models_are_fp16_except_the_cast_input():
    from onnx import TensorProto

    for probe in micro_probes(FP16):
        inputs = {vi.name: vi.type.tensor_type.elem_type for vi in probe.target.graph.input}
        want = TensorProto.FLOAT if probe.name == "cast" else TensorProto.FLOAT16
        assert set(inputs.values()) == {want}, probe.name
        assert probe.target.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16


def test_unknown_probe_name_is_a_user_error():
    from npuprep.errors import NpuprepError

    with pytest.raises(NpuprepError, match="unknown micro-probe 'nope'|unknown micro-probe nope"):
        micro_probes(FP16, ("nope",))


def test_ort_backend_refuses_fp8():
    from npuprep.errors import NpuprepError

    with pytest.raises(NpuprepError, match="fp16 only"):
        OrtBackend(E4M3)
