"""The ledger's launch cost per op class, views free where the profile says so, and one fit of
efficiency per format, launch cost per class and per-run cost over several models' kits."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from npuprep.errors import NpuprepError
from npuprep.ledger.fit import fit_points, fit_throughput
from npuprep.ledger.ledger import build_ledger
from npuprep.profiles import Throughput, load_profile
from tests.conftest import model_from_text, run_cli

HEAD = '<ir_version: 8, opset_import: ["" : 17]>\n'


def _pair(signature: str, body: str) -> tuple[str, str]:
    """An FP32 graph `(inputs) => (float[..] y)` and its FP16 conversion: the same body on FP16
    inputs, a Cast at each input and at the output."""
    names = re.findall(r"\] (\w+)", signature.split(" => ")[0])
    body16 = re.sub(r"\b(" + "|".join(names) + r")\b", r"\1h", body).replace("y = ", "yh = ")
    casts = "  ".join(f"{n}h = Cast<to=10>({n})" for n in names)
    return (HEAD + f"g {signature} {{ {body} }}",
            HEAD + f"g {signature} {{ {casts}  {body16}  y = Cast<to=1>(yh) }}")


# Four small models, every one with its FP16 conversion (Casts in and out):
# x, w -> MatMul -> Relu -> y
# x, w, b -> MatMul -> Add b -> Relu -> Mul b -> y
# x, k -> Conv 3x3 -> Relu -> GlobalAveragePool -> y
# x, w, v -> MatMul -> MatMul -> Relu -> y
MODELS = [
    _pair("(float[512,1024] x, float[1024,1024] w) => (float[512,1024] y)",
          "m = MatMul(x, w)  y = Relu(m)"),
    _pair("(float[512,1024] x, float[1024,1024] w, float[1024] b) => (float[512,1024] y)",
          "m = MatMul(x, w)  a = Add(m, b)  r = Relu(a)  y = Mul(r, b)"),
    _pair("(float[1,16,64,64] x, float[32,16,3,3] k) => (float[1,32,1,1] y)",
          "c = Conv<pads=[1,1,1,1]>(x, k)  r = Relu(c)  y = GlobalAveragePool(r)"),
    _pair("(float[256,1024] x, float[1024,1024] w, float[1024,1024] v) => (float[256,1024] y)",
          "m = MatMul(x, w)  n = MatMul(m, v)  y = Relu(n)"),
]


def _ledgers(throughput: Throughput) -> list:
    target = load_profile("h200").resolve()
    return [build_ledger(model_from_text(a), target, throughput=throughput,
                         converted=model_from_text(b)) for a, b in MODELS]


def test_the_fit_recovers_known_efficiencies_class_launch_costs_and_run_cost():
    profile = replace(load_profile("h200").throughput, fuses_elementwise=False)
    # The "device": FP32 at half the profile's efficiency, FP16 at a third, each launch class
    # its own cost, 50 us per inference.
    costs = {"mac": 9.0, "elementwise": 4.0, "reduction": 6.0, "cast": 5.0}
    device = replace(profile, launch_us_by_class=costs, run_us=50.0, efficiency={
        **profile.efficiency, "fp32": profile.efficiency_of("fp32") / 2, "bandwidth_fp32":
        profile.bandwidth_efficiency("fp32") / 2, "fp16": profile.efficiency_of("fp16") / 3,
        "bandwidth_fp16": profile.bandwidth_efficiency("fp16") / 3})
    points = []
    for i, (truth, ledger) in enumerate(zip(_ledgers(device), _ledgers(profile), strict=True)):
        results = {"models": {row: {"median_ms": truth.get(row).estimated_ms}
                              for row in ("fp32", "converted")}}
        points += fit_points(f"m{i}", ledger, results, "median_ms")
    fit = fit_throughput(points, profile)
    assert fit is not None
    assert fit.scales == pytest.approx({"fp32": 2.0, "fp16": 3.0}, rel=2e-3)
    assert fit.launch_us_by_class == pytest.approx(costs, abs=0.02)
    assert fit.run_us == pytest.approx(50.0, abs=0.1)
    # the fitted profile reproduces every measured row
    for truth, fitted in zip(_ledgers(device), _ledgers(fit.throughput), strict=True):
        for row in ("fp32", "converted"):
            assert fitted.get(row).estimated_ms == pytest.approx(truth.get(row).estimated_ms, rel=1e-3)


# x[64,256] -> Reshape -> Transpose -> Relu -> y
VIEWS = HEAD + """g (float[64,256] x) => (float[256,64,1] y) <int64[3] s = {64, 256, 1}> {
  r = Reshape(x, s)  t = Transpose<perm=[1,0,2]>(r)  y = Relu(t) }"""


def test_a_view_costs_nothing_where_the_profile_says_so_and_each_class_pays_its_launch():
    target = load_profile("h200").resolve()
    base = replace(target.profile.throughput, fuses_elementwise=False, launch_us=5.0,
                   launch_us_by_class={"elementwise": 2.0}, run_us=30.0)
    copied = build_ledger(model_from_text(VIEWS), target, throughput=base).get("fp32")
    nodes = {n.op_type: n for n in copied.nodes}
    # a Reshape is a view everywhere; a Transpose copies its bytes and pays the default launch
    assert nodes["Reshape"].ms == 0 and nodes["Reshape"].bytes == 0
    assert nodes["Transpose"].bytes == 2 * 64 * 256 * 4 and nodes["Transpose"].launch_ms == 0.005
    assert nodes["Relu"].launch_ms == 0.002
    viewed = build_ledger(model_from_text(VIEWS), target,
                          throughput=replace(base, view_ops=frozenset({"Transpose"}))).get("fp32")
    transpose = next(n for n in viewed.nodes if n.op_type == "Transpose")
    assert transpose.ms == 0 and transpose.bytes == 0 and transpose.launch_class == "view"
    assert copied.estimated_ms - viewed.estimated_ms == pytest.approx(nodes["Transpose"].ms)
    assert viewed.estimated_ms == pytest.approx(nodes["Relu"].ms + 0.030)
    # where a profile gives views a launch cost, every view pays it
    paying = build_ledger(model_from_text(VIEWS), target, throughput=replace(
        base, launch_us_by_class={"view": 1.0})).get("fp32")
    assert next(n for n in paying.nodes if n.op_type == "Reshape").ms == pytest.approx(0.001)


def test_a_profile_names_only_layout_ops_as_views_and_known_launch_classes(tmp_path: Path):
    doc = load_profile("h200").to_dict()
    doc["throughput"]["view_ops"] = ["Relu"]
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps(doc))
    with pytest.raises(NpuprepError, match="throughput.view_ops"):
        load_profile(str(path))
    doc["throughput"]["view_ops"] = ["Transpose"]
    doc["throughput"]["launch_us_by_class"] = {"gemm": 3}
    path.write_text(json.dumps(doc))
    with pytest.raises(NpuprepError, match="launch_us_by_class"):
        load_profile(str(path))


# x[64,64], w -> MatMul -> y, and its FP16 conversion
MM = _pair("(float[64,64] x, float[64,64] w) => (float[64,64] y)", "y = MatMul(x, w)")
# x[1,4,32,32] -> Relu -> y, and its FP16 conversion
RELU = _pair("(float[1,4,32,32] x) => (float[1,4,32,32] y)", "y = Relu(x)")


def _kit(save, tmp_path: Path, name: str, pair: tuple[str, str]) -> tuple[Path, Path, Path]:
    """Export a kit and write the results a board would (its fingerprint, made-up times)."""
    model, converted = save(pair[0], f"{name}.onnx"), save(pair[1], f"{name}.fp16.onnx")
    kit = tmp_path / f"kit_{name}"
    r = run_cli("ledger", model, converted, "--target", "h200", "--export-kit", kit)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((kit / "manifest.json").read_text())
    (kit / "results.json").write_text(json.dumps({
        "kind": "ledger-results", "schema_version": 1, "kit": manifest["fingerprint"],
        "device": {"machine": "x86_64"}, "models": {
            "fp32": {"median_ms": 0.02, "backend": "test"},
            "converted": {"median_ms": 0.015, "backend": "test"}}}))
    return model, converted, kit / "results.json"


def test_several_kits_fit_at_once_and_a_foreign_results_among_them_is_refused(save, tmp_path: Path):
    model, converted, own = _kit(save, tmp_path, "mm", MM)
    _, _, other = _kit(save, tmp_path, "relu", RELU)
    fitted = tmp_path / "fitted.yaml"
    r = run_cli("ledger", model, converted, "--target", "h200", "--measured", own, "--measured",
                other, "--fitted-profile", fitted, "--json")
    assert r.returncode == 0, r.stderr
    fit = json.loads(r.stdout)["measured"]["fit"]
    assert fit["kits"] == ["mm", "relu"] and len(fit["rows"]) == 4
    assert "relative error" in fit["method"] and fitted.is_file()
    assert all(len(line) <= 100 for line in run_cli(
        "ledger", model, converted, "--target", "h200", "--measured", own, "--measured",
        other).stdout.splitlines())
    # the relu kit's results copied into the mm kit's folder: not that kit's models
    foreign = own.parent / "foreign" / "results.json"
    foreign.parent.mkdir()
    (foreign.parent / "manifest.json").write_text((own.parent / "manifest.json").read_text())
    (foreign.parent / "models").symlink_to(own.parent / "models")
    foreign.write_text(other.read_text())
    r = run_cli("ledger", model, converted, "--target", "h200", "--measured", own, "--measured",
                foreign, "--fitted-profile", tmp_path / "no.yaml")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert f"{foreign}: key 'kit'" in r.stderr and not (tmp_path / "no.yaml").exists()
    # and the model's own results must come first
    r = run_cli("ledger", model, converted, "--target", "h200", "--measured", other)
    assert r.returncode == 2 and "another model" in r.stderr
