"""An 8-bit start that errs under half the gate is kept as it is: no balancing, rounding or
search (npuprep.pipeline.plain_start); one erring more, or `search="always"`, is searched."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.model_io import Model, fingerprint
from npuprep.pipeline import convert
from npuprep.pipeline.plain_start import PLAIN_MARGIN, PLAIN_NEAR, PLAIN_SHARE
from npuprep.pipeline.quantise_and_verify import JUDGE_MARGIN
from npuprep.profiles import load_profile
from tests.conftest import int8_mlp, run_cli


def _model() -> tuple[Model, list[dict[str, np.ndarray]]]:
    # x -> MatMul(W) -> Relu -> MatMul(V) -> y
    return int8_mlp(3)


def _convert(rtol: float, search: str | None = None):
    model, feeds = _model()
    stages: list[str] = []
    result = convert(model, load_profile("orin"), feeds, precision="int8", rtol=rtol, search=search,
                     stats=calibrate(model, feeds, detail="all"), progress=stages.append)
    return result, stages


def _nearest(qdq: onnx.ModelProto, weight: str, source: onnx.ModelProto | None = None) -> bool:
    """The INT8 weight `weight` (of `source`, else the MLP) is its FP32 values rounded to
    nearest at its stored scale."""
    source = source or _model()[0].proto
    exact = numpy_helper.to_array(next(i for i in source.graph.initializer if i.name == weight))
    inits = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    dq = next(n for n in qdq.graph.node if n.op_type == "DequantizeLinear"
              and inits.get(n.input[0]) is not None and inits[n.input[0]].shape == exact.shape)
    stored, scale = inits[dq.input[0]], inits[dq.input[1]]
    axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
    shape = [1] * exact.ndim
    shape[axis] = -1
    scale = scale.reshape(shape) if scale.ndim else scale
    return bool(np.array_equal(stored, np.clip(np.round(exact / scale), -127, 127).astype(stored.dtype)))


def test_a_start_under_half_the_gate_is_kept_as_it_is_and_one_past_it_is_searched():
    kept, stages = _convert(0.05)
    error = kept.output_check.worst_rel_l2
    assert 0 < error < PLAIN_MARGIN * 0.05
    assert any("kept as it is" in n for n in kept.notes)
    assert not any("rounding" in s for s in stages) and "checking the plain 8-bit start" in stages
    assert kept.eight_bit.eight_bit_share == 1.0 and len(kept.eight_bit.curve) == 1
    assert kept.output_check and _nearest(kept.lowered.model, "W") and _nearest(kept.lowered.model, "V")
    # Either side of the boundary: the same start at a gate it errs just under / over half of.
    again, _ = _convert(error / PLAIN_MARGIN * 1.02)
    assert any("kept as it is" in n for n in again.notes)
    assert again.output_check.worst_rel_l2 == error
    searched, stages = _convert(error / PLAIN_MARGIN * 0.98)
    assert not any("kept as it is" in n for n in searched.notes)
    assert any("rounding" in s for s in stages)


def test_search_always_searches_a_start_that_would_be_kept():
    result, stages = _convert(0.05, search="always")
    assert not any("kept as it is" in n for n in result.notes)
    assert "checking the plain 8-bit start" not in stages
    assert any("rounding" in s for s in stages)
    assert result.output_check


def test_search_on_an_fp16_conversion_is_refused_in_one_line(tmp_path: Path):
    model, feeds = _model()
    onnx.save(model.proto, tmp_path / "m.onnx")
    (tmp_path / "calib").mkdir()
    for i, f in enumerate(feeds):
        np.savez(tmp_path / "calib" / f"{i:03d}.npz", **f)
    done = run_cli("convert", "m.onnx", "--target", "a2000", "--precision", "fp16", "--search",
                   "always", "--data", "calib", "-o", "out.onnx", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "--search always" in done.stderr
    assert not (tmp_path / "out.onnx").exists()


def test_a_check_until_stops_once_an_output_errs_past_its_bound_and_else_runs_every_sample():
    from npuprep.numerics import get_format
    from npuprep.verify.output_check import check_output_sets, check_until

    # x -> Mul(1.1) -> y, judged against y = x: every sample errs 10%
    proto = parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4] x) => (float[4] y) { k = Constant <value = float {1.1}> () y = Mul (x, k) }
    """)
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal(4).astype(np.float32)} for _ in range(8)]
    expected = [{"y": f["x"]} for f in feeds]
    stopped = check_until(proto, feeds, expected, rtol=0.05, stop_past=0.05)
    # The lower bound over every sample's references passes 0.05 after 2 of the 8 samples.
    assert stopped.samples < 8 and 0.05 < stopped.worst_rel_l2 < 0.1
    whole = check_until(proto, feeds, expected, rtol=0.05, stop_past=0.2)
    assert whole.samples == 8 and abs(whole.worst_rel_l2 - 0.1) < 1e-6
    same = check_output_sets(proto, proto, get_format("fp32"), [feeds], saturate=False, rtol=0.05,
                             emulated=proto, expected=expected)[0]
    assert same.outputs["y"]["rel_l2"] == whole.outputs["y"]["rel_l2"]


