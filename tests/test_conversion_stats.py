"""Stats of a source model apply to its conversion: tensors mapped by name through the rewrite.

The converted model records its source's fingerprint and tensor scales (npuprep.provenance);
load_stats maps the source's stats onto it, everywhere a model meets stats (check, crosscheck,
checklist). Stats of any other model are still refused with one line.
"""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from conftest import run_cli
from onnx import numpy_helper

from npuprep.calibrate import calibrate, load_stats, save_stats
from npuprep.calibrate.mapping import scaled_stats
from npuprep.convert import convert
from npuprep.model_io import Model, fingerprint, load_model
from npuprep.profiles import load_profile
from npuprep.provenance import SOURCE_KEY, read_source, record_source


def source_model() -> onnx.ModelProto:
    # x -> MatMul(W, |h| ~ 4e4) -> Relu -> MatMul(V) -> y     (rescaled by 2^-1: h, r)
    # x -> Exp -> ReduceSum -> Div -> p                        (written-out softmax: shifted)
    # x -> Exp -> Log -> q                                     (no exact remedy: pinned FP32)
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 8] x) => (float[2, 4] y, float[2, 8] p, float[2, 8] q) <float[8, 8] W, float[8, 4] V>
    {
      [h_node] h = MatMul(x, W)
      [r_node] r = Relu(h)
      [y_node] y = MatMul(r, V)
      [e_node] e = Exp(x)
      [s_node] s = ReduceSum<keepdims=1>(e)
      [p_node] p = Div(e, s)
      [a_node] a = Exp(x)
      [q_node] q = Log(a)
    }
    """)
    rng = np.random.default_rng(0)
    del model.graph.initializer[:]
    model.graph.initializer.extend([
        numpy_helper.from_array((rng.standard_normal((8, 8)) * 300).astype(np.float32), "W"),
        numpy_helper.from_array((rng.standard_normal((8, 4)) * 0.01).astype(np.float32), "V"),
    ])
    onnx.checker.check_model(model)
    return model


def source_samples() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": (rng.standard_normal((2, 8)) * 30).astype(np.float32)} for _ in range(3)]


@pytest.fixture(scope="module")
def conversion(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The source model, its stats and its conversion for orin, saved as the CLI saves them."""
    folder = tmp_path_factory.mktemp("conversion")
    onnx.save(source_model(), str(folder / "m.onnx"))
    source = load_model(folder / "m.onnx")
    samples = source_samples()
    stats = calibrate(source, samples, detail="all")
    save_stats(stats, folder / "m.stats.json")
    # its rescale islands are 10% of the FLOPs: a passed conversion is written under its name
    result = convert(source, load_profile("orin"), samples, stats=stats, max_fp32_share=0.2)
    assert result, result.verdict
    result.save(folder / "out" / "m.orin.onnx", exports=("yaml",))
    return {"folder": folder, "source": source, "stats": stats, "result": result,
            "converted": folder / "out" / "m.orin.onnx", "samples": samples}


def test_converted_model_records_its_source(conversion):
    converted = load_model(conversion["converted"])
    source = read_source(converted.proto)
    assert source is not None and source.fingerprint == conversion["source"].fingerprint
    assert source.tensor_scales == {"h": 0.5, "r": 0.5}
    # Metadata is no part of the fingerprint: the report's output fingerprint still holds.
    assert converted.fingerprint == fingerprint(conversion["result"].lowered.model)
    assert read_source(conversion["source"].proto) is None


