"""Planner choices on tiny graphs: rescale first, pin when it declines, clamp when pinning cannot."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import model_from_text

from npuprep.analyse import static_findings
from npuprep.analyse.finding import Finding
from npuprep.calibrate import CalibrationStats, calibrate
from npuprep.data import load_samples
from npuprep.model_io import Model, fingerprint
from npuprep.plan import Clamp, PinFp32, Rescale, SoftmaxShift
from npuprep.plan.plan import dump_plan
from npuprep.plan.planner import make_plan
from npuprep.profiles import Pinning, Severity, load_profile
from npuprep.rewrite.rescale import apply_rescale
from npuprep.runtime.session import make_session, run

GENERIC = load_profile("generic")
LIMIT = GENERIC.resolve().limit  # 0.5 x 65504


def calibrated(model: Model, feeds: list[dict[str, np.ndarray]], tmp_path: Path,
               detail: str = "all") -> CalibrationStats:
    """The real calibration of `model` on `feeds` (saved as a folder of .npz samples)."""
    data = tmp_path / f"data_{detail}_{len(list(tmp_path.iterdir()))}"
    data.mkdir()
    for i, feed in enumerate(feeds):
        np.savez(data / f"sample_{i:03d}.npz", **feed)
    return calibrate(model, load_samples(data, model.proto), detail=detail)


def values(model: Model, feeds: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Every node output over the samples, from an FP32 onnxruntime run (for numeric checks)."""
    proto = type(model.proto)()
    proto.CopyFrom(model.proto)
    names = [o for n in proto.graph.node for o in n.output]
    have = {o.name for o in proto.graph.output}
    for name in names:
        if name not in have:
            proto.graph.output.add().name = name
    session = make_session(proto)
    runs = [run(session, f) for f in feeds]
    return {n: np.concatenate([r[n].ravel() for r in runs]) for n in names}


def as_model(text: str) -> Model:
    proto = model_from_text(text)
    return Model(proto, "model.onnx", fingerprint(proto))


def overflow(stats: CalibrationStats, tensor: str, node: str, op_type: str) -> Finding:
    return Finding(rule="range.overflow", severity=Severity.ERROR, node=node, op_type=op_type,
                   message="beyond the limit", tensor=tensor,
                   evidence={"absmax": stats.tensors[tensor].absmax}, remedy="rescale")


def samples(n: int, shape: tuple[int, ...], scale: float, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": (rng.standard_normal(shape) * scale).astype(np.float32)} for _ in range(n)]


# x -> MatMul(W, gain 3000) -> h -> Relu -> r -> MatMul(V) -> y
CHAIN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 4] x) => (float[2, 3] y) <float[4, 4] W = {3000.0,0.0,0.0,0.0, 0.0,3000.0,0.0,0.0, 0.0,0.0,3000.0,0.0, 0.0,0.0,0.0,3000.0}, float[4, 3] V = {0.001,0.0,0.0, 0.0,0.001,0.0, 0.0,0.0,0.001, 0.001,0.001,0.001}> {
    [mm1] h = MatMul (x, W)
    [relu] r = Relu (h)
    [mm2] y = MatMul (r, V)
}
"""

# x -> Exp -> e -> ReduceMean -> s ; Div(e, s) -> y   (Exp normalised by its mean: no
# softmax shift matches it, so the island and clamp remedies get their turn)
SOFTMAX = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 4] x) => (float[2, 4] y) {
    [exp] e = Exp (x)
    [sum] s = ReduceMean <keepdims = 1, axes = [1]> (e)
    [div] y = Div (e, s)
}
"""

# x -> Exp -> e -> ReduceSum -> s ; Div(e, s) -> y   (softmax without max subtraction)
WRITTEN_SOFTMAX = SOFTMAX.replace("ReduceMean <keepdims = 1, axes = [1]> (e)",
                                  "ReduceSum <keepdims = 1> (e, ax)").replace(
    "=> (float[2, 4] y) {", "=> (float[2, 4] y) <int64[1] ax = {1}> {")


