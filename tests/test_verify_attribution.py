"""A precision failure is traced to the layers whose own FP16 rounding makes it: convert pins
those, not the first node where the error shows (a final Softmax that only sharpens it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import run_cli
from onnx import numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.data import load_samples
from npuprep.flops import node_flops
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import get_format
from npuprep.profiles import load_profile
from npuprep.runtime.session import make_session, run
from npuprep.verify.attribution import Attribution, LayerError, attribute_error, describe
from npuprep.verify.emulate import emulate

# x (~100) -> MatMul(D: neighbour differences) -> y (~4) -> MatMul(W) -> MatMul(V) -> Softmax -> p
# FP16 keeps x to steps of 1/16, so `diff` loses ~1% of y; the Softmax sharpens it past 1e-2.
CHAIN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[64, 8] x) => (float[64, 16] p) {
    [diff] y = MatMul (x, D)
    [mix] h = MatMul (y, W)
    [head] z = MatMul (h, V)
    [softmax] p = Softmax <axis = -1> (z)
}
"""


def _differences(shift: int) -> np.ndarray:
    """x[i] - x[i + shift] per column: values near 100 in, near 4 out."""
    eye = np.eye(8, dtype=np.float32)
    return eye - np.roll(eye, shift, axis=0)


def _build(tmp_path: Path, text: str, seed: int,
           differences: dict[str, int]) -> tuple[Model, list[dict[str, np.ndarray]], Path, Path]:
    """`text` with its difference weights, a mixing W and a head V; 4 samples of x ~ 100."""
    rng = np.random.default_rng(seed)
    proto = parser.parse_model(text)
    weights = {name: _differences(shift) for name, shift in differences.items()}
    weights["W"] = (rng.standard_normal((8, 256)) / np.sqrt(8)).astype(np.float32)
    weights["V"] = (rng.standard_normal((256, 16)) * 3 / np.sqrt(256)).astype(np.float32)
    for name, value in weights.items():
        proto.graph.initializer.append(numpy_helper.from_array(value, name))
    path = tmp_path / "model.onnx"
    onnx.save(proto, path)
    data = tmp_path / "data"
    data.mkdir()
    feeds = [{"x": (100 + 3 * rng.standard_normal((64, 8))).astype(np.float32)} for _ in range(4)]
    for i, feed in enumerate(feeds):
        np.savez(data / f"s{i}.npz", **feed)
    return Model(proto=proto, path=str(path), digest=fingerprint(proto)), feeds, path, data


def _chain(tmp_path: Path) -> tuple[Model, list[dict[str, np.ndarray]], Path, Path]:
    return _build(tmp_path, CHAIN, 0, {"D": 1})


def test_each_layer_alone_rounded_measures_its_own_share_of_the_output_error(tmp_path):
    model, feeds, _, _ = _chain(tmp_path)
    fmt = get_format("fp16")
    flops = node_flops(model.proto, {"x": (64, 8)})
    found = attribute_error(model.proto, fmt, feeds, saturate=False,
                            candidates=["head", "diff", "mix", "no_such_node"], flops=flops)
    assert [x.node for x in found.layers][0] == "diff" and len(found.layers) == 3
    assert found.samples == 4 and np.isclose(sum(x.share for x in found.layers), 1.0)
    assert found.layers[0].share > 0.9 and found.layers[0].flops == flops["diff"]
    # The same number by hand: only `diff` rounded, everything else FP32.
    alone = make_session(emulate(model.proto, fmt, saturate=False,
                                 pinned_nodes={"mix", "head", "softmax"}).model)
    ref = make_session(model.proto)
    err2 = sum(float(((run(alone, f)["p"] - run(ref, f)["p"]) ** 2).sum()) for f in feeds)
    ref2 = sum(float((run(ref, f)["p"] ** 2).sum()) for f in feeds)
    assert np.isclose(found.layers[0].rel_l2, np.sqrt(err2 / ref2), rtol=1e-6)
    assert found.layers[0].rel_l2 > 1e-2


