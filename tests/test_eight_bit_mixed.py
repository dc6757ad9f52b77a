"""INT8 and FP8 per layer on a target that runs both (the A2000): a layer whose input spans
decades keeps 8 bits in FP8 where INT8's one scale loses it, instead of going FP16."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest
from onnx import numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import eight_bit_format
from npuprep.pipeline import convert
from npuprep.pipeline.quantise_and_verify import JUDGE_MARGIN
from npuprep.profiles import load_profile
from npuprep.runtime.session import make_session, run
from npuprep.verify.qdq_model import quantise

# x (log-normal magnitudes) -> MatMul "wide"; z (normal) -> MatMul "plain"; y = both side by side
TWO = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[64, 16] x, float[64, 16] z) => (float[64, 16] y) {
    [wide] h = MatMul (x, W1)
    [plain] v = MatMul (z, W2)
    y = Concat <axis = 1> (h, v)
}
"""


def _setup(sigma: float, text: str = TWO) -> tuple[onnx.ModelProto, Model, list[dict[str, np.ndarray]]]:
    """`text` with W1, W2 drawn; x spans e^(+-sigma) in magnitude, z is normal."""
    rng = np.random.default_rng(3)
    proto = parser.parse_model(text)
    for name in ("W1", "W2"):
        proto.graph.initializer.append(
            numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), name))
    feeds = []
    for _ in range(8):
        x = np.sign(rng.standard_normal((64, 16))) * np.exp(rng.normal(0, sigma, (64, 16)))
        feeds.append({"x": x.astype(np.float32),
                      "z": rng.standard_normal((64, 16)).astype(np.float32)})
    return proto, Model(proto=proto, path="m.onnx", digest=fingerprint(proto)), feeds


def _wide_error(proto: onnx.ModelProto, built: onnx.ModelProto,
                feeds: list[dict[str, np.ndarray]]) -> float:
    """rel L2 of y's first half (h, the wide layer's output) over the samples."""
    ref, got = make_session(proto), make_session(built)
    num = sum(float(np.sum((run(got, f)["y"][:, :8] - run(ref, f)["y"][:, :8]) ** 2)) for f in feeds)
    return float(np.sqrt(num / sum(float(np.sum(run(ref, f)["y"][:, :8] ** 2)) for f in feeds)))


def _errors(proto: onnx.ModelProto, stats: object,
            feeds: list[dict[str, np.ndarray]]) -> tuple[float, float]:
    """(the best INT8 rule's, FP8's) error with the wide layer alone in 8 bits."""
    int8 = min(_wide_error(proto, quantise(proto, ["wide"], stats, eight_bit_format("int8"),
                                           saturate=True, rule=rule).model, feeds)
               for rule in ("absmax", "percentile", "mse"))
    fp8 = _wide_error(proto, quantise(proto, ["wide"], stats, eight_bit_format("fp8_e4m3"),
                                      saturate=False, rule="absmax", headroom=2.0).model, feeds)
    return int8, fp8


def test_a_layer_whose_input_int8_flushes_runs_in_fp8_not_fp16():
    proto, model, feeds = _setup(sigma=2.0)
    stats = calibrate(model, feeds, detail="all")
    int8, fp8 = _errors(proto, stats, feeds)
    assert int8 > 2 * fp8  # measured: FP8's relative steps hold what INT8's one scale cannot
    result = convert(model, load_profile("a2000"), feeds, precision="int8", stats=stats, rtol=0.06)
    chosen = {x.node: x.precision for x in result.plan.eight_bit}
    assert chosen == {"wide": "fp8_e4m3", "plain": "int8"}
    assert result.eight_bit.eight_bit_share == 1.0 and result.output_check
    assert "flushes" in next(x.why for x in result.plan.eight_bit if x.node == "wide")