def test_rescale_is_chosen_when_feasible_and_its_numbers_hold(tmp_path):
    model = as_model(CHAIN)
    feeds = samples(4, (2, 4), 10.0)
    stats = calibrated(model, feeds, tmp_path)
    absmax = stats.tensors["h"].absmax
    assert absmax > LIMIT
    plan = make_plan(model, GENERIC.resolve(), stats, [overflow(stats, "h", "mm1", "MatMul")])
    assert [type(a) for a in plan.actions] == [Rescale]
    rs = plan.actions[0]
    k = math.ceil(math.log2(absmax / LIMIT))
    assert (rs.entry, rs.k, rs.absmax, rs.limit) == ("mm1", k, absmax, LIMIT)
    assert rs.absmax_after == pytest.approx(absmax * 2.0**-k)
    assert rs.absmax_after <= LIMIT < absmax * 2.0 ** -(k - 1)
    assert rs.domain == {"h": -k, "r": -k} and rs.absorbers == ("mm2",)
    assert "rescale" in rs.why and "cheapest" in rs.why
    assert plan.pinned_nodes() == set() and plan.declined == ()
    # The plan's claim, checked: after the rewrite h fits and y is unchanged.
    rewritten = Model(apply_rescale(model.proto, rs.entry, rs.k).model, "r.onnx", "")
    after = values(rewritten, feeds)
    assert np.abs(after["h"]).max() == pytest.approx(rs.absmax_after, rel=1e-6)
    np.testing.assert_allclose(after["y"], values(model, feeds)["y"], rtol=1e-6)


def test_rescale_is_declined_for_exp_and_the_island_pins_the_softmax(tmp_path):
    model = as_model(SOFTMAX)
    stats = calibrated(model, samples(4, (2, 4), 8.0), tmp_path)
    assert stats.tensors["e"].absmax > LIMIT
    plan = make_plan(model, GENERIC.resolve(), stats, [overflow(stats, "e", "exp", "Exp")])
    (pin,) = plan.actions
    assert isinstance(pin, PinFp32) and not pin.request and not pin.forced
    assert pin.nodes == ("exp", "sum", "div") and pin.exit_tensors == ("y",)
    assert pin.measured["absmax"] == stats.tensors["e"].absmax
    # The only exit is a graph output, which stays FP32: no exit to measure against the limit.
    assert "exit_absmax" not in pin.measured
    (declined,) = plan.declined
    assert (declined.remedy, declined.target) == ("rescale", "e")
    assert declined.reason == "Exp node exp does not commute with scaling"
    assert declined.reason in pin.why


def test_compiler_decides_turns_the_pin_into_a_request(tmp_path):
    model = as_model(SOFTMAX)
    stats = calibrated(model, samples(4, (2, 4), 8.0), tmp_path)
    plan = make_plan(model, load_profile("a2000").resolve(), stats, [overflow(stats, "e", "exp", "Exp")])
    (pin,) = plan.actions
    assert isinstance(pin, PinFp32) and pin.request
    assert "request" in pin.why and plan.pinned_nodes() == {"exp", "sum", "div"}


def test_no_pinning_declines_a_clamp_that_would_change_measured_values(tmp_path):
    model = as_model(SOFTMAX)
    stats = calibrated(model, samples(4, (2, 4), 12.0), tmp_path)
    assert stats.tensors["e"].absmax > GENERIC.resolve().fmt.max
    profile = dataclasses.replace(GENERIC, fp32_pinning=Pinning.NONE)
    plan = make_plan(model, profile.resolve(), stats, [overflow(stats, "e", "exp", "Exp")])
    # ln(limit) = 10.396 lies inside the measured inputs: clipping there changes the answer.
    assert stats.tensors["x"].fraction_above(10.396) > 0
    assert plan.actions == () and plan.pinned_nodes() == set()
    assert [d.remedy for d in plan.declined] == ["rescale", "pin_fp32", "clamp"]
    assert "fp32_pinning: none" in plan.declined[1].reason
    assert "would change measured values" in plan.declined[2].reason
    (note,) = plan.notes
    assert note.startswith("range.overflow at e: unresolved; rescale declined")