def test_source_stats_map_onto_the_conversion_by_name_and_scale(conversion):
    converted = load_model(conversion["converted"])
    mapped = load_stats(conversion["folder"] / "m.stats.json", converted)
    assert mapped.fingerprint == converted.fingerprint
    assert mapped.mapping["source"] == conversion["source"].fingerprint
    # The rescaled tensors hold exactly what the rewritten FP32 graph computes.
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(conversion["result"].rewritten)
    measured = calibrate(Model(proto=rewritten, path="rewritten", digest=fingerprint(rewritten)),
                         conversion["samples"], detail="all")
    for t in ("h", "r"):
        assert mapped.tensors[t].absmax == measured.tensors[t].absmax
        assert mapped.tensors[t].absmax == conversion["stats"].tensors[t].absmax / 2
        assert mapped.tensors[t].exp_hist == measured.tensors[t].exp_hist
        assert mapped.tensors[t].over == measured.tensors[t].over
    # Kept tensors map directly; Casts lowering inserted carry their neighbour's stats.
    assert mapped.tensors["x"].absmax == conversion["stats"].tensors["x"].absmax
    assert mapped.tensors["x__to_fp16"].absmax == conversion["stats"].tensors["x"].absmax
    assert mapped.tensors["y__fp16"].node == "y_node"
    assert mapped.tensors["y"].absmax == conversion["stats"].tensors["y"].absmax
    # The shifted softmax's tensors hold other values than e and s: unmapped, not guessed.
    assert "e__shifted" not in mapped.tensors and "e" not in mapped.tensors
    assert "e__shifted" in mapped.mapping["unmapped_tensors"]
    assert mapped.mapping["unmapped"] == len(mapped.mapping["unmapped_tensors"]) >= 3
    assert mapped.mapping["rescaled"] == 2


def test_stats_of_another_model_are_refused(conversion, tmp_path):
    converted = load_model(conversion["converted"])
    other = source_model()
    other.graph.node[1].op_type = "Sigmoid"
    onnx.save(other, str(tmp_path / "other.onnx"))
    save_stats(calibrate(load_model(tmp_path / "other.onnx"), conversion["samples"]),
               tmp_path / "other.stats.json")
    from npuprep.errors import NpuprepError

    with pytest.raises(NpuprepError, match="stats belong to another model"):
        load_stats(tmp_path / "other.stats.json", converted)
    # A converted model that names another source is refused the same way.
    forged = onnx.load(str(conversion["converted"]))
    record_source(forged, "0123456789abcdef", {})
    assert {p.key for p in forged.metadata_props} >= {SOURCE_KEY}
    onnx.save(forged, str(tmp_path / "forged.onnx"))
    refused = run_cli("check", tmp_path / "forged.onnx", "-t", "orin",
                      "--stats", conversion["folder"] / "m.stats.json")
    assert refused.returncode == 2
    assert len(refused.stderr.strip().splitlines()) == 1 and "stats belong to another model" in refused.stderr


def test_check_and_checklist_accept_the_source_stats(conversion, tmp_path):
    stats = conversion["folder"] / "m.stats.json"
    done = run_cli("check", conversion["converted"], "-t", "orin", "--stats", stats)
    assert done.returncode in (0, 1), done.stderr
    assert "mapped onto its conversion" in done.stdout
    listed = run_cli("checklist", conversion["converted"], "-t", "orin", "--stats", stats, "--json")
    assert listed.returncode == 0, listed.stderr
    # A workspace holding the source's stats ticks calibration for the converted model too.
    workspace = tmp_path / "bringup"
    workspace.mkdir()
    (workspace / "stats.json").write_text(stats.read_text())
    ticked = run_cli("checklist", conversion["converted"], "-t", "orin", "--workspace", workspace, "--json")
    assert ticked.returncode == 0, ticked.stderr
    item = {i["key"]: i for i in json.loads(ticked.stdout)["items"]}["calibrate"]
    assert item["done"] and "tensors observed" in item["evidence"][0]


def test_scaled_stats_exact_for_powers_of_two_and_detail_dropped_otherwise(conversion):
    h = conversion["stats"].tensors["h"]
    up = scaled_stats(h, 4.0)
    assert up.absmax == h.absmax * 4 and up.min == h.min * 4
    assert up.exp_hist == {e + 2: c for e, c in h.exp_hist.items()}
    assert up.over["fp16"] == h.count - h.zero_count - sum(
        c for e, c in up.exp_hist.items() if 2.0 ** (e + 1) <= 65504)
    assert scaled_stats(h, 2.0 ** -10).over["fp16"] == 0
    odd = scaled_stats(h, 0.3)
    assert math.isclose(odd.absmax, h.absmax * 0.3) and odd.exp_hist == {} and odd.detailed_count == 0


