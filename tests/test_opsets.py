"""Opsets 7 to the newest: calibrate, emulate, compare, convert and probe on old models.

The statistics and emulation graphs run on an upgraded copy (tensor names kept); the
converted model keeps the model's own opset and passes onnx.checker there.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from npuprep.calibrate import calibrate
from npuprep.data import load_samples
from npuprep.errors import NpuprepError
from npuprep.model_io import load_model, model_opset
from npuprep.numerics import get_format
from npuprep.opsets import OLDEST_OPSET, convert_opset, newest_opset, upgrade_opset
from npuprep.runtime.session import make_session, run
from npuprep.verify.emulate import emulate
from tests.conftest import run_cli

FP16 = get_format("fp16")


def old_model(opset: int, gain: float = 1.0) -> onnx.ModelProto:
    """Ops whose signature changed across opsets, written the old way.

    x -> Conv(W*gain) -> c -> Clip(0, 6e5) -> r -> ReduceMean(axes attr) -> m -> Unsqueeze(axes attr) -> u
                                             r -> Split(attr) -> s1, s2 -> Add -> y
    """
    rng = np.random.default_rng(opset)
    w = numpy_helper.from_array((rng.standard_normal((4, 3, 3, 3)) * gain).astype(np.float32), "W")
    if opset < 11:
        clip = helper.make_node("Clip", ["c"], ["r"], name="clip", min=0.0, max=6e5)
        inits = [w]
    else:
        clip = helper.make_node("Clip", ["c", "lo", "hi"], ["r"], name="clip")
        inits = [w, numpy_helper.from_array(np.array(0, np.float32), "lo"),
                 numpy_helper.from_array(np.array(6e5, np.float32), "hi")]
    gemm_or_conv = helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1])
    nodes = [
        gemm_or_conv, clip,
        helper.make_node("ReduceMean", ["r"], ["m"], name="mean", axes=[2, 3], keepdims=1),
        helper.make_node("Unsqueeze", ["m"], ["u"], name="unsq", axes=[0]),
        helper.make_node("Split", ["r"], ["s1", "s2"], name="split", axis=1, split=[2, 2]),
        helper.make_node("Add", ["s1", "s2"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes, "old", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 8, 8]),
         helper.make_tensor_value_info("u", TensorProto.FLOAT, [1, 1, 4, 1, 1])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 4 if opset < 9 else 6
    onnx.checker.check_model(model, full_check=True)
    return model


def write(tmp_path, model: onnx.ModelProto, samples: int = 3, scale: float = 1.0):
    path = tmp_path / "old.onnx"
    onnx.save(model, str(path))
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(samples):
        np.savez(data / f"{i:03d}.npz", x=(rng.standard_normal((1, 3, 8, 8)) * scale).astype(np.float32))
    return path, data


@pytest.mark.parametrize("opset", [7, 9, 11, 12])
def test_calibrate_an_old_opset_equals_numpy(tmp_path, opset):
    path, data = write(tmp_path, old_model(opset))
    model = load_model(path)
    samples = load_samples(str(data), model.proto)
    stats = calibrate(model, samples)
    sess = make_session(model.proto)
    outs = [run(sess, feed) for feed in samples]
    for name in ("y", "u"):
        values = np.stack([o[name] for o in outs])
        assert stats.tensors[name].max == pytest.approx(float(values.max()), rel=1e-6)
        assert stats.tensors[name].min == pytest.approx(float(values.min()), rel=1e-6, abs=1e-6)
    assert {"c", "r", "m", "s1", "s2"} <= set(stats.tensors)
    assert stats.fingerprint == model.fingerprint


@pytest.mark.parametrize("opset", [7, 11])
def test_emulation_of_an_old_opset_overflows_like_fp16(opset):
    # conv output ~1e5 (gain 3e4): Inf under FP16, finite in FP32
    model = old_model(opset, gain=3e4)
    emu = emulate(model, FP16, saturate=False)
    assert emu.upgraded_from_opset == opset
    x = np.full((1, 3, 8, 8), 1.0, np.float32)
    ref = run(make_session(model), {"x": x})
    got = run(make_session(emu.model), {"x": x})
    assert np.isfinite(ref["y"]).all()
    assert np.isinf(got["y"]).any()
    saturating = run(make_session(emulate(model, FP16, saturate=True).model), {"x": x})
    assert np.isfinite(saturating["y"]).all() and np.abs(saturating["y"]).max() <= 2 * 65504


def test_upgrade_never_copies_the_weights_and_restores_them():
    model = old_model(11)
    big = numpy_helper.from_array(np.arange(4096, dtype=np.float32).reshape(64, 64), "unused_big")
    model.graph.initializer.append(big)
    new = upgrade_opset(model, 13, why="test")
    assert model_opset(new) == 13
    kept = {i.name: i for i in new.graph.initializer}
    assert kept["unused_big"].data_location == TensorProto.DEFAULT
    np.testing.assert_array_equal(numpy_helper.to_array(kept["unused_big"]), numpy_helper.to_array(big))
    np.testing.assert_array_equal(numpy_helper.to_array(kept["W"]),
                                  numpy_helper.to_array(model.graph.initializer[0]))


@pytest.mark.parametrize("opset", [6, newest_opset() + 1])
def test_opsets_outside_the_range_are_one_clear_error(opset):
    model = old_model(7)
    model.opset_import[0].version = opset
    with pytest.raises(NpuprepError, match=f"opset {opset}.*{OLDEST_OPSET} to {newest_opset()}"):
        emulate(model, FP16, saturate=False)


def test_a_downgrade_without_adapter_is_one_clear_error():
    with pytest.raises(NpuprepError, match="--opset.*could not convert it to 7"):
        convert_opset(old_model(12), 7, why="--opset")


@pytest.mark.parametrize("opset", [7, 11, 12])
def test_convert_keeps_the_models_opset_and_fixes_the_overflow(tmp_path, opset):
    path, data = write(tmp_path, old_model(opset, gain=3e4), samples=4, scale=0.3)
    out = tmp_path / "out" / "old.a2000.onnx"
    done = run_cli("convert", path, "--target", "a2000", "--data", data, "-o", out, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    converted = onnx.load(str(out))
    assert model_opset(converted) == opset
    onnx.checker.check_model(converted, full_check=True)
    make_session(converted)
    compared = run_cli("compare", path, "--emulate", "--target", "a2000", "--data", data)
    assert compared.returncode == 1 and "Traceback" not in compared.stderr  # the naive model overflows
    assert f"declares opset {opset}" in compared.stdout + compared.stderr


def test_convert_to_a_requested_opset(tmp_path):
    path, data = write(tmp_path, old_model(11), samples=2)
    out = tmp_path / "old.13.onnx"
    done = run_cli("convert", path, "--target", "generic", "--data", data, "-o", out, "--opset", "13")
    assert done.returncode == 0, done.stderr[-2000:]
    converted = onnx.load(str(out))
    assert model_opset(converted) == 13
    onnx.checker.check_model(converted, full_check=True)
    refused = run_cli("convert", path, "--target", "generic", "--data", data, "-o",
                      tmp_path / "old.7.onnx", "--opset", "7")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "old.7.onnx").exists()


def test_probe_runs_on_an_old_opset(tmp_path):
    path, _ = write(tmp_path, old_model(11), samples=1)
    done = run_cli("probe", path, "--target", "generic")
    assert done.returncode in (0, 1), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "overall" in done.stdout


def test_a_stale_declared_output_shape_is_dropped_where_a_newer_opset_contradicts_it(tmp_path):
    # x[2,3,4] -> Shape -> Gather(0), Gather(1) -> Unsqueeze -> Concat(.., [-1]) -> Reshape -> y
    # declared y[1, n] (rank 2, as an exporter wrote it); Reshape computes [2, 3, 4] (rank 3).
    # Opset 12 accepts the stale shape; from 14 inference reads the shape and the checker refused.
    model = onnx.parser.parse_model("""
        <ir_version: 7, opset_import: ["" : 12]>
        g (float[2, 3, 4] x) => (float[1, n] y) {
            s = Shape (x)
            a = Gather <axis = 0> (s, i0)
            b = Gather <axis = 0> (s, i1)
            ua = Unsqueeze <axes = [0]> (a)
            ub = Unsqueeze <axes = [0]> (b)
            shape = Concat <axis = 0> (ua, ub, rest)
            y = Reshape (x, shape)
        }""")
    model.graph.initializer.extend([numpy_helper.from_array(np.array(0, np.int64), "i0"),
                                    numpy_helper.from_array(np.array(1, np.int64), "i1"),
                                    numpy_helper.from_array(np.array([-1], np.int64), "rest")])
    onnx.checker.check_model(model, full_check=True)
    new = upgrade_opset(model, 17, why="test")
    onnx.checker.check_model(new, full_check=True)
    (y,) = new.graph.output
    assert y.type.tensor_type.elem_type == TensorProto.FLOAT
    assert len(y.type.tensor_type.shape.dim) == 3  # the rank Reshape computes
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert run(make_session(new), {"x": x})["y"].shape == (2, 3, 4)
    # A declared shape inference agrees with is kept.
    kept = upgrade_opset(old_model(11), 13, why="test")
    assert all(o.type.tensor_type.HasField("shape") for o in kept.graph.output)


def upsample_model() -> onnx.ModelProto:
    """x -> Conv -> a -> Upsample-9(x2, nearest) -> c -> Conv -> y   (opset 9; 'c' read inside)"""
    rng = np.random.default_rng(9)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((2, 4, 3, 3)).astype(np.float32), "w2"),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Upsample", ["a", "scales"], ["c"], mode="nearest"),
             helper.make_node("Conv", ["c", "w2"], ["y"], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(
        nodes, "up", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 16, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)])
    model.ir_version = 6
    onnx.checker.check_model(model, full_check=True)
    return model


def test_an_upsample_renamed_by_the_converter_keeps_its_tensor_name(tmp_path):
    # onnx's Upsample-9 -> Resize-10 adapter names the Resize output afresh: the name comes back.
    model = upsample_model()
    new = upgrade_opset(model, 13, why="test")
    resize = next(n for n in new.graph.node if n.op_type == "Resize")
    assert list(resize.output) == ["c"]
    assert [n.input[0] for n in new.graph.node if n.op_type == "Conv"] == ["x", "c"]
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(run(make_session(new), {"x": x})["y"],
                               run(make_session(model), {"x": x})["y"], rtol=1e-5, atol=1e-5)
    # ... so an opset-9 Upsample model converts (it was refused: "lost tensor 'c'").
    path, data = write(tmp_path, model, samples=3)
    out = tmp_path / "up.int8.onnx"
    done = run_cli("convert", path, "--target", "a2000", "--precision", "int8", "--data", data,
                   "-o", out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert model_opset(onnx.load(str(out))) >= 9