def test_no_pinning_clamps_an_exp_input_that_stays_within_the_bound(tmp_path):
    model = as_model(SOFTMAX)
    stats = calibrated(model, samples(4, (2, 4), 2.0), tmp_path)
    profile = dataclasses.replace(GENERIC, fp32_pinning=Pinning.NONE)
    finding = dataclasses.replace(overflow(stats, "e", "exp", "Exp"), rule="hazard.exp", remedy="clamp")
    plan = make_plan(model, profile.resolve(), None, [finding])
    (clamp,) = plan.actions
    assert isinstance(clamp, Clamp)
    assert (clamp.tensor, clamp.kind, clamp.consumers, clamp.lo) == ("x", "exp", ("exp",), None)
    assert clamp.hi == math.floor(math.log(LIMIT) * 1000) / 1000 == 10.396
    assert math.exp(clamp.hi) <= LIMIT


def test_forbidden_nodes_decline_the_pin_with_the_reason(tmp_path):
    model = as_model(SOFTMAX)
    stats = calibrated(model, samples(4, (2, 4), 8.0), tmp_path)
    plan = make_plan(model, GENERIC.resolve(), stats, [overflow(stats, "e", "exp", "Exp")], forbid_pin=["sum"])
    assert plan.actions == ()
    assert "forbid_pin excludes" in plan.declined[1].reason and "sum" in plan.declined[1].reason
    assert plan.forbid_pin == ("sum",)


def test_static_findings_shift_or_clamp_where_the_rule_says():
    model = as_model(WRITTEN_SOFTMAX)
    findings = static_findings(model, GENERIC.resolve())
    plan = make_plan(model, GENERIC.resolve(), None, findings)
    # pattern.softmax: the exact max shift comes before any FP32 island, measured or not.
    (shift,) = plan.actions
    assert isinstance(shift, SoftmaxShift) and (shift.exp, shift.covers) == ("exp", ("e", "s", "y"))
    assert plan.notes[0] == "planned without measured ranges: static findings only"
    # A lone Exp with no softmax around it: the rule says clamp.
    lone = as_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 4] x) => (float[2, 4] y) {
        [exp] y = Exp (x)
    }
    """)
    plan = make_plan(lone, GENERIC.resolve(), None, static_findings(lone, GENERIC.resolve()))
    (clamp,) = plan.actions
    assert isinstance(clamp, Clamp) and (clamp.kind, clamp.hi, clamp.consumers) == ("exp", 10.396, ("exp",))


def test_measured_safe_hazard_gets_a_note_not_an_action(tmp_path):
    model = as_model(WRITTEN_SOFTMAX)
    stats = calibrated(model, samples(4, (2, 4), 1.0), tmp_path)
    plan = make_plan(model, GENERIC.resolve(), stats, static_findings(model, GENERIC.resolve()))
    assert plan.actions == ()
    assert len(plan.notes) == 1 and plan.notes[0].startswith("pattern.softmax at y: measured absmax")
    assert "no action" in plan.notes[0]


def test_plan_does_not_depend_on_finding_order(tmp_path):
    model = as_model(CHAIN)
    stats = calibrated(model, samples(4, (2, 4), 10.0), tmp_path)
    findings = [overflow(stats, t, n, "X") for t, n in (("h", "mm1"), ("r", "relu"))]
    first = dump_plan(make_plan(model, GENERIC.resolve(), stats, findings))
    shuffled = list(reversed(findings))
    random.Random(3).shuffle(shuffled)
    assert dump_plan(make_plan(model, GENERIC.resolve(), stats, shuffled)) == first
    # The second finding lies in the same scale domain: one rescale answers both.
    plan = make_plan(model, GENERIC.resolve(), stats, findings)
    (rs,) = plan.actions
    assert [str(f) for f in rs.findings] == ["range.overflow at h", "range.overflow at r"]


# x -> MatMul(W: channel 0 x 1e5, others x 2e-4) -> h -> Relu -> r -> MatMul(V) -> y
WIDE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[64, 4] x) => (float[64, 3] y) <float[4, 4] W = {100000.0,0.0,0.0,0.0, 0.0,0.0002,0.0,0.0, 0.0,0.0,0.0002,0.0, 0.0,0.0,0.0,0.0002}, float[4, 3] V = {0.00001,0.0,0.0, 0.0,1.0,0.0, 0.0,0.0,1.0, 0.0,1.0,1.0}> {
    [mm1] h = MatMul (x, W)
    [relu] r = Relu (h)
    [mm2] y = MatMul (r, V)
}
"""


