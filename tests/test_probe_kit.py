"""Board kit round trip: export, run on stand-in boards, bring outputs back as .npy/.bin/.npz, classify."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import model_from_text, run_cli

from npuprep.model_io import load_model
from npuprep.numerics import get_format
from npuprep.profiles import load_profile
from npuprep.runtime.session import make_session, run

FP16 = get_format("fp16")
E4M3 = get_format("fp8_e4m3")

# x -> Conv(w, b) -> h -> Relu -> y
CONV_RELU = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,3,4,4] x) => (float[1,2,4,4] y)
<float[2,3,1,1] w = {0.1,0.2,-0.3,0.4,0.5,-0.6}, float[2] b = {0.1,0.2}> {
  h = Conv(x, w, b)
  y = Relu(h)
}"""


def _board_outputs(kit: Path, post, how: str, out: Path) -> Path:
    """Run every kit model on onnxruntime as the board, post-process, save the way `how` says."""
    manifest = json.loads((kit / "manifest.json").read_text())
    for p in manifest["probes"]:
        feeds = {i["name"]: np.load(kit / i["npy"]) for i in p["inputs"]}
        session = make_session(str(kit / p["model"]))
        values = run(session, feeds)
        refs = {o["name"]: np.load(kit / o["reference"]) for o in p["outputs"]}
        arrays = {o["name"]: post(values[o["name"]], refs[o["name"]]) for o in p["outputs"]}
        if how == "npz":
            out.mkdir(parents=True, exist_ok=True)
            np.savez(out / f"{p['name']}.npz", **arrays)
            continue
        for o in p["outputs"]:
            (out / p["name"]).mkdir(parents=True, exist_ok=True)
            value = arrays[o["name"]]
            if how == "npy":
                np.save(out / p["name"] / f"{o['file_stem']}.npy", value)
            else:
                (out / p["name"] / f"{o['file_stem']}.bin").write_bytes(value.astype(value.dtype.newbyteorder("<")).tobytes())
    return out


def _ieee(observed, reference):
    return observed


def _saturating(observed, reference):
    o = observed.astype(np.float32)
    return np.where(np.isinf(o), np.sign(o) * 65504, o).astype(np.float16)


def _wrapping(observed, reference):
    return (((reference.astype(np.float64) + 65536) % 131072) - 65536).astype(np.float16)


def _wide(observed, reference):
    return reference.astype(np.float32)


