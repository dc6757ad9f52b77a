"""Light loads (load_model(weights="file")): large inline weights stay in the .onnx file as
external-data references into it, so calibration never holds them in Python."""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import npuprep.calibrate.run as calibrate_run
from npuprep.calibrate import calibrate
from npuprep.data import load_samples
from npuprep.errors import NpuprepError
from npuprep.model_io import LIGHT_INLINE_BYTES, load_model


def two_layer(rng: np.random.Generator) -> onnx.ModelProto:
    # x[2,64] -> MatMul(W1 64x64, 16 KB) -> Add(b, 256 B) -> Relu -> MatMul(W2 64x32, 8 KB) -> y[2,32]
    w1 = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "W1")
    b = numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "b")
    w2 = numpy_helper.from_array(rng.standard_normal((64, 32)).astype(np.float32) * 50, "W2")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Add", ["h", "b"], ["hb"]),
         helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "W2"], ["y"])],
        "two_layer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])],
        [w1, b, w2],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    onnx.save_model(two_layer(np.random.default_rng(0)), str(path))
    return path


def write_samples(folder: Path, count: int = 4) -> str:
    folder.mkdir()
    rng = np.random.default_rng(1)
    for i in range(count):
        np.savez(folder / f"s{i}.npz", x=rng.standard_normal((2, 64)).astype(np.float32) * (i + 1))
    return str(folder)


def info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def test_large_raw_data_points_at_its_bytes_in_the_model_file(model_path: Path):
    light = load_model(model_path, weights="file")
    memory = load_model(model_path)
    data = model_path.read_bytes()
    inits = {t.name: t for t in light.graph.initializer}
    for name in ("W1", "W2"):
        t = inits[name]
        assert t.data_location == TensorProto.EXTERNAL and not t.HasField("raw_data")
        where = info(t)
        assert where["location"] == "model.onnx"
        offset, length = int(where["offset"]), int(where["length"])
        expected = numpy_helper.to_array(next(i for i in memory.graph.initializer if i.name == name))
        assert data[offset:offset + length] == expected.tobytes()
    assert inits["b"].HasField("raw_data") and len(inits["b"].raw_data) <= LIGHT_INLINE_BYTES
    assert light.fingerprint == memory.fingerprint
    assert light.proto.ByteSize() < 2048


def test_onnxruntime_runs_the_skeleton_bit_identically_and_onnx_restores_the_weights(model_path: Path):
    light = load_model(model_path, weights="file")
    skeleton = model_path.parent / "skeleton.onnx"
    skeleton.write_bytes(light.proto.SerializeToString())
    x = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)
    want = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(skeleton), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.array_equal(want, got)
    restored = onnx.load(str(skeleton))  # reads the external data: here the model file itself
    original = onnx.load(str(model_path))
    for a, b in zip(restored.graph.initializer, original.graph.initializer, strict=True):
        assert (a.name, a.data_type, list(a.dims), a.raw_data) == (b.name, b.data_type, list(b.dims), b.raw_data)
    onnx.load_external_data_for_model(light.proto, str(model_path.parent))
    assert [t.raw_data for t in light.graph.initializer] == [t.raw_data for t in original.graph.initializer]


def test_fingerprint_matches_for_packed_and_16_bit_types(tmp_path: Path):
    # y = Identity(x); unused initialisers: float32, bfloat16 and int4 (packed two per byte), all > 4 KB
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(rng.standard_normal(2048).astype(np.float32), "f32"),
        numpy_helper.from_array(rng.standard_normal(4096).astype(ml_dtypes.bfloat16), "bf16"),
        numpy_helper.from_array(rng.integers(-8, 8, 10001).astype(ml_dtypes.int4), "i4"),
    ]
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], inits)
    path = tmp_path / "types.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    light = load_model(path, weights="file")
    assert all(t.data_location == TensorProto.EXTERNAL for t in light.graph.initializer)
    assert light.fingerprint == load_model(path).fingerprint