def test_a_layer_int8_holds_too_coarsely_takes_fp8_before_fp16_and_the_curve_says_so():
    proto, model, feeds = _setup(sigma=1.3)
    stats = calibrate(model, feeds, detail="all")
    int8, fp8 = _errors(proto, stats, feeds)
    rtol = 0.06
    assert int8 > JUDGE_MARGIN * rtol > fp8  # INT8 misses the aim on this layer, FP8 meets it
    # The search from the all-INT8 start (--search always: not from all-FP8, below).
    result = convert(model, load_profile("a2000"), feeds, precision="int8", stats=stats, rtol=rtol,
                     holdout=[{k: -v for k, v in f.items()} for f in feeds[:3]], search="always")
    chosen = {x.node: x.precision for x in result.plan.eight_bit}
    assert chosen == {"wide": "fp8_e4m3", "plain": "int8"}
    assert result.eight_bit.kept_wider == () and result.eight_bit.eight_bit_share == 1.0
    # The note on the layer that took FP8 and the held-out check are each their own.
    assert any("1 layer(s) int8 could not hold run in fp8_e4m3" in n for n in result.notes)
    assert result.holdout is not None and result.holdout.samples == 3
    assert result.to_dict()["holdout"]["samples"] == 3
    assert result.output_check and result.output_check.outputs["y"]["rel_l2"] < JUDGE_MARGIN * rtol
    # The curve: all INT8 first (failing), then the ranking's head in FP8 (passing), at 100%.
    curve = result.eight_bit.curve
    assert not curve[0].passed and curve[0].to == "int8"
    assert curve[-1].passed and curve[-1].to == "fp8_e4m3" and curve[-1].share == 1.0
    # Without FP8 on the target, the same layer goes FP16: half the multiply-adds.
    a2000 = load_profile("a2000")
    int8_only = replace(a2000, fast_dtypes=tuple(d for d in a2000.fast_dtypes if d != "fp8_e4m3"))
    alone = convert(model, int8_only, feeds, precision="int8", stats=stats, rtol=rtol)
    assert {x.node: x.precision for x in alone.plan.eight_bit}["wide"] == "fp16"
    assert alone.eight_bit.eight_bit_share == 0.5


def test_an_int8_start_past_the_gate_starts_from_fp8_with_each_layer_int8_holds_as_well_in_int8():
    # All INT8 errs past the gate (wide's input spans decades), all FP8 meets the aim: the search
    # starts from FP8, `plain` (a normal input, which INT8's steps hold better alone) back in
    # INT8; nothing balanced or equalised for INT8. The point is the all-INT8 search's.
    proto, model, feeds = _setup(sigma=1.3)
    stats = calibrate(model, feeds, detail="all")
    stages: list[str] = []
    result = convert(model, load_profile("a2000"), feeds, precision="int8", stats=stats, rtol=0.06,
                     progress=stages.append)
    assert {x.node: x.precision for x in result.plan.eight_bit} == {"wide": "fp8_e4m3",
                                                                   "plain": "int8"}
    assert result and result.eight_bit.eight_bit_share == 1.0
    assert any("the search starts from fp8_e4m3, 1 layer(s) back in int8" in n
               for n in result.notes)
    assert not any("balancing" in s or "equalising" in s for s in stages)
    curve = result.eight_bit.curve
    assert curve[-1].passed and curve[-1].share == 1.0
    # Where INT8 holds `plain` worse than FP8 alone, it stays FP8 (every layer from the FP8 start).
    from npuprep.pipeline.plain_start import each_in_its_better_format

    class Trials:
        score = None  # not rel L2: errors_within runs every trial whole, through errors

        def errors(self, trials):
            return [0.02 if a == {"plain": "fp8_e4m3"} else 0.05 for a, _ in trials]

        def check(self, *args, **kwargs):
            raise AssertionError("no layer moved: nothing to check")

    class Sessions:
        def checks(self):
            return Trials()

        def close(self):
            pass

    from npuprep.plan.layer_precision import LayerPrecision
    from npuprep.verify.output_check import OutputCheck

    start = (LayerPrecision("wide", "fp8_e4m3", ""), LayerPrecision("plain", "fp8_e4m3", ""))
    check = OutputCheck(rtol=0.06, samples=8, outputs={"y": {"rel_l2": 0.03, "nonfinite": 0}})
    kept, said = each_in_its_better_format(Sessions(), start, check, {"plain"}, rtol=0.06,
                                           top_k={}, margin=2.0, passes=bool, target="a2000")
    assert kept == start and "0 layer(s) back in int8" in said


# x (log-normal magnitudes) -> MatMul "wide" -> h;  z (normal) -> MatMul "plain" -> v
APART = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[64, 16] x, float[64, 16] z) => (float[64, 8] h, float[64, 8] v) {
    [wide] h = MatMul (x, W1)
    [plain] v = MatMul (z, W2)
}
"""


def _apart() -> tuple[Model, list[dict[str, np.ndarray]], object]:
    """TWO's layers with an output each: INT8's one scale flushes `wide`'s input, FP8's
    three mantissa bits hold `plain`'s normal input more coarsely than INT8."""
    _, model, feeds = _setup(2.0, APART)
    return model, feeds, calibrate(model, feeds, detail="all")