def test_the_report_and_the_checklist_say_the_plain_start_was_kept(tmp_path: Path):
    model, feeds = _model()
    onnx.save(model.proto, tmp_path / "m.onnx")
    for folder, part in (("calib", feeds), ("held", [{"x": -f["x"]} for f in feeds[:3]])):
        (tmp_path / folder).mkdir()
        for i, f in enumerate(part):
            np.savez(tmp_path / folder / f"{i:03d}.npz", **f)
    (tmp_path / "ws").mkdir()
    for search, name in ((None, "plain"), ("always", "searched")):
        args = ("--search", search) if search else ()
        done = run_cli("convert", "m.onnx", "--target", "orin", "--precision", "int8", "--data",
                       "calib", "--holdout", "held", "-o", f"{name}.onnx", "--report-json",
                       f"ws/{name}.json", *args, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        report = json.loads((tmp_path / "ws" / f"{name}.json").read_text())
        assert report["eight_bit"]["searched"] is (search == "always")
        (tmp_path / "ws" / f"{name}.json").rename(tmp_path / "ws" / "convert.json")
        listed = run_cli("checklist", "m.onnx", "--target", "orin", "--workspace", "ws", "--json",
                         cwd=tmp_path)
        assert listed.returncode == 0, listed.stderr[-2000:]
        item = next(i for i in json.loads(listed.stdout)["items"] if i["key"] == "precision")
        said = " ".join(item["steps"])
        assert ("kept its plain start" in said) is (search is None)
        if search is None:
            assert "--search always" in said and "held out, rel L2" in said


# x -> MatMul(W) [big] -+-> Add -> y
# z -> MatMul(V) [small]-+         (z: one channel at +-100, the rest ~N(0,1): INT8 rounds them coarsely)
TWO_BRANCHES = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4, 256] x, float[4, 4] z) => (float[4, 64] y) {
    [big] b = MatMul (x, W)
    [small] s = MatMul (z, V)
    y = Add (b, s)
}
"""


def _two_branches(small_weight: float) -> tuple[Model, list[dict[str, np.ndarray]]]:
    """`small` holds 1.5% of the multiply-adds; its input's loud channel sets INT8's scale, so
    the quiet ones (which `small_weight` makes count) lose most of their bits."""
    rng = np.random.default_rng(5)
    proto = parser.parse_model(TWO_BRANCHES)
    v = (rng.standard_normal((4, 64)) * small_weight).astype(np.float32)
    v[0] *= 0.001
    proto.graph.initializer.extend([
        numpy_helper.from_array((rng.standard_normal((256, 64)) * 0.1).astype(np.float32), "W"),
        numpy_helper.from_array(v, "V")])
    feeds = []
    for _ in range(8):
        z = rng.standard_normal((4, 4)).astype(np.float32)
        z[:, 0] = 100.0 * np.sign(rng.standard_normal(4))
        feeds.append({"x": rng.standard_normal((4, 256)).astype(np.float32), "z": z})
    return Model(proto=proto, path="m.onnx", digest=fingerprint(proto)), feeds


def _convert_branches(small_weight: float, target: str = "orin", search: str | None = None):
    model, feeds = _two_branches(small_weight)
    stages: list[str] = []
    result = convert(model, load_profile(target), feeds, precision="int8", rtol=0.05,
                     search=search, stats=calibrate(model, feeds, detail="all"),
                     progress=stages.append)
    return result, stages


def test_a_start_near_the_gate_is_widened_plain_and_kept_where_it_errs_under_half_the_gate():
    result, stages = _convert_branches(0.17)
    # The plain start errs past the search's aim (0.8 x 0.05) but within PLAIN_NEAR x the gate.
    start = result.eight_bit.curve[0]
    assert JUDGE_MARGIN * 0.05 < start.rel_l2 < PLAIN_NEAR * 0.05 and start.share == 1.0
    assert any("of the plain start" in s for s in stages)
    assert not any("rounding" in s or "balancing" in s for s in stages)
    assert result.eight_bit.searched is False and result.eight_bit.kept_wider == ("small",)
    assert PLAIN_SHARE <= result.eight_bit.eight_bit_share < 1.0
    # The model written is that point: its outputs under half the gate, weights at nearest.
    assert result.output_check and result.output_check.worst_rel_l2 < PLAIN_MARGIN * 0.05
    assert _nearest(result.lowered.model, "W", _two_branches(0.17)[0].proto)
    assert any("but 1 layer(s) kept wider (small)" in n for n in result.notes)
    # --search always treats it instead: balanced, every layer in INT8 within the gate.
    searched, stages = _convert_branches(0.17, search="always")
    assert searched.eight_bit.searched is True and any("balancing" in s for s in stages)
    assert searched.output_check


def test_a_start_too_far_from_the_gate_is_not_widened_plain():
    result, stages = _convert_branches(1.0)
    assert not any("of the plain start" in s for s in stages)
    assert result.eight_bit.searched is True and any("balancing" in s for s in stages)
    assert result.output_check


def test_a_plain_widening_that_needs_more_than_its_share_gives_way_to_the_search():
    # At --min-8bit-share 0.99 the plain point (98.5% in 8 bits) may not be kept.
    model, feeds = _two_branches(0.17)
    stages: list[str] = []
    result = convert(model, load_profile("orin"), feeds, precision="int8", rtol=0.05,
                     min_8bit_share=0.99, stats=calibrate(model, feeds, detail="all"),
                     progress=stages.append)
    assert any("of the plain start" in s for s in stages)
    assert any("balancing" in s for s in stages) and result.eight_bit.searched is True
    assert result.eight_bit.eight_bit_share >= 0.99 and result.output_check


def test_the_checklist_names_the_layers_a_plain_widening_kept_wider(tmp_path: Path):
    model, feeds = _two_branches(0.17)
    onnx.save(model.proto, tmp_path / "m.onnx")
    (tmp_path / "calib").mkdir()
    for i, f in enumerate(feeds):
        np.savez(tmp_path / "calib" / f"{i:03d}.npz", **f)
    (tmp_path / "ws").mkdir()
    done = run_cli("convert", "m.onnx", "--target", "orin", "--precision", "int8", "--data",
                   "calib", "-o", "out.onnx", "--report-json", "ws/convert.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "ws" / "convert.json").read_text())
    assert report["eight_bit"]["searched"] is False
    assert report["eight_bit"]["kept_wider"] == ["small"]
    listed = run_cli("checklist", "m.onnx", "--target", "orin", "--workspace", "ws", "--json",
                     cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr[-2000:]
    item = next(i for i in json.loads(listed.stdout)["items"] if i["key"] == "precision")
    assert "1 layer(s) kept wider by its own ranking" in " ".join(item["steps"])