def test_stats_veto_a_rescale_that_would_flush_small_values_and_the_pin_says_why(tmp_path):
    model = as_model(WIDE)
    stats = calibrated(model, samples(2, (64, 4), 1.0), tmp_path)
    h = stats.tensors["h"]
    k = math.ceil(math.log2(h.absmax / LIMIT))
    fmt_min = GENERIC.resolve().fmt.min_normal
    pushed = h.fraction_below(fmt_min * 2.0**k) - h.fraction_below(fmt_min)
    assert pushed > 0.01  # the planted trap: k is feasible for the graph, not for the values
    plan = make_plan(model, GENERIC.resolve(), stats, [overflow(stats, "h", "mm1", "MatMul")])
    (pin,) = plan.actions
    assert isinstance(pin, PinFp32) and pin.nodes == ("mm1", "relu", "mm2")
    assert pin.exit_tensors == ("y",) and stats.tensors["y"].absmax <= LIMIT
    declined = [d for d in plan.declined if d.remedy == "rescale" and d.target == "mm1"]
    assert declined and all("below the smallest fp16 normal" in d.reason for d in declined)
    assert f"{pushed:.1%} of h" in declined[0].reason


# x -> MatMul(W = 1e-6 I) -> h -> MatMul(V = 1e6 I) -> y   (h lives below FP16's normals)
TINY = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[8, 2] x) => (float[8, 2] y) <float[2, 2] W = {0.000001,0.0, 0.0,0.000001}, float[2, 2] V = {1000000.0,0.0, 0.0,1000000.0}> {
    [mm1] h = MatMul (x, W)
    [mm2] y = MatMul (h, V)
}
"""


def test_underflow_is_rescaled_up_by_a_power_of_two(tmp_path):
    model = as_model(TINY)
    stats = calibrated(model, samples(4, (8, 2), 1.0), tmp_path)
    h = stats.tensors["h"]
    fmt = GENERIC.resolve().fmt
    assert h.fraction_below(fmt.min_normal) > 0.5
    finding = Finding(rule="range.underflow", severity=Severity.WARNING, node="mm1",
                      op_type="MatMul", message="below min normal", tensor="h")
    plan = make_plan(model, GENERIC.resolve(), stats, [finding])
    (rs,) = plan.actions
    assert isinstance(rs, Rescale) and rs.entry == "mm1" and rs.k < 0
    assert rs.domain == {"h": -rs.k} and rs.absorbers == ("mm2",)
    # The smallest lift that leaves at most 1% of h under the smallest normal, within the limit.
    lifted = fmt.min_normal / 2.0**-rs.k
    assert h.fraction_below(lifted) <= 0.01 < h.fraction_below(lifted * 2)
    assert rs.absmax_after == pytest.approx(h.absmax * 2.0**-rs.k) and rs.absmax_after <= LIMIT
    feeds = samples(4, (8, 2), 1.0)
    rewritten = Model(apply_rescale(model.proto, rs.entry, rs.k).model, "r.onnx", "")
    after = values(rewritten, feeds)
    assert np.mean(np.abs(after["h"]) < fmt.min_normal) <= 0.01
    np.testing.assert_allclose(after["y"], values(model, feeds)["y"], rtol=1e-6)


def test_static_layernorm_pattern_pins_its_members_from_the_mean_to_the_division():
    # x -> Sub(x, mean) -> d -> Pow 2 -> ReduceMean -> Add eps -> Sqrt -> Div(d, .) -> y
    model = as_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 8] x) => (float[2, 8] y) <float two = {2.0}, float eps = {0.001}> {
        [mean] m = ReduceMean <axes = [1], keepdims = 1> (x)
        [sub] d = Sub (x, m)
        [pow] q = Pow (d, two)
        [var] v = ReduceMean <axes = [1], keepdims = 1> (q)
        [add] ve = Add (v, eps)
        [sqrt] sd = Sqrt (ve)
        [div] y = Div (d, sd)
    }
    """)
    findings = static_findings(model, GENERIC.resolve())
    assert [f.rule for f in findings] == ["pattern.layernorm"]
    plan = make_plan(model, GENERIC.resolve(), None, findings)
    (pin,) = plan.actions
    assert pin.nodes == ("mean", "sub", "pow", "var", "add", "sqrt", "div")
    assert pin.exit_tensors == ("y",)
    assert "no measured range" in pin.why