def test_past_the_one_by_one_limit_groups_are_measured_first(tmp_path, monkeypatch):
    import npuprep.verify.attribution as attribution

    model, feeds, _, _ = _chain(tmp_path)
    monkeypatch.setattr(attribution, "MAX_ONE_BY_ONE", 2)
    monkeypatch.setattr(attribution, "GROUPS", 2)  # [diff, mix] and [head]
    flops = node_flops(model.proto, {"x": (64, 8)})
    found = attribute_error(model.proto, get_format("fp16"), feeds, saturate=False,
                            candidates=["diff", "mix", "head"], flops=flops)
    # The group holding `diff` is the worst: only its two layers are ranked one by one.
    assert [x.node for x in found.layers] == ["diff", "mix"] and found.candidates == 3
    assert found.layers[0].share > 0.9 and sum(x.share for x in found.layers) <= 1.0 + 1e-9
    said = describe(found, (), 0.02, total_flops=sum(flops.values()))
    assert said.startswith("FP16 error by node (the 2 nodes of the worst groups of 3 ")


def test_pins_are_the_largest_layers_that_bring_the_prediction_within_rtol_and_the_budget():
    layers = (LayerError("a", "Conv", 0.02, 0.5, 100), LayerError("b", "Conv", 0.014, 0.25, 10),
              LayerError("c", "Conv", 0.01, 0.125, 10), LayerError("d", "Conv", 0.01, 0.125, 10))
    found = Attribution(layers, 2)
    # 0.02 -> 0.01 needs 75% of the squared error out: a and b.
    assert [x.node for x in found.pins_for(0.02, 0.01, room=1000)] == ["a", "b"]
    # `a` does not fit 50 FLOPs: b, c, d hold 50%, not the 75% needed.
    assert found.pins_for(0.02, 0.01, room=50) == ()
    # A smaller cut (31%): b and c hold it for 20 FLOPs, where a alone costs 100.
    assert [x.node for x in found.pins_for(0.012, 0.01, room=1000)] == ["b", "c"]
    assert found.pins_for(0.009, 0.01, room=1000) == ()  # within rtol already
    short = describe(found, (), 0.02, total_flops=1000)
    assert short.startswith("FP16 error by node (4 nodes") and "a 0.02 (50% of the " \
        "squared error, 10% of FLOPs)" in short
    assert short.endswith("no set of them within the FP32 FLOPs budget holds enough of it (a "
                          "larger --max-fp32-share lets more of them be kept)")
    even = Attribution(tuple(LayerError(n, "Conv", 0.01, 0.25, 10) for n in "abcd"), 2)
    assert describe(even, (), 0.02, total_flops=1000).endswith(
        "holds enough of it: FP16's precision spread over the model, not one layer to keep in FP32")


def test_convert_pins_the_layer_that_makes_the_error_not_the_softmax_that_shows_it(tmp_path):
    model, feeds, _, data = _chain(tmp_path)
    samples = list(load_samples(data, model.proto))
    result = convert(model, load_profile("generic"), samples, stats=calibrate(model, samples),
                     metric="rel-l2")  # the probabilities themselves, not their argmax
    assert result.passed and result.pinned_nodes == ("diff",)
    assert max(o["rel_l2"] for o in result.output_check.outputs.values()) < 2e-3
    said = " ".join(result.notes)
    assert "FP16 error by node (2 nodes within the FLOPs budget" in said
    assert "keeping 1 of them in FP32" in said and "pinned diff and retried" in said
    report = result.to_dict()
    traced = report["error_attribution"]
    assert [(t["round"], t["pinned"], t["layers"][0]["node"]) for t in traced] == [(1, ["diff"], "diff")]
    from npuprep.report.render_md import convert_markdown

    md = convert_markdown(report)
    assert "## Where the FP16 error comes from (round 1)" in md
    row = next(line for line in md.splitlines() if line.startswith("| diff | MatMul |"))
    assert row.startswith("| diff | MatMul | 0.01") and row.endswith("| 1.03% | yes |")
    from npuprep.report.tables import attribution_table

    table = attribution_table(report)
    assert table is not None and table.title.startswith("FP16 error by node (")
    round_no, node, op, own, share, flops, pinned = table.rows[0]
    assert (round_no, node, op, pinned) == (1, "diff", "MatMul", "yes")
    assert [row[1] for row in table.rows] == ["diff", "softmax"] and table.rows[1][-1] == ""
    assert own > 1e-2 and share > 0.99 and np.isclose(flops, 8192 / report["fp32_share"]["total_flops"])
    from npuprep.report.render_html import render

    assert 'id="attribution"' in render(report, plots=False)