def test_an_fp8_conversion_keeps_at_least_as_much_in_8_bits_as_the_int8_conversion():
    # All in FP8, `plain` misses the aim (0.034 against 0.8 x 0.04); all in INT8, `wide`
    # flushes (0.095). The FP8 search, ranked by FP8 errors, kept `plain` FP16: 50%. The INT8
    # conversion runs `wide` in FP8 and `plain` in INT8: 100%. So does the FP8 conversion now.
    model, feeds, stats = _apart()
    a2000 = load_profile("a2000")
    int8 = convert(model, a2000, feeds, precision="int8", stats=stats, rtol=0.04)
    fp8 = convert(model, a2000, feeds, precision="fp8_e4m3", stats=stats, rtol=0.04)
    assert int8 and int8.eight_bit.eight_bit_share == 1.0
    assert fp8 and fp8.eight_bit.eight_bit_share == 1.0
    assert {x.node: x.precision for x in fp8.plan.eight_bit} == {"wide": "fp8_e4m3",
                                                                 "plain": "int8"}
    curve = fp8.eight_bit.curve
    assert not curve[0].passed and curve[0].to == "fp8_e4m3" and curve[0].share == 1.0
    # The INT8 conversion's search runs first and passes at 100%: the FP8 search's heads
    # kept FP16 (50%: `plain` FP16 passes) could not be kept, and none is tried.
    assert all(p.share == 1.0 for p in curve)
    assert any("failing) and as the int8 conversion (100.0%" in n for n in fp8.notes)
    assert any("kept the int8 conversion's" in n for n in fp8.notes)
    # The model built gives the kept trial's numbers: its INT8 layer by the rule chosen.
    assert fp8.output_check.worst_rel_l2 == pytest.approx(curve[-1].rel_l2, rel=1e-4)


def test_fp8s_own_search_is_skipped_where_its_start_errs_more_than_a_passing_int8_search():
    # The INT8 conversion's search meets its aim at 100% from a start erring less than all-FP8
    # (0.034 at rtol 0.04): the FP8 search is not run, and its start is the only FP8 point.
    model, feeds, stats = _apart()
    a2000 = load_profile("a2000")
    stages: list[str] = []
    fp8 = convert(model, a2000, feeds, precision="fp8_e4m3", stats=stats, rtol=0.04,
                  progress=stages.append)
    assert fp8 and fp8.eight_bit.eight_bit_share == 1.0
    assert any("fp8_e4m3's own search not run" in n for n in fp8.notes)
    assert "quantising to fp8_e4m3" not in stages
    assert [p.to for p in fp8.eight_bit.curve].count("fp8_e4m3") == 1
    # --search always runs it, and keeps the same point.
    stages.clear()
    always = convert(model, a2000, feeds, precision="fp8_e4m3", stats=stats, rtol=0.04,
                     search="always", progress=stages.append)
    assert "quantising to fp8_e4m3" in stages
    assert not any("own search not run" in n for n in always.notes)
    assert always.plan.eight_bit == fp8.plan.eight_bit


def test_fp8s_own_search_runs_where_the_int8_search_misses_its_aim_or_fp8_errs_less():
    from npuprep.pipeline.eight_bit_choice import fp8_search_skipped
    from npuprep.verify.output_check import OutputCheck
    from npuprep.verify.widening import CurvePoint, Widening

    def check(rel_l2: float) -> OutputCheck:
        return OutputCheck(rtol=0.05, samples=4, outputs={"y": {"rel_l2": rel_l2, "nonfinite": 0}})

    def judged(c: OutputCheck) -> bool:
        return c.worst_rel_l2 <= 0.04

    def int8_search(start: float, point: float) -> Widening:
        return Widening([], check(point), curve=[CurvePoint(0, "int8", 1.0, start, False)])

    a2000, int8, fp8 = load_profile("a2000"), eight_bit_format("int8"), eight_bit_format("fp8_e4m3")
    assert fp8_search_skipped(int8_search(0.10, 0.03), check(0.12), judged, a2000, fp8, int8)
    # FP8's start errs less: its search may pass with more in 8 bits.
    assert not fp8_search_skipped(int8_search(0.10, 0.03), check(0.08), judged, a2000, fp8, int8)
    # The INT8 search missed its aim: FP8's may meet it.
    assert not fp8_search_skipped(int8_search(0.10, 0.045), check(0.12), judged, a2000, fp8, int8)
    fast_fp8 = replace(a2000, throughput=replace(
        a2000.throughput, peak_tflops={**a2000.throughput.peak_tflops, "fp8_e4m3": 200.0,
                                       "int8": 100.0}))
    assert not fp8_search_skipped(int8_search(0.10, 0.03), check(0.12), judged, fast_fp8, fp8, int8)