NO_PIN = dataclasses.replace(GENERIC, fp32_pinning=Pinning.NONE)


def test_no_pinning_declines_a_guard_below_measured_denominators_which_a_user_may_force(tmp_path):
    # a, b -> Div(a, b) -> y   (b comes close to 0)
    model = as_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[16] a, float[16] b) => (float[16] y) {
        [div] y = Div (a, b)
    }
    """)
    rng = np.random.default_rng(5)
    feeds = [{"a": rng.uniform(-40, 40, 16).astype(np.float32),
              "b": np.concatenate([rng.uniform(0.5, 2, 15), [1e-4]]).astype(np.float32)}
             for _ in range(3)]
    stats = calibrated(model, feeds, tmp_path)
    plan = make_plan(model, NO_PIN.resolve(), stats, [overflow(stats, "y", "div", "Div")])
    # Every overflowing quotient has its denominator below the guard: guarding it would
    # change measured values, so the planner declines and says so.
    assert plan.actions == ()
    assert [d.remedy for d in plan.declined] == ["rescale", "pin_fp32", "clamp"]
    assert plan.declined[2].target == "b" and "would change measured values" in plan.declined[2].reason
    # The guard a user's plan may ask for holds numerically.
    lo = 2.0 ** math.ceil(math.log2(stats.tensors["a"].absmax / LIMIT))
    from npuprep.rewrite.clamp import guard_denominator

    guarded = Model(guard_denominator(model.proto, "div", lo).model, "g.onnx", "")
    out = values(guarded, feeds)["y"]
    assert np.all(np.isfinite(out)) and np.abs(out).max() <= LIMIT


def test_no_pinning_and_no_clamp_leaves_a_reasoned_note(tmp_path):
    model = as_model(WIDE)
    stats = calibrated(model, samples(2, (64, 4), 1.0), tmp_path)
    plan = make_plan(model, NO_PIN.resolve(), stats, [overflow(stats, "h", "mm1", "MatMul")])
    assert plan.actions == ()
    assert [d.remedy for d in plan.declined][-2:] == ["pin_fp32", "clamp"]
    assert plan.declined[-1].reason == "MatMul node mm1 takes no clamp (only Exp, Log, squares, divisions)"
    (note,) = plan.notes
    assert note.startswith("range.overflow at h: unresolved; rescale declined: ")


@pytest.mark.parametrize(("gain", "vetoed"), [(0.2, True), (20.0, False)])
def test_without_histograms_the_precision_floor_decides_the_underflow_veto(tmp_path, gain, vetoed):
    # x -> MatMul(W: channel 0 x 1e6, channel 1 x gain) -> h -> Slice(channel 1) -> s -> MatMul(V) -> y
    model = as_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[8, 2] x) => (float[8, 2] h, float[8, 1] y) <float[2, 2] W = {{1000000.0,0.0, 0.0,{gain}}}, float[1, 1] V = {{0.5}}, int64[1] st = {{1}}, int64[1] en = {{2}}, int64[1] ax = {{1}}> {{
        [mm1] h = MatMul (x, W)
        [slice] s = Slice (h, st, en, ax)
        [mm2] y = MatMul (s, V)
    }}
    """)
    stats = calibrated(model, samples(3, (8, 2), 1.0), tmp_path, detail="auto")
    s = stats.tensors["s"]
    assert s.fraction_below(1.0) is None  # every sample of s was ordinary: no histogram
    plan = make_plan(model, GENERIC.resolve(), stats, [overflow(stats, "h", "mm1", "MatMul")])
    k = math.ceil(math.log2(stats.tensors["h"].absmax / LIMIT))
    floor = s.absmax * 2.0**-k * GENERIC.resolve().fmt.eps
    assert (floor < GENERIC.resolve().fmt.min_normal) is vetoed
    if vetoed:
        reasons = [d.reason for d in plan.declined if d.remedy == "rescale"]
        assert reasons[0].startswith(f"2^-{k} on mm1 brings s to ")
        assert reasons[0].endswith("no histogram shows how much would flush")
        assert isinstance(plan.actions[0], PinFp32)
    else:
        assert [(type(a), a.k) for a in plan.actions] == [(Rescale, k)]