def test_an_attributed_pin_dropped_again_is_marked_so_in_the_json_and_the_report(tmp_path, monkeypatch):
    import npuprep.verify.pin_rounds as pipeline
    from npuprep.report.render_md import convert_markdown

    model, _, _, data = _chain(tmp_path)
    samples = list(load_samples(data, model.proto))
    # As if the pinned round had not been 10% better: the pin is dropped again.
    monkeypatch.setattr(pipeline, "improved", lambda before, after: False)
    result = convert(model, load_profile("generic"), samples, stats=calibrate(model, samples),
                     metric="rel-l2")  # the probabilities themselves, not their argmax
    assert not result.passed and "diff" not in result.pinned_nodes
    report = result.to_dict()
    assert [(t["pinned"], t["dropped"]) for t in report["error_attribution"]] == [(["diff"], True)]
    md = convert_markdown(report)
    assert "Pinned after this round: `diff` (dropped again: the next round was not 10% better)." in md
    assert next(line for line in md.splitlines()
                if line.startswith("| diff | MatMul |")).endswith("| dropped |")


def test_convert_says_when_no_layer_within_the_budget_holds_the_error(tmp_path):
    _, _, path, data = _chain(tmp_path)
    # `diff` is 1% of the FLOPs, the Softmax 0.13%: with a 0.05% budget no node may be pinned.
    proc = run_cli("convert", path, "--target", "generic", "--data", data, "--metric", "rel-l2",
                   "--max-fp32-share", "0.05", "-o", tmp_path / "o.onnx", "--json")
    assert proc.returncode == 1
    import json

    report = json.loads(proc.stdout)
    assert "diff" not in report["pinned_nodes"]
    assert not any("FP16 error by node" in n for n in report["notes"])
    assert any("first divergent node 'softmax'" in n for n in report["notes"])


# x -> MatMul(D) -> a ┐
# x -> MatMul(E) -> b ┴ Add -> MatMul(W) -> MatMul(V) -> Softmax -> p   (two equal sources)
TWIN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[64, 8] x) => (float[64, 16] p) {
    [diff_a] a = MatMul (x, D)
    [diff_b] b = MatMul (x, E)
    [join] y = Add (a, b)
    [mix] h = MatMul (y, W)
    [head] z = MatMul (h, V)
    [softmax] p = Softmax <axis = -1> (z)
}
"""


def test_a_failure_spread_over_layers_beyond_the_budget_is_said_so_and_pins_nothing_it_cannot_use(
        tmp_path):
    _, _, path, data = _build(tmp_path, TWIN, 1, {"D": 1, "E": 2})
    # Each difference layer is ~1% of the FLOPs: a 1.5% budget holds one of the two.
    proc = run_cli("convert", path, "--target", "generic", "--data", data,
                   "--max-fp32-share", "1.5", "-o", tmp_path / "o.onnx")
    assert proc.returncode == 1, proc.stdout
    said = " ".join(proc.stdout.split())
    assert "FP16 error by node (4 nodes within the FLOPs budget" in said
    assert "no set of them within the FP32 FLOPs budget holds enough of it (a larger " \
           "--max-fp32-share lets more of them be kept)" in said
    verdict = said[said.index("FAILED"):]
    assert "(FP16 precision; --metric, --top-k, --detect or --rtol are yours): largest own share 'diff_" in verdict
    assert "first seen at 'softmax'" in verdict
    assert "pinned diff" not in said


# x -> MatMul(W) -> h (~1) -> Add(1000) -> big -> Sub(1000) -> y   (FP16 keeps big to 0.5 steps)
CANCELLED = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[64, 64] x) => (float[64, 64] y) <float c = {1000.0}> {
    [mm] h = MatMul (x, W)
    [shift] big = Add (h, c)
    [unshift] y = Sub (big, c)
}
"""


