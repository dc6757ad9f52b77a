"""Trials that stop once their answer is known: a rule that cannot be the least, a group that
errs past its bound. Bit for bit the answers of the trials run whole, with fewer runs."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import eight_bit_format, get_format
from npuprep.scale_rules import ScaleRule
from npuprep.verify.bounded_trials import errors_within, least_errors
from npuprep.verify.output_errors import PooledSums, reference_squares, worst_pooled_rel_l2
from npuprep.verify.qdq_trials import (
    LocalRuns,
    TrialOutputs,
    Trials,
    Variant,
    choose_rules,
    switched_qdq,
)

INT8 = eight_bit_format("int8")

# x -> MatMul a -> h -> Relu -> r -> MatMul b -> k -> MatMul c -> y; x, r and k each hold an
# outlier in one sample, so abs-max, percentile and MSE clip each of them apart
CHAIN = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[4096, 8] x) => (float[4096, 4] y) {
    [a] h = MatMul (x, W)
    r = Relu (h)
    [b] k = MatMul (r, V)
    [c] y = MatMul (k, U)
}
"""


class Counted(LocalRuns):
    """LocalRuns that counts the sample runs it is handed."""

    jobs = 0

    def run(self, jobs):  # type: ignore[no-untyped-def]
        Counted.jobs += len(jobs)
        return super().run(jobs)


def _chain() -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]], object]:
    rng = np.random.default_rng(3)
    proto = parser.parse_model(CHAIN)
    for name, shape in (("W", (8, 8)), ("V", (8, 8)), ("U", (8, 4))):
        proto.graph.initializer.append(
            numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name))
    feeds = [{"x": rng.standard_t(2, (4096, 8)).astype(np.float32)} for _ in range(4)]
    feeds[1]["x"][0, 0] = 40.0
    stats = calibrate(Model(proto, "m.onnx", fingerprint(proto)), feeds, detail="all")
    return proto, feeds, stats


def _trials(proto: onnx.ModelProto, feeds: list, stats: object,
            shared: TrialOutputs | None = None) -> Trials:
    switched = switched_qdq(proto, ["a", "b", "c"], stats, [Variant(INT8, tuple(ScaleRule), True)])
    return Trials(proto, switched, get_format("fp16"), (), feeds, saturate=True, runs=Counted,
                  shared=shared)


def _groups() -> list[list[tuple[dict[str, str], dict[str, ScaleRule]]]]:
    return [[({layer: "int8"}, {tensor: rule}) for rule in ScaleRule]
            for layer, tensor in (("a", "x"), ("b", "r"), ("c", "k"))]


def test_the_least_rule_is_the_one_every_trial_run_whole_gives_with_fewer_runs():
    proto, feeds, stats = _chain()
    Counted.jobs = 0
    whole = _trials(proto, feeds, stats)
    errors = whole.errors([t for g in _groups() for t in g])
    whole_jobs, Counted.jobs = Counted.jobs, 0
    found = least_errors(_trials(proto, feeds, stats), _groups())
    per_group = [errors[k * 3:(k + 1) * 3] for k in range(3)]
    # The first of the least, and its error bit for bit.
    assert [(i, e) for i, e, _ in found] == [
        (min(range(3), key=g.__getitem__), min(g)) for g in per_group]
    assert whole_jobs == 3 * 3 * 4 and Counted.jobs < whole_jobs
    # Some rule lost by more than its first sample could hide: it stopped there.
    assert any(max(g) > 1.5 * min(g) for g in per_group)


def test_errors_within_their_bounds_are_exact_and_those_past_them_stop_at_a_lower_bound():
    proto, feeds, stats = _chain()
    asked = [t for g in _groups() for t in g]
    exact = _trials(proto, feeds, stats).errors(asked)
    bounds = [e * (1.01 if k % 2 else 0.3) for k, e in enumerate(exact)]
    Counted.jobs = 0
    got = errors_within(_trials(proto, feeds, stats), asked, bounds)
    for e, b, g in zip(exact, bounds, got, strict=True):
        assert g == e if e <= b else b < g <= e
    assert Counted.jobs < len(asked) * 4


def test_the_rule_choice_shares_the_least_rules_outputs_as_before():
    proto, feeds, stats = _chain()
    shared = TrialOutputs()
    chosen = choose_rules(_trials(proto, feeds, stats, shared), proto, ["a", "b", "c"], stats,
                          INT8, tuple(ScaleRule))
    errors = _trials(proto, feeds, stats).errors([t for g in _groups() for t in g])
    rules = list(ScaleRule)
    assert chosen == {t: rules[min(range(3), key=errors[k * 3:(k + 1) * 3].__getitem__)]
                      for k, t in enumerate(("x", "r", "k"))}
    # Each tensor's readers alone at its rule, held for the ranking: the outputs it gives.
    again = _trials(proto, feeds, stats)
    for layer, tensor in (("a", "x"), ("b", "r"), ("c", "k")):
        took = shared.take(again.meaning({layer: "int8"}, {tensor: chosen[tensor]}))
        ran = again.outputs({layer: "int8"}, {tensor: chosen[tensor]})
        assert took is not None and all(np.array_equal(t["y"], r["y"]) for t, r in zip(took, ran, strict=True))