def test_headroom_warning_without_a_feasible_rescale_is_a_note_until_it_is_an_error(tmp_path):
    model = as_model(SOFTMAX)
    feeds = [{"x": np.full((2, 4), 10.6, dtype=np.float32)}]  # exp(10.6) = 40135: > limit, < max
    stats = calibrated(model, feeds, tmp_path)
    assert LIMIT < stats.tensors["e"].absmax < GENERIC.resolve().fmt.max
    warning = dataclasses.replace(overflow(stats, "e", "exp", "Exp"), rule="range.headroom",
                                  severity=Severity.WARNING)
    plan = make_plan(model, GENERIC.resolve(), stats, [warning])
    assert plan.actions == () and [d.remedy for d in plan.declined] == ["rescale"]
    (note,) = plan.notes
    assert note.startswith("range.headroom at e: absmax 40134.9 is past the headroom limit 32752") and "severity.headroom" in note
    error = dataclasses.replace(warning, severity=Severity.ERROR)
    plan = make_plan(model, GENERIC.resolve(), stats, [error])
    assert [type(a) for a in plan.actions] == [PinFp32]


def test_static_island_carries_a_square_through_its_sum_to_the_root():
    # x -> Mul(x, x) -> q -> ReduceSum -> s -> Sqrt -> n -> Add(n, x) -> y
    model = as_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 300] x) => (float[2, 300] y) <int64[1] ax = {1}> {
        [square] q = Mul (x, x)
        [sum] s = ReduceSum <keepdims = 1> (q, ax)
        [root] n = Sqrt (s)
        [add] y = Add (n, x)
    }
    """)
    findings = static_findings(model, GENERIC.resolve())
    assert {f.node for f in findings} >= {"square", "sum"}
    plan = make_plan(model, GENERIC.resolve(), None, findings)
    (pin,) = plan.actions
    # Sums and products keep the magnitude; the root ends it, so the Add stays FP16.
    assert pin.nodes == ("square", "sum", "root") and pin.exit_tensors == ("n",)
    assert sorted(r.node for r in pin.findings) == sorted(f.node for f in findings)


def test_an_overflowing_graph_input_pins_every_consumer_island(tmp_path):
    # x (up to 1e5) -> Exp -> a ;  x -> Neg -> m -> Exp -> b   (exp of huge values, both ways)
    model = as_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4] x) => (float[4] a, float[4] b) {
        [exp_a] a = Exp (x)
        [neg] m = Neg (x)
        [exp_b] b = Exp (m)
    }
    """)
    feeds = [{"x": np.array([1e5, -1e5, 3.0, -2.0], dtype=np.float32)}]
    stats = calibrated(model, feeds, tmp_path)
    finding = Finding(rule="range.overflow", severity=Severity.ERROR, node="", op_type="input",
                      message="input beyond the limit", tensor="x")
    plan = make_plan(model, GENERIC.resolve(), stats, [finding])
    assert plan.pinned_nodes() == {"exp_a", "neg", "exp_b"}
    assert all(p.findings == (plan.pins()[0].findings[0],) for p in plan.pins())
    (declined,) = plan.declined
    assert declined.remedy == "rescale" and "Exp" in declined.reason


