"""The 8-bit conversion's measurements, each run once and spread over the cores: the Conv
balancing reads what equalisation measured of the same model (npuprep.verify.qdq_model.Measured),
and a pass over a few samples runs one single-thread session per core
(npuprep.calibrate.run.pass_streams), bit for bit as one sample at a time."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper, parser

import npuprep.calibrate.channels as channels
import npuprep.calibrate.executors as executors
import npuprep.calibrate.run as calibrate_run
import npuprep.resources as resources
import npuprep.verify.qdq_model as qdq_model
from npuprep.calibrate import calibrate
from npuprep.calibrate.run import pass_streams
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import eight_bit_format
from npuprep.scale_rules import DEFAULT_RULE, ScaleRule
from npuprep.verify.compare import compare_models
from npuprep.verify.qdq_model import balance_conv_inputs, equalise_channels, model_errors, quantise
from npuprep.verify.qdq_trials import Variant, errors_alone, errors_alone_each

INT8 = eight_bit_format("int8")
RNG = np.random.default_rng(43)

# x -> Conv c1 (8 channels) -> PRelu -> h -> Conv c2 -> y; h also -> Conv c3 -> z
CHAIN = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[1, 3, 12, 12] x) => (float[1, 4, 10, 10] y, float[1, 2, 10, 10] z) {
    a = Conv <pads = [1, 1, 1, 1]> (x, W1, B1)
    h = PRelu (a, slope)
    [c2] y = Conv <kernel_shape = [3, 3]> (h, W2)
    [c3] z = Conv <kernel_shape = [3, 3]> (h, W3)
}
"""


def _model() -> onnx.ModelProto:
    # Channel c of h reaches 2^(c/2); the readers weigh it by the inverse.
    spread = 2.0 ** (np.arange(8) / 2)
    weights = {"W1": RNG.standard_normal((8, 3, 3, 3)) * spread.reshape(8, 1, 1, 1),
               "B1": RNG.standard_normal(8), "slope": np.full((8, 1, 1), 0.2),
               "W2": RNG.standard_normal((4, 8, 3, 3)) / spread.reshape(1, 8, 1, 1),
               "W3": RNG.standard_normal((2, 8, 3, 3)) / spread.reshape(1, 8, 1, 1)}
    proto = parser.parse_model(CHAIN)
    proto.graph.initializer.extend(numpy_helper.from_array(v.astype(np.float32), k)
                                   for k, v in weights.items())
    return proto


def _feeds(n: int) -> list[dict[str, np.ndarray]]:
    return [{"x": RNG.standard_normal((1, 3, 12, 12)).astype(np.float32)} for _ in range(n)]


def _counting(monkeypatch: Any) -> dict[str, list[str]]:
    """The tensors each channel pass and each calibration is asked for, from here on."""
    asked: dict[str, list[str]] = {"channels": [], "calibrated": []}
    absmax, calibrated = channels.channel_absmax, executors.calibrate

    def counted_absmax(model: onnx.ModelProto, tensors: Any, *args: Any, **kw: Any) -> Any:
        asked["channels"] += list(tensors)
        return absmax(model, tensors, *args, **kw)

    def counted_calibrate(model: Any, samples: Any, **kw: Any) -> Any:
        asked["calibrated"] += sorted(kw.get("tensors") or [])
        return calibrated(model, samples, **kw)

    monkeypatch.setattr(channels, "channel_absmax", counted_absmax)
    monkeypatch.setattr(executors, "calibrate", counted_calibrate)
    return asked


def test_the_conv_balancing_reads_what_a_declined_equalisation_measured(monkeypatch):
    proto, feeds = _model(), _feeds(8)
    stats = calibrate(Model(proto, "m.onnx", fingerprint(proto)), feeds, detail="all")
    variant = Variant(INT8, (DEFAULT_RULE,), True)

    def measure(model, found, groups, on, bounds):
        return errors_alone(proto, model, groups, found, variant, on, bounds=bounds)

    # No gain is enough: equalisation measures h and keeps nothing, the model handed on as is.
    monkeypatch.setattr(qdq_model, "EQUALISE_MIN_GAIN", 1.0)
    eq = equalise_channels(proto, proto, ["c2", "c3"], stats, INT8, feeds,
                           rules=(ScaleRule.ABSMAX,), tensor_scales={})
    assert eq.model is proto and eq.chains == () and eq.measured is not None
    assert "h" in eq.measured.channels and "h" in eq.measured.fitted
    asked = _counting(monkeypatch)
    fresh = balance_conv_inputs(proto, ["c2", "c3"], stats, feeds, measure=measure, left_alone=())
    measured_fresh = dict(asked)
    asked["channels"], asked["calibrated"] = [], []
    reused = balance_conv_inputs(proto, ["c2", "c3"], stats, feeds, measure=measure,
                                 left_alone=(), measured=eq.measured)
    # h's channels and its statistics on the fitted samples are not measured again...
    assert measured_fresh["channels"] == ["h"] and asked["channels"] == []
    assert measured_fresh["calibrated"].count("h") > asked["calibrated"].count("h")
    # ... and the balancing decides and builds the same, bit for bit.
    assert reused.tensors == fresh.tensors
    assert reused.model.SerializeToString() == fresh.model.SerializeToString()
    assert reused.stats.tensors.keys() == fresh.stats.tensors.keys()
    assert all(reused.stats.tensors[t].to_dict() == fresh.stats.tensors[t].to_dict()
               for t in fresh.stats.tensors)
    assert all(np.array_equal(reused.channel_scales[t], fresh.channel_scales[t])
               for t in fresh.channel_scales)
    # What was measured of another model (here: a copy) is not read.
    asked["channels"], asked["calibrated"] = [], []
    other = onnx.ModelProto()
    other.CopyFrom(proto)
    balance_conv_inputs(other, ["c2", "c3"], stats, feeds, measure=measure, left_alone=(),
                        measured=eq.measured)
    assert asked["channels"] == ["h"] and asked["calibrated"] == measured_fresh["calibrated"]


