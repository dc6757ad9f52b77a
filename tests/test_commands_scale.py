"""Every command leaves a model's weights in its files: compare's emulation, the probe's
amplified layer and the ledger's timing kit read them from there (or copy them into the kit),
with the same numbers as weights held in memory."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
from conftest import external_mlp, run_cli
from onnx import TensorProto

import npuprep.probe.layer as probe_layer_module
from npuprep.graph import is_anchored
from npuprep.model_io import anchored, load_model
from npuprep.numerics import get_format
from npuprep.probe.backends import EmulateBackend
from npuprep.probe.layer import probe_layer
from npuprep.runtime.session import make_session, run

RNG = np.random.default_rng(26)
FP16 = get_format("fp16")


def _external(folder) -> str:
    return external_mlp(folder, RNG, width=128, batch=2, scale=0.2)[1]


def _data(tmp_path) -> str:
    folder = tmp_path / "calib"
    folder.mkdir()
    for i in range(3):
        np.savez(folder / f"{i}.npz", x=RNG.uniform(-4, 4, (2, 128)).astype(np.float32))
    return str(folder)


def test_compare_emulate_reads_the_weights_from_their_file(tmp_path, monkeypatch):
    import npuprep.verify.compare as compare

    model, data = _external(tmp_path), _data(tmp_path)
    seen = []
    real = compare._session

    def recording(merged, threads):
        seen.append({i.name: is_anchored(i) for i in merged.graph.initializer if i.name in ("w1", "w2")})
        return real(merged, threads)

    monkeypatch.setattr(compare, "_session", recording)
    from npuprep.cli.main import main

    assert main(["compare", model, "--emulate", "--target", "a2000", "--data", data, "--json"]) == 0
    # One set of weights, left in the user's file for both sides of the merged graph.
    assert seen and seen[0] == {"w1": True, "w2": True}


def test_the_compare_cli_gives_the_numbers_of_weights_held_in_memory(tmp_path):
    model, data = _external(tmp_path), _data(tmp_path)
    inline = tmp_path / "inline.onnx"
    onnx.save(onnx.load(model), str(inline))  # the same model, weights inside the file
    a = run_cli("compare", model, "--emulate", "--target", "a2000", "--data", data, "--json")
    b = run_cli("compare", str(inline), "--emulate", "--target", "a2000", "--data", data, "--json")
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    rows = [{t["tensor"]: (t["rel_l2"], t["max_abs_error"]) for t in json.loads(p.stdout)["tensors"]}
            for p in (a, b)]
    assert rows[0] == rows[1] and "y" in rows[0] and rows[0]["y"][0] > 0


def test_the_probes_amplified_layer_waits_in_a_scratch_file(tmp_path, monkeypatch):
    path = _external(tmp_path)
    feeds = {"x": RNG.uniform(-1, 1, (2, 128)).astype(np.float32)}
    backend = EmulateBackend(FP16, saturate=False)
    in_memory = probe_layer(load_model(path).proto, feeds, FP16, backend, layer="mm1")
    monkeypatch.setattr(probe_layer_module, "SCRATCH_BYTES", 1024)
    amplified = []
    real = probe_layer_module.amplify

    def recording(model, choice, gain, scratch=None):
        out = real(model, choice, gain, scratch)
        amplified.append(next(i for i in out.graph.initializer if i.name.endswith("__probe_gain")))
        return out

    monkeypatch.setattr(probe_layer_module, "amplify", recording)
    light = anchored(load_model(path, weights="file"))
    from_file = probe_layer(light.proto, feeds, FP16, backend, layer="mm1")
    assert amplified and all(is_anchored(t) for t in amplified)
    assert from_file.verdict == in_memory.verdict and from_file.gain == in_memory.gain
    assert from_file.to_dict()["graph_outputs"] == in_memory.to_dict()["graph_outputs"]


def test_the_ledger_kit_carries_the_weights_of_an_external_data_model(tmp_path):
    (tmp_path / "src").mkdir()
    model = _external(tmp_path / "src")
    kit = tmp_path / "kit"
    proc = run_cli("ledger", model, "-t", "a2000", "--export-kit", kit)
    assert proc.returncode == 0, proc.stderr
    feed = {"x": RNG.uniform(-1, 1, (2, 128)).astype(np.float32)}
    want = run(make_session(model), feed)["y"]
    shutil.rmtree(tmp_path / "src")  # the kit goes to the board without the user's files
    got = run(make_session(str(kit / "models" / "fp32.onnx")), feed)["y"]
    np.testing.assert_array_equal(got, want)


def test_a_probe_kit_of_a_model_with_a_scratch_file_carries_its_weights(tmp_path, monkeypatch):
    from npuprep.probe.kit import export_kit
    from npuprep.probe.layer import layer_probe_model

    (tmp_path / "src").mkdir()
    path = _external(tmp_path / "src")
    feeds = {"x": RNG.uniform(-1, 1, (2, 128)).astype(np.float32)}
    probe, *_ = layer_probe_model(load_model(path).proto, feeds, FP16, layer="mm1")
    export_kit(tmp_path / "kit_memory", [probe], FP16, target="a2000")
    monkeypatch.setattr(probe_layer_module, "SCRATCH_BYTES", 1024)
    light, *_ = layer_probe_model(anchored(load_model(path, weights="file")).proto, feeds, FP16, layer="mm1")
    assert light.scratch is not None
    export_kit(tmp_path / "kit_file", [light], FP16, target="a2000")
    del light
    shutil.rmtree(tmp_path / "src")  # the kit stands on its own
    a, b = (onnx.load(str(tmp_path / kit / "models" / "layer.onnx")) for kit in ("kit_memory", "kit_file"))
    assert not any(i.data_location == TensorProto.EXTERNAL for i in b.graph.initializer)
    feed = {"x": feeds["x"]}
    for out_a, out_b in zip(make_session(a).run(None, feed), make_session(b).run(None, feed), strict=True):
        np.testing.assert_array_equal(out_a, out_b)