def test_a_weight_past_the_format_is_rescaled_into_it_and_absorbed_by_the_norm(tmp_path):
    # x -> MatMul(W, entries 1e5) -> h -> LayerNormalization -> y
    model = as_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4, 4] x) => (float[4, 4] y) <float[4, 4] W = {100000.0,-3.0,2.0,0.5, 1.0,90000.0,-2.0,1.5, 0.5,1.0,-80000.0,2.0, -1.0,2.0,1.0,70000.0}, float[4] gamma = {1.0,1.0,1.0,1.0}, float[4] beta = {0.0,0.0,0.0,0.0}> {
        [mm] h = MatMul (x, W)
        [ln] y = LayerNormalization <axis = -1, epsilon = 0.00001> (h, gamma, beta)
    }
    """)
    findings = [f for f in static_findings(model, GENERIC.resolve()) if f.rule == "init.out_of_range"]
    assert [(f.node, f.remedy) for f in findings] == [("mm", "rescale")]
    feeds = samples(3, (4, 4), 1.0)
    stats = calibrated(model, feeds, tmp_path)
    plan = make_plan(model, GENERIC.resolve(), stats, findings)
    (rs,) = plan.actions
    assert isinstance(rs, Rescale) and rs.entry == "mm" and rs.absorbers == ("ln",)
    assert rs.absmax == 100000.0 and rs.absmax_after == 100000.0 * 2.0**-rs.k <= LIMIT
    # Every tensor of the domain fits too, and the function is unchanged.
    assert all(stats.tensors[t].absmax * 2.0**p <= LIMIT for t, p in rs.domain.items())
    rewritten = Model(apply_rescale(model.proto, rs.entry, rs.k).model, "r.onnx", "")
    np.testing.assert_allclose(values(rewritten, feeds)["y"], values(model, feeds)["y"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("prior", "joins"), [(30.0, True), (8.0, False)])
def test_a_large_exp_input_pulls_its_producer_into_the_island(tmp_path, prior, joins):
    # x -> Add(x, prior) -> l -> Exp -> e -> ReduceMean -> s ; Div(e, s) -> y
    model = as_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4, 8] x) => (float[4, 8] y) <float prior = {{{prior}}}> {{
        [add] l = Add (x, prior)
        [exp] e = Exp (l)
        [sum] s = ReduceMean <keepdims = 1, axes = [1]> (e)
        [div] y = Div (e, s)
    }}
    """)
    feeds = samples(4, (4, 8), 2.0)
    stats = calibrated(model, feeds, tmp_path)
    plan = make_plan(model, GENERIC.resolve(), stats, [overflow(stats, "e", "exp", "Exp")])
    (pin,) = plan.actions
    assert ("add" in pin.nodes) is joins
    assert set(pin.nodes) >= {"exp", "sum", "div"}
    # What it buys, under emulated FP16: the logits' rounding step at |l| ~ 30 is 2^-5.
    from npuprep.verify.emulate import emulate

    ref = values(model, feeds)["y"]

    def error(pinned: set[str]) -> float:
        emulated = emulate(model.proto, GENERIC.resolve().fmt, saturate=False, pinned_nodes=pinned).model
        y = values(Model(emulated, "e.onnx", ""), feeds)["y"]
        return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))

    with_add, without_add = error({"add", "exp", "sum", "div"}), error({"exp", "sum", "div"})
    if joins:
        assert without_add > 4 * with_add and without_add > 2.0**-8
    else:
        assert without_add < 2.0**-8