def test_a_rescale_exit_at_an_output_maps_through_its_constant():
    # x -> MatMul(W, |h| ~ 6e4) -> Relu -> y; rescaled by 2^-1 and restored by an exit
    # Mul(y__scaled, 2) at the output: y__scaled holds half of y's values.
    model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 8] x) => (float[2, 8] y) <float[8, 8] W>
    {
      [h_node] h = MatMul(x, W)
      [y_node] y = Relu(h)
    }
    """)
    rng = np.random.default_rng(0)
    del model.graph.initializer[:]
    model.graph.initializer.append(
        numpy_helper.from_array((rng.standard_normal((8, 8)) * 300).astype(np.float32), "W"))
    source = Model(proto=model, path="m.onnx", digest=fingerprint(model))
    samples = [{"x": (rng.standard_normal((2, 8)) * 30).astype(np.float32)} for _ in range(3)]
    stats = calibrate(source, samples, detail="all")
    result = convert(source, load_profile("orin"), samples, stats=stats)
    lowered = result.lowered.model
    converted = Model(proto=lowered, path="m.orin.onnx", digest=fingerprint(lowered))
    from npuprep.calibrate.mapping import map_to_conversion

    mapped = map_to_conversion(stats, converted, read_source(lowered))
    rewritten = calibrate(Model(proto=result.rewritten, path="r", digest=fingerprint(result.rewritten)),
                          samples, detail="all")
    scaled = [t for t in rewritten.tensors if t not in stats.tensors]
    assert scaled and mapped.mapping["unmapped"] == 0
    for t in scaled:
        assert mapped.tensors[t].absmax == rewritten.tensors[t].absmax == stats.tensors["y"].absmax / 2
        assert mapped.tensors[t].exp_hist == rewritten.tensors[t].exp_hist
    assert mapped.tensors["y"].absmax == stats.tensors["y"].absmax


def test_a_conversion_without_the_record_is_known_by_its_report(conversion, tmp_path):
    # A model converted before the metadata record existed: its report.json names it.
    stripped = onnx.load(str(conversion["converted"]))
    del stripped.metadata_props[:]
    onnx.save(stripped, str(tmp_path / "m.orin.onnx"))
    stats = conversion["folder"] / "m.stats.json"
    from npuprep.errors import NpuprepError

    with pytest.raises(NpuprepError, match="stats belong to another model"):
        load_stats(stats, load_model(tmp_path / "m.orin.onnx"))
    report = conversion["converted"].with_suffix(".report.json")
    (tmp_path / "m.orin.report.json").write_text(report.read_text())
    mapped = load_stats(stats, load_model(tmp_path / "m.orin.onnx"))
    assert mapped.mapping["rescaled"] == 2
    assert mapped.tensors["h"].absmax == conversion["stats"].tensors["h"].absmax / 2


def test_check_on_the_conversion_holds_no_range_against_what_it_keeps_fp32(conversion):
    # q's Exp -> Log island stays FP32 in the conversion: the source's stats flag its Exp
    # (e^30 > 65504) on the source model, not on the conversion that pinned it.
    stats = conversion["folder"] / "m.stats.json"
    kept = {n for n in conversion["result"].pinned_nodes}
    assert "a_node" in kept
    on_source = run_cli("check", conversion["folder"] / "m.onnx", "-t", "orin", "--stats", stats, "--json")
    on_conversion = run_cli("check", conversion["converted"], "-t", "orin", "--stats", stats, "--json")
    assert on_conversion.returncode in (0, 1), on_conversion.stderr

    def overflowing(proc):
        return {f["tensor"] for f in json.loads(proc.stdout)["findings"] if f["rule"] == "range.overflow"}

    assert "a" in overflowing(on_source)
    assert "a" not in overflowing(on_conversion)