def test_at_the_same_8_bit_share_the_lower_error_is_kept_unless_the_ledger_makes_fp8_cheaper():
    # At rtol 0.05 all-FP8 passes (0.034 under 0.04) and so does the INT8 conversion's start
    # (0.028): both 100% 8-bit. The A2000's ledger assumes INT8 and FP8 alike (2x-32x FP32's
    # peak, neither published): the lower error is kept. Where FP8's peak is the higher, FP8.
    model, feeds, stats = _apart()
    a2000 = load_profile("a2000")
    result = convert(model, a2000, feeds, precision="fp8_e4m3", stats=stats, rtol=0.05)
    all_fp8 = result.eight_bit.curve[0]
    assert all_fp8.passed and all_fp8.to == "fp8_e4m3" and all_fp8.share == 1.0
    assert result and result.eight_bit.eight_bit_share == 1.0
    assert {x.node: x.precision for x in result.plan.eight_bit}["plain"] == "int8"
    assert result.output_check.worst_rel_l2 < all_fp8.rel_l2
    fast_fp8 = replace(a2000, throughput=replace(
        a2000.throughput, peak_tflops={**a2000.throughput.peak_tflops, "fp8_e4m3": 200.0,
                                       "int8": 100.0}))
    cheaper = convert(model, fast_fp8, feeds, precision="fp8_e4m3", stats=stats, rtol=0.05)
    assert cheaper and cheaper.eight_bit.mac_share["fp8_e4m3"] == 1.0


def test_a_trial_on_the_switched_session_gives_the_built_models_numbers():
    from npuprep.numerics import get_format
    from npuprep.scale_rules import ScaleRule
    from npuprep.verify.qdq_model import on_target, with_opset
    from npuprep.verify.qdq_trials import Trials, Variant, switched_qdq

    proto, model, feeds = _setup(sigma=1.3)
    stats = calibrate(model, feeds, detail="all")
    int8, fp8 = eight_bit_format("int8"), eight_bit_format("fp8_e4m3")
    base = with_opset(proto, fp8)
    variants = [Variant(int8, tuple(ScaleRule), True), Variant(fp8, (ScaleRule.ABSMAX,), False, 2.0)]
    switched = switched_qdq(base, ["wide", "plain"], stats, variants)
    fp16 = get_format("fp16")
    trials = Trials(proto, switched, fp16, (), feeds, saturate=True)
    got = trials.outputs({"wide": "fp8_e4m3", "plain": "int8"}, {"z": ScaleRule.MSE})
    built = quantise(base, ["plain"], stats, int8, saturate=True, tensor_rules={"z": "mse"}).model
    built = quantise(built, ["wide"], stats, fp8, saturate=False, rule="absmax", headroom=2.0).model
    board = make_session(on_target(built, fp16, (), saturate=True))
    for feed, trial in zip(feeds, got, strict=True):
        np.testing.assert_array_equal(trial["y"], run(board, feed)["y"])