def test_static_planning_follows_a_long_chain_to_the_op_that_shrinks_it():
    # x -> Mul(x, x) -> a0 -> Add(+1) -> a1 -> ... -> a700 -> Sqrt -> y
    from onnx import TensorProto, helper, numpy_helper

    depth = 700
    nodes = [helper.make_node("Mul", ["x", "x"], ["a0"], name="square")]
    nodes += [helper.make_node("Add", [f"a{i}", "one"], [f"a{i + 1}"], name=f"add{i}")
              for i in range(depth)]
    nodes.append(helper.make_node("Sqrt", [f"a{depth}"], ["y"], name="root"))
    graph = helper.make_graph(
        nodes, "deep", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = Model(proto, "deep.onnx", fingerprint(proto))
    square = Finding(rule="hazard.square", severity=Severity.WARNING, node="square",
                     op_type="Mul", message="x^2", tensor="a0", remedy="pin_fp32")
    plan = make_plan(model, GENERIC.resolve(), None, [square])
    (pin,) = plan.actions
    assert len(pin.nodes) == depth + 2 and pin.nodes[-1] == "root" and pin.exit_tensors == ("y",)


def test_a_constant_the_rescale_brings_into_range_needs_no_pin(tmp_path):
    # x (~1e3) -> Mul(x, x) -> s (~1e6) -> Div(s, c = 2e5) -> y : rescale x, c*2^-2k fits
    model = as_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4, 8] x) => (float[4, 8] y) <float c = {200000.0}> {
        [sq] s = Mul (x, x)
        [scale] y = Div (s, c)
    }
    """)
    from npuprep.analyse.measured import measured_findings

    feeds = samples(3, (4, 8), 1000.0)
    stats = calibrated(model, feeds, tmp_path)
    findings = static_findings(model, GENERIC.resolve()).merged(measured_findings(model, GENERIC.resolve(), stats))
    assert any(f.rule == "init.out_of_range" and f.tensor == "c" for f in findings)
    plan = make_plan(model, GENERIC.resolve(), stats, findings)
    assert [a.action for a in plan.actions] == ["rescale"]
    assert not plan.pins()
    assert any("scales it to" in n and "c" in n for n in plan.notes)


def test_coarse_softmax_logits_are_shifted_in_fp32_unless_forbidden(tmp_path):
    # x -> Add(x, 30) -> l -> Exp -> e -> ReduceSum -> s ; Div(e, s) -> y
    model = as_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4, 8] x) => (float[4, 8] y) <float prior = {30.0}, int64[1] ax = {1}> {
        [add] l = Add (x, prior)
        [exp] e = Exp (l)
        [sum] s = ReduceSum <keepdims = 1> (e, ax)
        [div] y = Div (e, s)
    }
    """)
    stats = calibrated(model, samples(4, (4, 8), 2.0), tmp_path)
    plan = make_plan(model, GENERIC.resolve(), stats, [overflow(stats, "e", "exp", "Exp")])
    shift, pin = plan.actions
    assert isinstance(shift, SoftmaxShift) and shift.fp32_shift and "too coarse" in shift.why
    assert isinstance(pin, PinFp32) and pin.nodes == ("add",)
    plan = make_plan(model, GENERIC.resolve(), stats, [overflow(stats, "e", "exp", "Exp")], forbid_pin=["add"])
    (shift,) = plan.actions
    assert not shift.fp32_shift and "forbid_pin names add" in shift.why