def test_a_pass_spread_over_the_cores_gives_one_at_a_times_values_bit_for_bit(monkeypatch):
    proto, feeds = _model(), _feeds(6)
    stats = calibrate(Model(proto, "m.onnx", fingerprint(proto)), feeds, detail="all")
    qdq = quantise(proto, ["c2", "c3"], stats, INT8, saturate=True).model

    def passes() -> tuple[Any, ...]:
        return (channels.channel_absmax(proto, ["h", "a"], feeds, axis=1),
                channels.channel_means(proto, {"h": 1}, feeds),
                model_errors(proto, feeds)(qdq))

    monkeypatch.setattr(calibrate_run, "pass_streams", lambda count, n_cores=None: 1)
    alone = passes()
    monkeypatch.setattr(calibrate_run, "pass_streams", lambda count, n_cores=None: 3)
    spread = passes()
    for one, many in zip(alone[:2], spread[:2], strict=True):
        assert one.keys() == many.keys()
        assert all(one[t].tobytes() == many[t].tobytes() for t in one)
    assert alone[2] == spread[2] > 0


def test_one_stream_a_core_at_most_one_a_sample_and_one_under_a_memory_budget(monkeypatch):
    assert pass_streams(4, 2) == 2
    assert pass_streams(1, 2) == 1
    assert pass_streams(8, 1) == 1
    assert pass_streams(3, 16) == 3
    monkeypatch.setattr(resources, "_budget", 2**30)
    assert pass_streams(4, 2) == 1


def test_the_layer_compare_a_sample_a_core_finds_what_one_at_a_time_does():
    proto, feeds = _model(), _feeds(5)
    stats = calibrate(Model(proto, "m.onnx", fingerprint(proto)), feeds, detail="all")
    qdq = quantise(proto, ["c2", "c3"], stats, INT8, saturate=True).model
    alone = compare_models(proto, qdq, feeds, rtol=0.01, atol=1e-6)
    spread = compare_models(proto, qdq, feeds, rtol=0.01, atol=1e-6, threads=1, streams=3)
    assert [t.tensor for t in spread.tensors] == [t.tensor for t in alone.tensors]
    assert [t.passed for t in spread.tensors] == [t.passed for t in alone.tensors]
    assert [t.max_abs_error for t in spread.tensors] == [t.max_abs_error for t in alone.tensors]
    assert not all(t.passed for t in alone.tensors)
    # The rows are folded in sample order; only the in-graph sums may add in another order.
    assert all(abs(a.rel_l2 - b.rel_l2) <= 1e-6 * a.rel_l2
               for a, b in zip(alone.tensors, spread.tensors, strict=True))


def test_each_samples_error_alone_from_one_session_is_each_ones_own_session():
    proto, feeds = _model(), _feeds(3)
    stats = calibrate(Model(proto, "m.onnx", fingerprint(proto)), feeds, detail="all")
    variant = Variant(INT8, (ScaleRule.ABSMAX,), True)
    groups = [["c2"], ["c3"], ["c2", "c3"]]
    each = errors_alone_each(proto, proto, groups, stats, variant, feeds)
    alone = [errors_alone(proto, proto, groups, stats, variant, [f]) for f in feeds]
    assert each == [[alone[i][g] for i in range(len(feeds))] for g in range(len(groups))]
    # The samples differ, and so do their errors: each is read, not one pooled number.
    assert len({round(e, 12) for e in each[2]}) == len(feeds)


def test_the_conv_balancing_measures_the_left_out_headroom_only_where_it_raises_a_clip(monkeypatch):
    # CHAIN's h, balanced into c2 and c3: no left-out raise -> two measurements; a raise -> three
    proto, feeds = _model(), _feeds(8)
    stats = calibrate(Model(proto, "m.onnx", fingerprint(proto)), feeds, detail="all")
    variant = Variant(INT8, (DEFAULT_RULE,), True)
    calls: list[tuple[list[list[str]], Any, list[float]]] = []

    def measure(model, found, groups, on, bounds):
        got = errors_alone(proto, model, groups, found, variant, on, bounds=bounds)
        calls.append((groups, bounds, got))
        return got

    monkeypatch.setattr(channels, "leave_one_out_raise", lambda per_sample, multiplier: 1.0)
    same = balance_conv_inputs(proto, ["c2", "c3"], stats, feeds, measure=measure, left_alone=())
    # Balanced, then not balanced: the headroom would quantise h's readers alike.
    assert len(calls) == 2 and calls[0][1] is None
    assert same.tensors and same.unseen_raise == {}
    calls.clear()
    monkeypatch.setattr(channels, "leave_one_out_raise", lambda per_sample, multiplier: 1.5)
    raised = balance_conv_inputs(proto, ["c2", "c3"], stats, feeds, measure=measure,
                                 left_alone=())
    # Balanced, with the headroom (measured only as far as it beats balanced alone), not balanced.
    assert len(calls) == 3 and calls[1][0] == calls[0][0] == [["c2", "c3"]]
    assert calls[1][1] == calls[0][2]
    assert raised.tensors.keys() == same.tensors.keys()
