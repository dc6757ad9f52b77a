"""A balanced tensor read in a non-saturating FP8 keeps its headroom over what the unbalanced
tensor's range allows each channel (npuprep.verify.channel_bounds): a channel quiet in
calibration and loud on a fresh sample no longer gives NaN."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import numpy_helper, parser

from npuprep.calibrate import calibrate
from npuprep.calibrate.scales import FP8_NAN_HEADROOM, clip_raise_factor
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import eight_bit_format
from npuprep.rewrite.smooth import smooth, smoothing_factors
from npuprep.runtime.session import make_session, run
from npuprep.verify.channel_bounds import with_channel_bounds
from npuprep.verify.qdq_model import quantise
from tests.conftest import run_cli

FP8 = eight_bit_format("fp8_e4m3")
INT8 = eight_bit_format("int8")
RNG = np.random.default_rng(60)

# x (8 channels) -> MatMul "mm" -> y
MATMUL = """
<ir_version: 8, opset_import: ["" : 19]>
g (float[16, 8] x) => (float[16, 4] y) { [mm] y = MatMul (x, W) }
"""


def _sample(quiet: float) -> dict[str, np.ndarray]:
    """Channels 0-6 up to 4; channel 7 up to `quiet`."""
    x = RNG.uniform(-4, 4, (16, 8)).astype(np.float32)
    x[:, 7] = RNG.uniform(-quiet, quiet, 16)
    return {"x": x}


def _balanced():
    proto = parser.parse_model(MATMUL)
    w = RNG.standard_normal((8, 4)).astype(np.float32)
    proto.graph.initializer.append(numpy_helper.from_array(w, "W"))
    feeds = [_sample(0.05) for _ in range(6)]
    stats = calibrate(Model(proto, "m.onnx", fingerprint(proto)), feeds, detail="all")
    top = np.stack([np.abs(f["x"]).max(axis=0) for f in feeds]).max(axis=0)
    done = smooth(proto, {"x": smoothing_factors(top, [w])}, {"x": ["mm"]})
    xs = done.details["smoothed"]["x"]
    again = calibrate(Model(done.model, "b.onnx", "b"), feeds, detail="all")
    return proto, stats, done.model, again, xs


def test_a_quiet_channel_loud_on_a_fresh_sample_stays_finite_in_nonsaturating_fp8():
    proto, stats, model, again, xs = _balanced()
    bounded = with_channel_bounds(model, stats, again, {}, {"x": (xs, 80.0)})
    # The quiet channel's factor raised it ~tenfold: the unbalanced range bounds it there.
    inv = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name.endswith("inv")))
    bound = bounded.tensors[xs].channel_bound
    assert abs(bound - stats.tensors["x"].absmax * float(inv.max())) < 1e-6 * bound
    assert bound > 3 * again.tensors[xs].absmax
    # A fresh sample whose channel 7 reaches the other channels' range (within x's abs-max).
    fresh = _sample(0.05)
    fresh["x"][:, 7] = RNG.uniform(-3.5, 3.5, 16)
    want = run(make_session(proto), fresh)["y"]
    outputs = {}
    for name, s in (("plain", again), ("bounded", bounded)):
        qdq = quantise(model, ["mm"], s, FP8, saturate=False, rule="absmax",
                       headroom=FP8_NAN_HEADROOM).model
        outputs[name] = run(make_session(qdq), fresh)["y"]
    assert np.isnan(outputs["plain"]).any()
    assert np.isfinite(outputs["bounded"]).all()
    assert np.linalg.norm(outputs["bounded"] - want) / np.linalg.norm(want) < 0.05
    # On the calibration samples the wider scale costs FP8 little (its relative precision).
    for f in [_sample(0.05) for _ in range(3)]:
        ref = run(make_session(proto), f)["y"]
        for s in (again, bounded):
            qdq = quantise(model, ["mm"], s, FP8, saturate=False, rule="absmax",
                           headroom=FP8_NAN_HEADROOM).model
            assert np.linalg.norm(run(make_session(qdq), f)["y"] - ref) / np.linalg.norm(ref) < 0.05


def test_the_bound_widens_only_a_nonsaturating_fp8s_clip():
    _, stats, model, again, xs = _balanced()
    r = with_channel_bounds(model, stats, again, {}, {"x": (xs, 80.0)}).tensors[xs]
    plain = again.tensors[xs]
    assert clip_raise_factor(r, FP8, FP8_NAN_HEADROOM) > 3 * clip_raise_factor(
        plain, FP8, FP8_NAN_HEADROOM)
    # INT8 and a saturating FP8 clamp what passes the clip: their clips stay.
    assert clip_raise_factor(r, INT8, 1.0) == clip_raise_factor(plain, INT8, 1.0)
    assert clip_raise_factor(r, FP8, 1.0) == clip_raise_factor(plain, FP8, 1.0)


def test_a_tensor_rescaled_in_place_is_bounded_by_its_own_range_before():
    # Equalisation keeps the tensor's name: its factors (what it was multiplied by) and its
    # statistics before give the bound; a tensor nobody rescaled has none.
    proto, stats, _, _, _ = _balanced()
    factors = np.linspace(1.0, 5.0, 8).astype(np.float32)
    scaled = onnx.ModelProto()
    scaled.CopyFrom(proto)
    after = calibrate(Model(scaled, "s.onnx", "s"), [{"x": _sample(0.05)["x"] * factors}],
                      detail="all")
    bounded = with_channel_bounds(scaled, stats, after, {"x": factors}, {})
    assert abs(bounded.tensors["x"].channel_bound - 5.0 * stats.tensors["x"].absmax) < 1e-5
    assert bounded.tensors["y"].channel_bound == 0.0
    # And it survives the statistics file.
    from npuprep.calibrate.stats import RangeStats

    again = RangeStats.from_dict(bounded.tensors["x"].to_dict())
    assert again.channel_bound == bounded.tensors["x"].channel_bound
    assert "channel_bound" not in bounded.tensors["y"].to_dict()


def test_a_malformed_channel_bound_is_one_line_and_leaves_no_output_folder(tmp_path):
    # A stats file whose channel_bound is not a number -> convert refuses it: exit 2, one line,
    # and the output's new folders are not left behind.
    proto = parser.parse_model(MATMUL)
    proto.graph.initializer.append(numpy_helper.from_array(
        RNG.standard_normal((8, 4)).astype(np.float32), "W"))
    onnx.save(proto, tmp_path / "m.onnx")
    (tmp_path / "data").mkdir()
    for i in range(3):
        np.savez(tmp_path / "data" / f"{i}.npz", **_sample(0.05))
    assert run_cli("calibrate", tmp_path / "m.onnx", "--data", tmp_path / "data",
                   "-o", tmp_path / "s.json").returncode == 0
    doc = json.loads((tmp_path / "s.json").read_text())
    tensors = doc["tensors"]
    first = next(iter(tensors.values())) if isinstance(tensors, dict) else tensors[0]
    first["channel_bound"] = "wide"
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    out = tmp_path / "new" / "deeper" / "m8.onnx"
    r = run_cli("convert", tmp_path / "m.onnx", "--target", "a2000", "--precision", "fp8_e4m3",
                "--data", tmp_path / "data", "--stats", tmp_path / "bad.json", "-o", out)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.json" in lines[0] and "malformed stats file" in lines[0]
    assert not (tmp_path / "new").exists()