def test_calibration_statistics_are_the_same_from_a_light_load(model_path: Path, tmp_path: Path):
    folder = write_samples(tmp_path / "data")
    light, memory = load_model(model_path, weights="file"), load_model(model_path)
    assert calibrate_run.prepare(light, "auto").folder == model_path.parent
    assert calibrate_run.prepare(memory, "auto").folder is None
    for detail, jobs in (("auto", 1), ("all", 1), ("auto", 2)):
        want = calibrate(memory, load_samples(folder, memory.proto), detail=detail, jobs=jobs).to_dict()
        got = calibrate(light, load_samples(folder, light.proto), detail=detail, jobs=jobs).to_dict()
        assert got == want
    assert sorted(p.name for p in model_path.parent.iterdir()) == ["data", "model.onnx"]


def test_a_folder_that_is_not_writable_gets_the_weights_as_arrays(model_path: Path, tmp_path: Path, monkeypatch):
    folder = write_samples(tmp_path / "data")
    light, memory = load_model(model_path, weights="file"), load_model(model_path)
    want = calibrate(memory, load_samples(folder, memory.proto)).to_dict()
    monkeypatch.setattr(calibrate_run.os, "access", lambda *_: False)
    prepared = calibrate_run.prepare(light, "auto")
    assert prepared.folder is None and sorted(prepared.weights) == ["W1", "W2"]
    assert calibrate(light, load_samples(folder, light.proto)).to_dict() == want


def test_external_data_keeps_its_references(model_path: Path, tmp_path: Path):
    folder = tmp_path / "ext"
    folder.mkdir()
    onnx.save_model(onnx.load(str(model_path)), str(folder / "m.onnx"), save_as_external_data=True,
                    location="m.data", size_threshold=0)
    light, memory = load_model(folder / "m.onnx", weights="file"), load_model(folder / "m.onnx")
    assert {info(t)["location"] for t in light.graph.initializer} == {"m.data"}
    assert light.fingerprint == memory.fingerprint == load_model(model_path).fingerprint
    samples = write_samples(tmp_path / "data")
    assert (calibrate(light, load_samples(samples, light.proto)).to_dict()
            == calibrate(memory, load_samples(samples, memory.proto)).to_dict())
    (folder / "m.data").unlink()
    with pytest.raises(NpuprepError, match=r"m\.onnx: external data file 'm\.data' .* not found"):
        load_model(folder / "m.onnx", weights="file")


def test_float_data_initialisers_stay_inline(tmp_path: Path):
    # x[2,64] -> MatMul(W 64x64 as float_data, not raw_data) -> y
    w = np.random.default_rng(4).standard_normal((64, 64)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor("W", TensorProto.FLOAT, [64, 64], w.ravel().tolist())])
    path = tmp_path / "float_data.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    light = load_model(path, weights="file")
    (t,) = light.graph.initializer
    assert t.data_location == TensorProto.DEFAULT and len(t.float_data) == w.size
    assert light.fingerprint == load_model(path).fingerprint
    samples = write_samples(tmp_path / "data")
    stats = calibrate(light, load_samples(samples, light.proto))
    assert calibrate_run.prepare(light, "auto").folder is None
    assert stats.to_dict() == calibrate(load_model(path), load_samples(samples, light.proto)).to_dict()