# x -> Conv(W, B) "conv" -> y (a bias the 8-bit trials correct behind their own switch)
CONV = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[1, 4, 8, 8] x) => (float[1, 6, 8, 8] y) {
    [conv] y = Conv <pads = [1, 1, 1, 1]> (x, W, B)
}
"""


def test_a_switched_layer_moved_into_if_branches_gives_the_same_numbers_or_is_left_as_it_is(
        monkeypatch):
    import npuprep.verify.weight_switches as weight_switches
    from npuprep.numerics import get_format
    from npuprep.scale_rules import ScaleRule
    from npuprep.verify.qdq_model import on_target
    from npuprep.verify.qdq_trials import Variant, switched_qdq

    rng = np.random.default_rng(7)
    proto = parser.parse_model(CONV)
    proto.graph.initializer.extend([
        numpy_helper.from_array(rng.standard_normal((6, 4, 3, 3)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "B")])
    feeds = [{"x": (rng.standard_normal((1, 4, 8, 8)) + 0.5).astype(np.float32)} for _ in range(4)]
    stats = calibrate(Model(proto=proto, path="m.onnx", digest=fingerprint(proto)), feeds,
                      detail="all")
    int8, fp8 = eight_bit_format("int8"), eight_bit_format("fp8_e4m3")
    means = {"x": np.mean([f["x"].mean(axis=(0, 2, 3)) for f in feeds], axis=0)}
    switched = switched_qdq(proto, ["conv"], stats, [Variant(int8, tuple(ScaleRule), True),
                                                     Variant(fp8, (ScaleRule.ABSMAX,), False, 2.0)],
                            means=means)
    assert switched.bias_switches  # the bias has its own switch, outside the branches
    board = on_target(switched.model, get_format("fp16"), (), saturate=True)
    wanted = switched.weight_switches.values()
    folded = weight_switches.fold_weight_switches(board, wanted)
    ops = [n.op_type for n in folded.graph.node]
    assert "If" in ops and "Conv" not in ops  # the Conv sits in the branches
    assert not any(n.op_type == "Where" and n.input[0] in set(wanted) for n in folded.graph.node)
    plain, moved = make_session(board, threads=1), make_session(folded, threads=1)
    for assign, corrected in (({}, ()), ({"conv": "int8"}, ()),
                              ({"conv": "int8"}, (("conv", "int8"),)),
                              ({"conv": "fp8_e4m3"}, (("conv", "fp8_e4m3"),))):
        on = switched.feed(assign, {"x": ScaleRule.MSE}, corrected)
        for feed in feeds:
            np.testing.assert_array_equal(run(moved, {**feed, **on})["y"],
                                          run(plain, {**feed, **on})["y"])
    # A trial (the Conv in its branches, one session thread) gives the built model's numbers
    # at one thread (onnxruntime's Conv may sum in another order on two: ppocr_det, 1e-5).
    from npuprep.rewrite.bias_correction import with_biases
    from npuprep.verify.qdq_trials import Trials

    trials = Trials(proto, switched, get_format("fp16"), (), feeds, saturate=True)
    trials.corrected = {("conv", "int8"), ("conv", "fp8_e4m3")}
    got = trials.outputs({"conv": "int8"}, {"x": ScaleRule.MSE})
    built = quantise(proto, ["conv"], stats, int8, saturate=True, tensor_rules={"x": "mse"}).model
    built = with_biases(built, [switched.biases["conv", "int8"]])
    on_board = make_session(on_target(built, get_format("fp16"), (), saturate=True), threads=1)
    for feed, trial in zip(feeds, got, strict=True):
        np.testing.assert_array_equal(trial["y"], run(on_board, feed)["y"])
    # Over the memory the choices may take, the weights stay chosen in every run.
    monkeypatch.setattr(weight_switches, "FOLD_MAX_BYTES", 6 * 4 * 9 * 4 * 3 - 1)
    assert weight_switches.fold_weight_switches(board, wanted) is board


def test_a_transformer_sized_fp8_matmul_trial_gives_the_built_models_numbers_bit_for_bit():
    # x [128, 384] -> MatMul(W [384, 1536]) -> y: onnxruntime sums a prepacked weight in
    # another order at this size; the trial session does not prepack.
    from npuprep.numerics import get_format
    from npuprep.scale_rules import ScaleRule
    from npuprep.verify.qdq_model import on_target
    from npuprep.verify.qdq_trials import Trials, Variant, switched_qdq

    rng = np.random.default_rng(9)
    proto = parser.parse_model("""
<ir_version: 8, opset_import: ["" : 19]>
g (float[128, 384] x) => (float[128, 1536] y) { [mm] y = MatMul (x, W) }
""")
    proto.graph.initializer.append(
        numpy_helper.from_array((0.05 * rng.standard_normal((384, 1536))).astype(np.float32), "W"))
    feeds = [{"x": rng.standard_normal((128, 384)).astype(np.float32)} for _ in range(2)]
    stats = calibrate(Model(proto=proto, path="m.onnx", digest=fingerprint(proto)), feeds,
                      detail="all")
    fp8 = eight_bit_format("fp8_e4m3")
    variant = Variant(fp8, (ScaleRule.ABSMAX,), False, 2.0)
    trials = Trials(proto, switched_qdq(proto, ["mm"], stats, [variant]), get_format("fp16"),
                    (), feeds, saturate=False)
    got = trials.outputs({"mm": "fp8_e4m3"}, {})
    built = quantise(proto, ["mm"], stats, fp8, saturate=False, rule="absmax", headroom=2.0).model
    board = make_session(on_target(built, get_format("fp16"), (), saturate=False), threads=1)
    for feed, trial in zip(feeds, got, strict=True):
        np.testing.assert_array_equal(trial["y"], run(board, feed)["y"])