def test_a_cancellation_is_planned_fp32_both_elementwise_nodes_for_a_sliver_of_flops(
        tmp_path):
    rng = np.random.default_rng(2)
    proto = parser.parse_model(CANCELLED)
    w = (rng.standard_normal((64, 64)) / 8).astype(np.float32)
    proto.graph.initializer.append(numpy_helper.from_array(w, "W"))
    model = Model(proto=proto, path="cancelled.onnx", digest=fingerprint(proto))
    feeds = [{"x": rng.standard_normal((64, 64)).astype(np.float32)} for _ in range(2)]
    result = convert(model, load_profile("generic"), feeds, stats=calibrate(model, feeds))
    # Either node alone rounds `big`; only both kept FP32 give x back (the MatMul stays FP16).
    assert result.passed and set(result.pinned_nodes) == {"shift", "unshift"}
    assert max(o["rel_l2"] for o in result.output_check.outputs.values()) < 1e-3
    assert result.share.macs == 0.0 and result.share.flops < 0.02
    # The planner's cancellation rule keeps them FP32 before any verification round
    # (measured |big| against |y|: a gain FP16's significand cannot hold).
    assert result.rounds == 1
    assert any(r.rule == "precision.cancellation" for p in result.plan.pins() for r in p.findings)


@pytest.mark.parametrize("switch", ["Where", "If"])
@pytest.mark.parametrize(("fmt_name", "saturate"), [("fp16", False), ("fp8_e4m3", True)])
def test_switched_rounding_gives_each_sets_own_emulation_bit_for_bit(fmt_name, saturate, switch, monkeypatch):
    # x -> MatMul(W)[mm] -> Add(B)[add] -> Relu[relu] -> Transpose[tr] -> Mul(h, h)[sq] -> y ; W also read by mm2
    # (switched by a Where per tensor, or by an If as large tensors are)
    import npuprep.verify.switched as switched_module
    from npuprep.verify.switched import switched_emulation

    if switch == "If":
        monkeypatch.setattr(switched_module, "IF_FROM_ELEMENTS", 1)

    rng = np.random.default_rng(7)
    model = parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 19]>
    g (float[4, 8] x) => (float[8, 4] y, float[4, 8] y2) {
        [mm] h = MatMul (x, W)
        [add] a = Add (h, B)
        [relu] r = Relu (a)
        [tr] t = Transpose <perm = [1, 0]> (r)
        [sq] y = Mul (t, t)
        [mm2] y2 = MatMul (x, W)
    }
    """)
    fmt = get_format(fmt_name)
    model.graph.initializer.extend([
        numpy_helper.from_array((rng.standard_normal((8, 8)) * 3).astype(np.float32), "W"),
        numpy_helper.from_array((rng.standard_normal((8,)) * 0.1 + 0.01).astype(np.float32), "B")])
    labels = ["mm", "add", "relu", "tr", "sq", "mm2"]
    switched = switched_emulation(model, fmt, saturate=saturate, candidates=labels)
    assert {n.op_type for n in switched.model.graph.node} >= {switch}
    session = make_session(switched.model)
    feed = {"x": (rng.standard_normal((4, 8)) * 5.001).astype(np.float32)}
    for on in ({"mm"}, {"sq"}, {"tr"}, {"mm", "add", "relu"}, {"mm2"}, set(labels), set()):
        want = run(make_session(emulate(model, fmt, saturate=saturate,
                                        pinned_nodes=set(labels) - on).model), feed)
        got = run(session, feed | switched.feed(on))
        for name in ("y", "y2"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{sorted(on)} {name}")
    assert not np.array_equal(run(session, feed | switched.feed({"sq"}))["y"],
                              run(session, feed | switched.feed(set()))["y"])