@pytest.mark.parametrize("cut", ["empty", "half", "tail", "garbage"])
def test_truncated_or_corrupt_files_are_one_error_naming_the_file(model_path: Path, cut: str):
    data = model_path.read_bytes()
    bad = model_path.parent / f"{cut}.onnx"
    bad.write_bytes({"empty": b"", "half": data[: len(data) // 2], "tail": data[:-3],
                     "garbage": b"not a model\n" * 20}[cut])
    for weights in ("file", "memory"):
        with pytest.raises(NpuprepError, match=rf"^{re.escape(str(bad))}: not (a readable|an) ONNX model") as err:
            load_model(bad, weights=weights)
        assert "\n" not in str(err.value)


def test_the_input_model_is_never_modified(model_path: Path, tmp_path: Path):
    before = (model_path.read_bytes(), model_path.stat().st_mtime_ns)
    light = load_model(model_path, weights="file")
    calibrate(light, load_samples(write_samples(tmp_path / "data"), light.proto))
    assert (model_path.read_bytes(), model_path.stat().st_mtime_ns) == before


def test_symlinked_files_are_calibrated_where_they_really_lie(model_path: Path, tmp_path: Path):
    # snap/m.onnx -> blobs/aaa (W2 inline), snap/m.data -> blobs/bbb (W1), as a Hugging Face cache lays them out
    blobs, snap = tmp_path / "blobs", tmp_path / "snap"
    blobs.mkdir()
    snap.mkdir()
    onnx.save_model(onnx.load(str(model_path)), str(blobs / "m.onnx"), save_as_external_data=True,
                    location="m.data", size_threshold=10_000)
    (blobs / "m.onnx").rename(blobs / "aaa")
    (blobs / "m.data").rename(blobs / "bbb")
    (snap / "m.onnx").symlink_to(blobs / "aaa")
    (snap / "m.data").symlink_to(blobs / "bbb")
    light = load_model(snap / "m.onnx", weights="file")
    assert {t.name: info(t)["location"] for t in light.graph.initializer if info(t)} == {"W1": "m.data", "W2": "m.onnx"}
    prepared = calibrate_run.prepare(light, "auto")
    assert prepared.folder == blobs.resolve() and not prepared.weights
    assert {info(t)["location"] for t in prepared.graph.graph.initializer if info(t)} == {"aaa", "bbb"}
    memory = load_model(model_path)
    samples = write_samples(tmp_path / "data")
    assert light.fingerprint == memory.fingerprint
    assert (calibrate(light, load_samples(samples, light.proto)).to_dict()
            == calibrate(memory, load_samples(samples, memory.proto)).to_dict())


def test_data_files_in_several_folders_reach_onnxruntime_as_arrays(model_path: Path, tmp_path: Path):
    # m.onnx keeps W2 (a reference into itself), W1 lies in sub/w.bin
    folder = tmp_path / "apart"
    (folder / "sub").mkdir(parents=True)
    onnx.save_model(onnx.load(str(model_path)), str(folder / "m.onnx"), save_as_external_data=True,
                    location="sub/w.bin", size_threshold=10_000)
    light = load_model(folder / "m.onnx", weights="file")
    prepared = calibrate_run.prepare(light, "auto")
    assert prepared.folder is None and sorted(prepared.weights) == ["W1", "W2"]
    memory = load_model(model_path)
    samples = write_samples(tmp_path / "data")
    assert (calibrate(light, load_samples(samples, light.proto)).to_dict()
            == calibrate(memory, load_samples(samples, memory.proto)).to_dict())


def test_external_data_outside_the_model_folder_is_refused(model_path: Path, tmp_path: Path):
    folder = tmp_path / "inner"
    folder.mkdir()
    proto = onnx.load(str(model_path))
    onnx.save_model(proto, str(folder / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    light = onnx.load(str(folder / "m.onnx"), load_external_data=False)
    for t in light.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../m.data"
    (folder / "m.data").rename(tmp_path / "m.data")
    onnx.save_model(light, str(folder / "m.onnx"))
    for weights in ("file", "memory"):
        with pytest.raises(NpuprepError, match=r"m\.onnx: external data file '\.\./m\.data' .* outside the model's folder"):
            load_model(folder / "m.onnx", weights=weights)


def test_the_fingerprint_is_hashed_in_the_background_and_a_read_error_names_the_file(model_path: Path, monkeypatch):
    import npuprep.model_io as model_io

    light = load_model(model_path, weights="file")
    assert not isinstance(light.digest, str)  # a Future, settled when asked for
    assert light.fingerprint == load_model(model_path).fingerprint

    def unreadable(pieces):  # noqa: ANN001, ANN202 - stands in for _digest
        raise OSError("Input/output error")

    monkeypatch.setattr(model_io, "_digest", unreadable)
    broken = load_model(model_path, weights="file")
    with pytest.raises(NpuprepError, match=re.escape(str(model_path)) + r": cannot read the weights"):
        _ = broken.fingerprint