def test_pooled_sums_bound_the_worst_pooled_rel_l2_from_below_and_meet_it_at_the_end():
    rng = np.random.default_rng(9)
    expected = [{"y": rng.standard_normal(50), "z": rng.standard_normal(5)} for _ in range(4)]
    got = [{k: v + rng.standard_normal(v.shape) * 0.1 * (i + 1) for k, v in e.items()}
           for i, e in enumerate(expected)]
    squares, sums, bounds = reference_squares(expected), PooledSums(), []
    for g, e in zip(got, expected, strict=True):
        sums.add(g, e)
        bounds.append(sums.worst(squares))
    assert bounds == sorted(bounds) and bounds[-1] == worst_pooled_rel_l2(got, expected)
    assert bounds[0] < 0.5 * bounds[-1]
    got[2]["z"][0] = np.nan
    assert worst_pooled_rel_l2(got, expected) == math.inf


def test_a_check_that_may_stop_fails_where_the_whole_check_fails_and_runs_fewer_samples():
    proto, feeds, stats = _chain()
    more = feeds + [{"x": f["x"][::-1].copy()} for f in feeds]  # 8 samples
    every = {"a": "int8", "b": "int8", "c": "int8"}
    whole = _trials(proto, more, stats).check(every, {}, rtol=0.05, top_k={})
    assert not whole and whole.worst_rel_l2 > 0.1
    Counted.jobs = 0
    stopped = _trials(proto, more, stats).check(every, {}, rtol=0.05, top_k={}, stop_past=0.04)
    # Failed as the whole check does, on fewer samples, its rel L2 a lower bound past the aim.
    assert not stopped and stopped.samples == Counted.jobs < 8
    assert 0.04 < stopped.worst_rel_l2 <= whole.worst_rel_l2
    # Under an aim the whole check meets it runs every sample, bit for bit the whole check.
    kept = _trials(proto, more, stats).check(every, {}, rtol=0.05, top_k={},
                                             stop_past=2 * whole.worst_rel_l2)
    assert kept.to_dict() == whole.to_dict()


def test_the_references_outputs_run_once_are_those_each_subset_ran_alone():
    from npuprep.verify.qdq_trials import ReferenceOutputs, reference_outputs

    proto, feeds, _ = _chain()
    more = feeds + [{"x": f["x"][::-1].copy()} for f in feeds]
    once = ReferenceOutputs(proto, more)
    odd = once.on(more[1::2])
    assert all(np.array_equal(a["y"], b["y"])
               for a, b in zip(odd, reference_outputs(proto, more[1::2]), strict=True))
    assert once.on(more[1::2])[0] is odd[0]  # the same arrays: run once
    # A feed not among the samples runs on its own.
    other = {"x": feeds[0]["x"] * 2}
    assert np.array_equal(once.on([other])[0]["y"], reference_outputs(proto, [other])[0]["y"])


def test_every_rule_of_an_input_sits_in_one_if_and_each_gives_its_own_pair_bit_for_bit():
    # CHAIN with every rule of each input switchable: one If per input in the graph (the
    # rules' pairs inside it); each rule on alone gives what a model of that rule alone gives
    from npuprep.runtime.session import make_session, run

    proto, feeds, stats = _chain()
    every = switched_qdq(proto, ["a", "b", "c"], stats, [Variant(INT8, tuple(ScaleRule), True)])
    gates = [n for n in every.model.graph.node if n.op_type == "If"]
    assert len(gates) == 3 and len(ScaleRule) > 1
    then = [a.g for n in gates for a in n.attribute if a.name == "then_branch"]
    assert len(then) == 3 and all(sum(x.op_type == "If" for x in t.node) == len(ScaleRule)
                                  for t in then)
    session = make_session(every.model, prepack=False, threads=1)
    off = run(session, {**feeds[1], **every.feed({}, {})})["y"]
    for layer, tensor in (("a", "x"), ("b", "r"), ("c", "k")):
        seen = []
        for rule in ScaleRule:
            alone = switched_qdq(proto, [layer], stats, [Variant(INT8, (rule,), True)])
            want = run(make_session(alone.model, prepack=False, threads=1),
                       {**feeds[1], **alone.feed({layer: "int8"}, {})})["y"]
            got = run(session, {**feeds[1], **every.feed({layer: "int8"}, {tensor: rule})})["y"]
            assert np.array_equal(got, want) and not np.array_equal(got, off)
            seen.append(got)
        # The rules place different clips here (CHAIN's outliers): the pairs are told apart.
        assert any(not np.array_equal(seen[0], s) for s in seen[1:])