@pytest.fixture(scope="module")
def fp16_kit(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("kit")
    model = base / "model.onnx"
    onnx.save(model_from_text(CONV_RELU), str(model))
    kit = base / "kit"
    r = run_cli("probe", model, "--export-kit", kit, "--target", "generic", "--gain", "1e4")
    assert r.returncode == 0, r.stderr
    return kit, model


def test_kit_layout_and_manifest(fp16_kit):
    kit, model = fp16_kit
    manifest = json.loads((kit / "manifest.json").read_text())
    assert manifest["schema_version"] == 1 and manifest["kind"] == "probe-kit"
    assert manifest["fingerprint"] == load_model(model).fingerprint
    assert manifest["format"] == "fp16" and manifest["threshold"] == 65520
    names = [p["name"] for p in manifest["probes"]]
    assert names[0] == "layer" and "conv" in names and "softmax" in names
    for p in manifest["probes"]:
        m = onnx.load(str(kit / p["model"]))
        onnx.checker.check_model(m)
        # Observed outputs are stored in FP16, as the board stores them.
        assert {o.type.tensor_type.elem_type for o in m.graph.output} == {onnx.TensorProto.FLOAT16}
        for i in p["inputs"]:
            arr = np.load(kit / i["npy"])
            assert list(arr.shape) == i["shape"] and str(arr.dtype) == i["dtype"]
            # The raw .bin is the same values, little-endian, no header.
            assert (kit / i["bin"]).read_bytes() == arr.astype(arr.dtype.newbyteorder("<")).tobytes()
        for o in p["outputs"]:
            assert np.load(kit / o["reference"]).dtype == np.float32
    readme = (kit / "README.md").read_text()
    assert "npuprep probe --classify" in readme and "| conv |" in readme


@pytest.mark.parametrize(
    ("post", "how", "expected"),
    [
        (_ieee, "bin", "inf"),
        (_saturating, "npy", "saturate"),
        (_wrapping, "npz", "other-finite"),
        (_wide, "bin", "no-overflow"),
    ],
    ids=["ieee-bin", "saturate-npy", "wrap-npz", "wide-bin-fp32"],
)
def test_round_trip_classifies_each_board(fp16_kit, tmp_path, capsys, post, how, expected):
    from npuprep.cli.main import main

    kit, _ = fp16_kit
    out = _board_outputs(kit, post, how, tmp_path / "out")
    # In process (the same CLI code as a subprocess, without the start-up cost).
    assert main(["probe", "--classify", str(kit), "--outputs", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "probe" and doc["schema_version"] == 1
    verdicts = {p["name"]: p["verdict"] for p in doc["probes"]}
    assert verdicts.pop("softmax") == "no-overflow"
    assert set(verdicts.values()) == {expected}, verdicts
    assert doc["overall"]["verdict"] == expected
    if expected == "no-overflow":
        assert all(p["wider"] for p in doc["probes"] if p["name"] != "softmax")


def test_write_profile_records_the_measured_mode(fp16_kit, tmp_path):
    kit, _ = fp16_kit
    out = _board_outputs(kit, _saturating, "npy", tmp_path / "out")
    prof = tmp_path / "measured.yaml"
    r = run_cli("probe", "--classify", kit, "--outputs", out, "--target", "a2000", "--write-profile", prof)
    assert r.returncode == 0, r.stderr
    profile = load_profile(prof)
    assert str(profile.overflow) == "saturate" and profile.resolve().saturate
    assert profile.sources["overflow"].startswith("measured by npuprep probe on board")
    assert profile.name == "measured" and profile.fp32_pinning == load_profile("a2000").fp32_pinning


def test_missing_and_misshaped_outputs_are_named(fp16_kit, tmp_path):
    kit, _ = fp16_kit
    out = _board_outputs(kit, _ieee, "npy", tmp_path / "out")
    (out / "conv" / "y.npy").unlink()
    np.save(out / "add" / "y.npy", np.zeros((5,), np.float16))
    prof = tmp_path / "p.yaml"
    r = run_cli("probe", "--classify", kit, "--outputs", out, "--write-profile", prof)
    assert r.returncode == 2
    assert "conv/y: missing" in r.stderr
    assert "add/y: shape (5,) does not match the expected (4,)" in r.stderr
    assert not prof.exists()


def test_fp8_kit_nan_board_records_no_saturation(tmp_path):
    # a2000 runs FP16 by default and FP8 too: probe its FP8 path with --precision.
    kit = tmp_path / "kit"
    r = run_cli("probe", "--export-kit", kit, "--target", "a2000", "--precision", "fp8_e4m3",
                "--probes", "conv,exp,cast")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((kit / "manifest.json").read_text())
    assert manifest["threshold"] == 464 and manifest["format"] == "fp8_e4m3"

    def nosat(observed, reference):
        return E4M3.round(reference, saturate=False)

    out = _board_outputs(kit, nosat, "npy", tmp_path / "out")
    prof = tmp_path / "measured.yaml"
    r = run_cli("probe", "--classify", kit, "--outputs", out, "--write-profile", prof, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["overall"]["verdict"] == "nan"
    measured = load_profile(prof)
    assert measured.fp8_saturate is False
    # The FP16 overflow mode was not measured, so it stays as declared.
    assert str(measured.overflow) == "unknown"
    assert "in fp8_e4m3" in measured.sources["fp8_saturate"]


def test_export_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    from npuprep.probe.kit import export_kit
    from npuprep.probe.micro import micro_probes

    export_kit(a, micro_probes(FP16), FP16, target="generic")
    export_kit(b, micro_probes(FP16), FP16, target="generic")
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_export_refuses_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    r = run_cli("probe", "--export-kit", tmp_path, "--target", "generic")
    assert r.returncode == 2 and "holds no probe kit" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
