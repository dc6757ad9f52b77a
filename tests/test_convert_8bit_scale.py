"""8-bit convert at scale: each weight quantised once, a block of rows at a time, the 8-bit
weights of a large model kept in a scratch file (the same artefact and verdict as in
memory), the weights kept wider left in the user's file, and a written QDQ model past
protobuf's limit in external data."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from conftest import external_mlp
from onnx import TensorProto

import npuprep.model_io as model_io
import npuprep.pipeline.lower_and_verify as convert_module
import npuprep.rewrite.qdq_weights as qdq_weights
from npuprep.calibrate import calibrate
from npuprep.graph import external_info, is_anchored
from npuprep.model_io import WeightScratch, anchored, load_model
from npuprep.numerics import eight_bit_format
from npuprep.pipeline import convert
from npuprep.profiles import load_profile
from npuprep.rewrite.qdq_weights import WeightStore, quantise_weight
from npuprep.runtime.session import make_session, run
from npuprep.verify.qdq_model import on_target, quantise

RNG = np.random.default_rng(38)
EIGHT_BIT_TYPES = (TensorProto.INT8, TensorProto.FLOAT8E4M3FN)


def _mlp(tmp_path, name: str = "m") -> str:
    return external_mlp(tmp_path, RNG, name=name)[1]


def _samples(n: int = 4) -> list[dict[str, np.ndarray]]:
    return [{"x": RNG.standard_normal((4, 256)).astype(np.float32)} for _ in range(n)]


def _eight_bit_weights(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [i for i in proto.graph.initializer if i.data_type in EIGHT_BIT_TYPES and len(i.dims) >= 2]


def _reference_quantised(w: np.ndarray, axis: int | None, fmt) -> tuple[np.ndarray, np.ndarray]:
    """The whole weight at once: scale = abs-max / qmax per channel of `axis`."""
    other = tuple(a for a in range(w.ndim) if a != axis)
    top = np.abs(w).max(axis=other if axis is not None else None).astype(np.float32)
    scale = np.where(top > 0, top / np.float32(fmt.qmax), np.float32(1)).astype(np.float32)
    shaped = scale if axis is None else scale.reshape([-1 if a == axis else 1 for a in range(w.ndim)])
    if fmt.is_float:
        return np.clip(w / shaped, -fmt.qmax, fmt.qmax).astype(ml_dtypes.float8_e4m3fn), scale
    return np.clip(np.rint(w / shaped), -fmt.qmax, fmt.qmax).astype(np.int8), scale


@pytest.mark.parametrize("precision", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize(("shape", "axis"), [((40, 24), 1), ((12, 3, 5, 5), 0), ((40, 24), None)])
def test_a_weight_read_a_block_of_rows_at_a_time_quantises_as_the_whole_weight(
        tmp_path, monkeypatch, precision, shape, axis):
    fmt = eight_bit_format(precision)
    w = (RNG.standard_normal(shape) * np.linspace(0.1, 3.0, shape[-1])).astype(np.float32)
    w[1] = 0.0  # an all-zero row (and, for the Conv, an all-zero output channel): scale 1
    (tmp_path / "w.bin").write_bytes(b"\0" * 96 + w.tobytes())
    stored = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=shape)
    stored.data_location = TensorProto.EXTERNAL
    for key, value in (("location", str(tmp_path / "w.bin")), ("offset", "96"), ("length", str(w.nbytes))):
        stored.external_data.add(key=key, value=value)
    monkeypatch.setattr(qdq_weights, "BLOCK_BYTES", 3 * w[0].nbytes)  # blocks of 3 rows
    want_values, want_scale = _reference_quantised(w, axis, fmt)
    for source in (stored, w):
        values, scale = quantise_weight(source, axis, fmt, saturate=True)
        np.testing.assert_array_equal(scale, want_scale)
        assert values.dtype == want_values.dtype
        np.testing.assert_array_equal(values.view(np.uint8), want_values.view(np.uint8))


def test_each_weight_is_quantised_once_into_the_scratch_and_the_wider_one_stays_in_the_users_file(tmp_path):
    # mm1 in INT8 (its weight into the scratch file), mm2 kept wider (w2 read from m.onnx.data)
    path = _mlp(tmp_path)
    model = anchored(load_model(path, weights="file"))
    samples = _samples()
    stats = calibrate(model, samples, detail="all")
    int8 = eight_bit_format("int8")
    store = WeightStore(WeightScratch(tmp_path))
    built = [quantise(model.proto, ["mm1"], stats, int8, saturate=True, weights=store).model
             for _ in range(2)]
    size = store.scratch.path.stat().st_size
    assert 256 * 256 <= size < 2 * 256 * 256  # one INT8 copy of w1, not one per model
    for proto in built:
        (w8,) = _eight_bit_weights(proto)
        assert external_info(w8)[0] == str(store.scratch.path)
        inits = {i.name: i for i in proto.graph.initializer}
        assert "w1" not in inits
        assert is_anchored(inits["w2"]) and external_info(inits["w2"])[0] == str(tmp_path / "m.onnx.data")
    emulated = on_target(built[1], load_profile("a2000").resolve("fp16").fmt, [], saturate=True)
    assert all(is_anchored(i) for i in emulated.graph.initializer if i.name in ("w2", w8.name))
    # The same numbers as the model with every weight read in.
    inline = quantise(model.proto, ["mm1"], stats, int8, saturate=True).model
    assert not any(is_anchored(i) for i in _eight_bit_weights(inline))
    for feeds in samples[:2]:
        np.testing.assert_array_equal(run(make_session(built[0]), feeds)["y"],
                                      run(make_session(inline), feeds)["y"])


@pytest.mark.parametrize("precision", ["int8", "fp8_e4m3"])
def test_8bit_weights_in_a_scratch_file_give_the_same_artefact_and_verdict(tmp_path, monkeypatch, precision):
    # The same 8-bit conversion with its 8-bit weights in memory and in a scratch file.
    path = _mlp(tmp_path)
    samples = _samples()
    stats = calibrate(load_model(path), samples, detail="all")
    reports = {}
    for scratch_bytes in (2**62, 0):
        monkeypatch.setattr(convert_module, "SCRATCH_BYTES", scratch_bytes)
        result = convert(load_model(path, weights="file"), load_profile("a2000"), samples,
                              precision=precision, stats=stats)
        eight = _eight_bit_weights(result.lowered.model)
        assert eight and all(is_anchored(i) is (scratch_bytes == 0) for i in eight)
        target = tmp_path / f"out{scratch_bytes}" / f"m.{precision}.onnx"
        reports[scratch_bytes] = result.save(target, exports=())
    keep, spill = (tmp_path / f"out{b}" / f"m.{precision}.onnx" for b in (2**62, 0))
    assert keep.read_bytes() == spill.read_bytes()
    assert reports[0]["verification"] == reports[2**62]["verification"]


@pytest.mark.parametrize("precision", ["int8", "fp8_e4m3"])
def test_a_written_8bit_model_past_the_protobuf_limit_keeps_its_weights_in_a_data_file(
        tmp_path, monkeypatch, precision):
    # A 64 MiB + 1 KiB limit: anything past 1 KiB counts as too large for one protobuf.
    path = _mlp(tmp_path)
    samples = _samples()
    stats = calibrate(load_model(path), samples, detail="all")
    monkeypatch.setattr(convert_module, "SCRATCH_BYTES", 0)
    result = convert(load_model(path, weights="file"), load_profile("a2000"), samples,
                          precision=precision, stats=stats)
    monkeypatch.setattr(model_io, "PROTOBUF_LIMIT", 64 * 2**20 + 1024)
    target = tmp_path / "out" / f"m.{precision}.onnx"
    result.save(target, exports=())
    data = target.parent / f"m.{precision}.onnx.data"
    assert data.is_file()
    written = onnx.load(str(target), load_external_data=False)
    eight = _eight_bit_weights(written)
    assert eight and all(i.data_location == TensorProto.EXTERNAL for i in eight)
    assert {e.value for i in eight for e in i.external_data if e.key == "location"} == {data.name}
    # onnxruntime reads the 8-bit weights (FP8 too) from the data file: the model's numbers.
    for feeds in samples[:2]:
        np.testing.assert_array_equal(run(make_session(str(target)), feeds)["y"],
                                      run(make_session(result.lowered.model), feeds)["y"])
