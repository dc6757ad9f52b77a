"""`npuprep probe` from the command line: micro-probes, single-layer probe, errors."""

from __future__ import annotations

import json

from conftest import run_cli

from npuprep.model_io import load_model
from npuprep.profiles import load_profile

# x -> MatMul(w) -> m -> Relu -> y
MATMUL_RELU = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2,4] x) => (float[2,4] y)
<float[4,4] w = {0.1,0.2,-0.3,0.4,0.5,-0.6,0.7,0.8,0.9,-0.1,0.2,0.3,1,1,1,1}> {
  m = MatMul(x, w)
  y = Relu(m)
}"""


def test_micro_probes_json_on_ort():
    r = run_cli("probe", "--target", "generic", "--backend", "ort", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["schema_version"], doc["kind"], doc["fingerprint"]) == (1, "probe", "")
    assert doc["overall"]["verdict"] == "inf"
    assert len(doc["probes"]) == 10 and doc["layer"] is None
    conv = next(p for p in doc["probes"] if p["name"] == "conv")
    assert conv["counts"]["inf"] == 2 and conv["pairs"][0]["observed"] == "inf"


def test_layer_probe_with_micro_and_saturating_profile(save, tmp_path):
    model = save(MATMUL_RELU)
    target = tmp_path / "sat.yaml"
    data = load_profile("generic").to_dict()
    data.update(name="sat", overflow="saturate")
    import yaml

    target.write_text(yaml.safe_dump(data))
    prof = tmp_path / "measured.yaml"
    r = run_cli("probe", model, "--target", target, "--micro", "--probes", "exp,add",
                "--write-profile", prof, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["fingerprint"] == load_model(model).fingerprint
    assert [p["name"] for p in doc["probes"]] == ["layer", "exp", "add"]
    assert doc["layer"]["verdict"] == "saturate" and doc["layer"]["tensor"] == "m"
    assert doc["layer"]["first_shows"]["tensor"] == "m"
    assert doc["overall"]["verdict"] == "saturate"
    assert str(load_profile(prof).overflow) == "saturate"


def test_table_names_layer_and_unknown_profile(save):
    model = save(MATMUL_RELU)
    r = run_cli("probe", model, "--target", "a2000")
    assert r.returncode == 0, r.stderr
    assert "first shows at tensor 'm'" in r.stdout
    assert "does not know its fp16 overflow mode" in r.stdout
    # An unknown profile's verdicts are the emulator's assumption, and say so.
    assert "overall: assumed (emulated): inf" in r.stdout and "overall: inf" not in r.stdout
    rows = r.stdout.splitlines()
    assert any(line.startswith("layer") and "inf (assumed)" in line for line in rows)
    doc = json.loads(run_cli("probe", model, "--target", "a2000", "--json").stdout)
    assert doc["basis"] == "assumed (emulated)"
    measured = json.loads(run_cli("probe", model, "--target", "a2000", "--backend", "ort", "--json").stdout)
    assert measured["basis"] == "measured (ort)"


def test_write_profile_records_measured_not_assumed(save, tmp_path):
    model = save(MATMUL_RELU)
    prof = tmp_path / "board1.yaml"
    r = run_cli("probe", model, "--target", "a2000", "--write-profile", prof)
    assert r.returncode == 2 and "only assumes" in r.stderr and not prof.exists()
    r = run_cli("probe", model, "--target", "a2000", "--backend", "ort", "--write-profile", prof)
    assert r.returncode == 0, r.stderr
    written = load_profile(prof)
    assert written.name == "board1" and str(written.overflow) == "inf"
    assert written.sources["overflow"].startswith("measured by npuprep probe on ort in fp16: inf")
    same = tmp_path / "a2000.yaml"
    assert run_cli("probe", model, "--target", "a2000", "--backend", "ort", "--write-profile", same).returncode == 0
    assert load_profile(same).name == "a2000-measured"


def test_usage_errors_exit_2(save):
    model = save(MATMUL_RELU)
    assert run_cli("probe").returncode == 2
    r = run_cli("probe", "--classify", "kit")
    assert r.returncode == 2 and "--outputs" in r.stderr
    r = run_cli("probe", model, "--target", "generic", "--layer", "nope")
    assert r.returncode == 2 and "'nope' not found" in r.stderr
    r = run_cli("probe", "--target", "generic", "--backend", "ort", "--probes", "conv,bogus")
    assert r.returncode == 2 and "bogus" in r.stderr
