"""convert keeps the user's weights in their files: graphs carry no weight bytes, lowered
weights wait in a scratch file, the artefact is the same as from weights held in memory, and
a model past protobuf's 2 GiB converts."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from conftest import external_mlp, run_cli
from onnx import TensorProto, helper, numpy_helper

import npuprep.pipeline.lower_and_verify as convert_module
from npuprep.convert import convert
from npuprep.graph import is_anchored, to_array
from npuprep.model_io import anchored, load_model, write_model_files
from npuprep.profiles import load_profile
from npuprep.runtime.session import make_session, run

RNG = np.random.default_rng(31)


def _mlp(tmp_path, name: str = "m") -> tuple[onnx.ModelProto, str]:
    return external_mlp(tmp_path, RNG, name=name)


def _samples(n: int = 4) -> list[dict[str, np.ndarray]]:
    return [{"x": RNG.standard_normal((4, 256)).astype(np.float32)} for _ in range(n)]


def test_an_anchored_model_reads_its_weights_from_the_file_and_runs_mapped(tmp_path):
    model, path = _mlp(tmp_path)
    light = anchored(load_model(path, weights="file"))
    assert all(is_anchored(i) for i in light.proto.graph.initializer)
    assert light.proto.ByteSize() < 2048  # no weight bytes in the graph
    np.testing.assert_array_equal(to_array(light.proto.graph.initializer[0]),
                                  numpy_helper.to_array(model.graph.initializer[0]))
    x = _samples(1)[0]
    want = run(make_session(model), x)["y"]
    np.testing.assert_array_equal(run(make_session(light.proto), x)["y"], want)


def test_a_written_anchored_model_carries_the_bytes_inline_or_in_its_own_data_file(tmp_path):
    model, path = _mlp(tmp_path)
    light = anchored(load_model(path, weights="file")).proto
    x = _samples(1)[0]
    want = run(make_session(model), x)["y"]
    out = tmp_path / "out"
    out.mkdir()
    for external in (False, True):
        used = write_model_files(light, out / "w.onnx", out / "w.onnx.data", "w.onnx.data",
                                 external_data=external)
        assert used is external
        written = onnx.load(str(out / "w.onnx"), load_external_data=False)
        locations = {e.value for i in written.graph.initializer for e in i.external_data
                     if e.key == "location"}
        assert locations == ({"w.onnx.data"} if external else set())
        np.testing.assert_array_equal(run(make_session(str(out / "w.onnx")), x)["y"], want)


def test_lowered_weights_in_a_scratch_file_give_the_same_artefact_and_verdict(tmp_path, monkeypatch):
    # The same conversion with lowered weights kept in memory and in a scratch file.
    _, path = _mlp(tmp_path)
    samples = _samples()
    reports = {}
    for scratch_bytes in (2**62, 0):
        monkeypatch.setattr(convert_module, "SCRATCH_BYTES", scratch_bytes)
        result = convert(load_model(path, weights="file"), load_profile("a2000"), samples)
        lowered = result.lowered.model
        assert any(is_anchored(i) for i in lowered.graph.initializer) is (scratch_bytes == 0)
        target = tmp_path / f"out{scratch_bytes}" / "m.a2000.onnx"
        reports[scratch_bytes] = result.save(target, exports=())
        assert result.output_check
    keep, spill = (tmp_path / f"out{b}" / "m.a2000.onnx" for b in (2**62, 0))
    assert keep.read_bytes() == spill.read_bytes()
    assert reports[0]["verification"] == reports[2**62]["verification"]


GIB = 2**30


@pytest.mark.skipif(shutil.disk_usage("/tmp").free < 12 * GIB,
                    reason="needs ~12 GiB free on the temporary disk for a 2.1 GB model, "
                           "its conversion and scratch")
def test_a_model_past_two_gigabytes_of_external_data_converts(tmp_path):
    # ids[2,8] -> Gather(table 1,048,580 x 512 FP32 = 2.0 GiB + 8 KiB, external) -> y[2,8,512]
    rows, width = 2**20 + 4, 512
    data = tmp_path / "big.onnx.data"
    with open(data, "wb") as fh:
        block = 2**16
        for start in range(0, rows, block):
            n = min(block, rows - start)
            ids = np.arange(start, start + n, dtype=np.float32)[:, None]
            fh.write(((ids % 997) * 0.01 + np.arange(width, dtype=np.float32) * 1e-3).tobytes())
    table = TensorProto(name="table", data_type=TensorProto.FLOAT, dims=[rows, width])
    table.data_location = TensorProto.EXTERNAL
    for key, value in (("location", data.name), ("offset", "0"), ("length", str(rows * width * 4))):
        table.external_data.add(key=key, value=value)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"], name="lookup")], "big",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, width])], [table])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
              str(tmp_path / "big.onnx"))
    assert data.stat().st_size > 2**31
    samples = tmp_path / "calib"
    samples.mkdir()
    for i in range(3):
        np.savez(samples / f"{i}.npz", ids=RNG.integers(0, rows, (2, 8), dtype=np.int64))
    out = tmp_path / "out" / "big.a2000.onnx"
    done = run_cli("convert", tmp_path / "big.onnx", "-t", "a2000", "--data", samples,
                   "-o", out, "--export", "none", "--no-holdout")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    ids = np.array([[0, 1, 996, 997, rows - 1, 5, 6, 7]] * 2, dtype=np.int64)
    got = run(make_session(str(out)), {"ids": ids})["y"]
    want = (ids.astype(np.float32)[..., None] % 997) * 0.01 + np.arange(width, dtype=np.float32) * 1e-3
    np.testing.assert_allclose(got, want.astype(np.float16).astype(np.float32), rtol=0, atol=0)


def test_max_memory_stops_a_run_that_passes_it_with_nothing_written(tmp_path):
    # the MLP with a 50 MB budget (python and onnxruntime alone need more) -> exit 2, no files
    _, path = _mlp(tmp_path)
    data = tmp_path / "calib"
    data.mkdir()
    for i, feed in enumerate(_samples()):
        np.savez(data / f"{i}.npz", **feed)
    out = tmp_path / "out"
    done = run_cli("convert", path, "-t", "a2000", "--data", data, "-o", out / "m.onnx",
                   "--max-memory", "50M")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--max-memory 0.05 GiB: the run passed it" in lines[0]
    assert not out.exists() or not any(out.iterdir())
    bad = run_cli("convert", path, "-t", "a2000", "--data", data, "-o", out / "m.onnx",
                  "--max-memory", "lots")
    assert bad.returncode == 2 and "--max-memory 'lots': not a size" in bad.stderr
    done = run_cli("convert", path, "-t", "a2000", "--data", data, "-o", out / "m.onnx",
                   "--max-memory", "8G", "--json")
    assert done.returncode == 0, done.stderr
    import json

    cost = json.loads(done.stdout)["resources"]
    assert cost["max_memory_mb"] == 8192 and 10 < cost["peak_rss_mb"] < 8192


def test_the_watch_times_each_stage_and_adds_up_a_stage_entered_twice():
    # start -> "sleeping" (0.05 s asleep) -> "spinning" (CPU-bound) -> "sleeping" again
    import time

    from npuprep.report.render_md import longest_stages, stage_time_lines
    from npuprep.resources import MemoryWatch

    with MemoryWatch() as watch:
        watch.stage("sleeping")
        time.sleep(0.05)
        watch.stage("spinning")
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass
        watch.stage("sleeping")
        time.sleep(0.05)
    cost = watch.to_dict()
    spent = cost["stage_seconds"]
    assert list(spent) == ["start", "sleeping", "spinning"]
    # Asleep, a stage takes wall time and next to no CPU; spinning, both.
    assert spent["sleeping"]["wall_s"] >= 0.1 and spent["sleeping"]["cpu_s"] < 0.05
    assert spent["spinning"]["cpu_s"] >= 0.05
    assert abs(sum(t["wall_s"] for t in spent.values()) - cost["wall_s"]) < 0.1
    assert cost["cpu_s"] >= 0.05
    assert longest_stages(cost, 1).startswith("sleeping 0.1 s")
    table = stage_time_lines(cost)
    assert "## Time by stage" in table and any(r.startswith("| spinning |") for r in table)


def test_a_budget_turns_off_the_memory_for_speed_trades(monkeypatch):
    # x -> MatMul(W 512x512) -> y: folding its weight Casts costs a copy; a tiny budget refuses it
    import npuprep.resources as resources
    from npuprep.verify.compare import folds_weight_casts

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 512])],
        [numpy_helper.from_array(np.ones((512, 512), np.float32), "W")])
    model = helper.make_model(graph)
    assert folds_weight_casts(model)
    monkeypatch.setattr(resources, "_budget", resources.resident_bytes() + 2**20)
    assert not folds_weight_casts(model)
    assert resources.parse_size("3.5GiB", "--max-memory") == int(3.5 * 2**30)
    assert resources.parse_size("800M", "--max-memory") == 800 * 2**20


def test_an_anchored_model_written_in_one_file_parses_to_its_values(tmp_path):
    # the MLP anchored, one initialiser inline (b) -> one .onnx file streamed -> onnx.load == values read in
    from npuprep.graph import with_values

    _, path = _mlp(tmp_path)
    light = anchored(load_model(path, weights="file")).proto
    light.graph.initializer.append(numpy_helper.from_array(np.arange(3, dtype=np.float32), "b"))
    out = tmp_path / "one.onnx"
    assert not write_model_files(light, out, tmp_path / "unused.data", "unused.data",
                                 external_data=False)
    written = onnx.load(str(out))
    assert written.SerializeToString(deterministic=True) == \
        with_values(light).SerializeToString(deterministic=True)
    onnx.checker.check_model(written, full_check=True)
