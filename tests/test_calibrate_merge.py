"""Shards and `stats merge`: stats over disjoint samples merge into those of one run over all."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest
from conftest import run_cli
from polygraphy.json import save_json

from npuprep.calibrate import calibrate, save_stats
from npuprep.calibrate.merge import merge_stats
from npuprep.calibrate.stats import read_stats_doc, stats_from_dict
from npuprep.data import load_samples
from npuprep.errors import NpuprepError
from npuprep.model_io import load_model

# x -> Mul(x, x) -> sq (over FP16 for big x) -> Add(sq, Log(x)) -> y (NaN for x < 0, -Inf at 0);
# If(c, then: Mul(x, 3) -> t, else: Neg(x) -> e) -> r: t and e seen only in some samples.
MODEL = """
<ir_version: 8, opset_import: ["" : 18]>
g (float[6] x, bool c) => (float[6] y, float[6] r) {
    sq = Mul(x, x)
    lg = Log(x)
    y = Add(sq, lg)
    r = If(c) <
        then_branch = thenb () => (float[6] t) { three = Constant<value = float {3.0}>()  t = Mul(x, three) },
        else_branch = elseb () => (float[6] e) { e = Neg(x) }
    >
}
"""

N = 10


@pytest.fixture
def varied(tmp_path, save):
    """MODEL and N samples over ten orders of magnitude, some with zeros or negative values."""
    model = load_model(save(MODEL))
    rng = np.random.default_rng(18)
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(N):
        x = rng.uniform(0.1, 1.0, 6) * 10.0 ** rng.integers(-5, 5)
        if i % 3 == 1:
            x[2] = -x[2]
        if i % 4 == 2:
            x[0] = 0.0
        np.savez(folder / f"s{i:02d}.npz", x=x.astype(np.float32), c=np.array(bool(rng.integers(0, 2))))
    return model, load_samples(folder, model.proto), folder


def merged_over(model, samples, groups, detail="auto"):
    parts = [(f"part{i}", calibrate(model, replace(samples, files=tuple(g), count=len(g)), detail=detail))
             for i, g in enumerate(groups)]
    random.Random(len(groups)).shuffle(parts)  # the order of the files is free
    return merge_stats(parts)


def test_the_model_exercises_every_merged_field(varied):
    model, samples, _ = varied
    one = calibrate(model, samples)
    t, e, y = one.tensors["t"], one.tensors["e"], one.tensors["y"]
    assert t.seen_in is not None and e.seen_in is not None  # each branch ran in some samples only
    assert sorted(t.seen_in + e.seen_in) == list(range(N))
    assert y.nan_count > 0 and y.inf_count > 0 and one.tensors["sq"].over["fp16"] > 0
    assert y.exp_hist and 0 < y.detailed_count < y.count  # auto: the detail for some samples only


def test_random_splits_merge_to_one_run(varied):
    model, samples, _ = varied
    files = list(samples.files)
    rng = random.Random(18)
    for detail in ("auto", "all"):
        one = calibrate(model, samples, detail=detail).to_dict()
        for _ in range(8 if detail == "auto" else 3):
            k = rng.randint(1, 5)
            if rng.random() < 0.5:  # contiguous slices, as --shard makes them
                cuts = sorted(rng.sample(range(1, N), k - 1))
                groups = [files[a:b] for a, b in zip([0, *cuts], [*cuts, N], strict=True)]
            else:  # any partition
                owner = [rng.randrange(k) for _ in files]
                groups = [[f for f, o in zip(files, owner, strict=True) if o == j] for j in range(k)]
                groups = [g for g in groups if g]
            assert merged_over(model, samples, groups, detail).to_dict() == one, groups


def test_merges_nest_and_shards_cover_the_samples(varied):
    model, samples, _ = varied
    shards = [samples.shard(k, 4) for k in range(1, 5)]
    assert [s.count for s in shards] == [2, 3, 2, 3]
    assert sum((s.files for s in shards), ()) == samples.files
    parts = [(f"s{i}", calibrate(model, s)) for i, s in enumerate(shards)]
    nested = merge_stats([("a", merge_stats(parts[:2])), ("b", merge_stats(parts[2:]))])
    assert nested.to_dict() == calibrate(model, samples).to_dict()


def test_merge_refuses_overlaps_other_models_and_other_sources(varied, save):
    model, samples, folder = varied
    a, b = calibrate(model, samples.shard(1, 2)), calibrate(model, samples.shard(2, 2))
    with pytest.raises(NpuprepError, match=r"^b: sample 's00.npz' is also in a; merged stats must come from disjoint"):
        merge_stats([("a", a), ("b", calibrate(model, samples.shard(1, 3)))])
    other = load_model(save(MODEL.replace("{3.0}", "{4.0}"), "other.onnx"))
    with pytest.raises(NpuprepError, match=r"^o: stats of another model \(fingerprint"):
        merge_stats([("a", a), ("o", calibrate(other, samples.shard(2, 2)))])
    with pytest.raises(NpuprepError, match=r"^b: detail 'all', a has 'auto'"):
        merge_stats([("a", a), ("b", calibrate(model, samples.shard(2, 2), detail="all"))])
    moved = replace(b, source=b.source | {"source": "elsewhere"})
    with pytest.raises(NpuprepError, match=r"^b: samples from elsewhere \(dir\), a's from .*data \(dir\)"):
        merge_stats([("a", a), ("b", moved)])


def test_merge_refuses_edited_files(varied):
    model, samples, _ = varied
    a, b = calibrate(model, samples.shard(1, 2)), calibrate(model, samples.shard(2, 2))
    t = b.tensors["t"]
    short = replace(b, tensors=b.tensors | {"t": replace(t, per_sample_absmax=())})
    with pytest.raises(NpuprepError, match=r"^b: tensors.t: per_sample_absmax has 0 entries for 1 samples of 5"):
        merge_stats([("a", a), ("b", short)])
    other = replace(b, tensors=b.tensors | {"t": replace(t, over={"x": 1})})
    with pytest.raises(NpuprepError, match=r"^b: tensors.t: other formats in over/under"):
        merge_stats([("a", a), ("b", other)])
    with pytest.raises(NpuprepError, match=r"^b: sample_source lacks 'kind' or 'source'"):
        merge_stats([("a", a), ("b", replace(b, source={"x": [1]}))])


def test_indexed_sources_shard_by_index(tmp_path, save):
    # A batched .npz and a Polygraphy JSON: samples are named by index.
    model = load_model(save(MODEL))
    rng = np.random.default_rng(3)
    feeds = [{"x": (rng.standard_normal(6) * 10.0 ** (i - 3)).astype(np.float32), "c": np.array(i % 2 == 0)}
             for i in range(7)]
    save_json(feeds, str(tmp_path / "in.json"))
    samples = load_samples(tmp_path / "in.json", model.proto)
    shards = [samples.shard(k, 3) for k in (1, 2, 3)]
    assert [s.sample_ids() for s in shards] == [(0, 1), (2, 3), (4, 5, 6)]
    merged = merge_stats([(str(k), calibrate(model, s)) for k, s in enumerate(shards)])
    assert merged.to_dict() == calibrate(model, samples).to_dict()
    with pytest.raises(NpuprepError, match="holds only 7 samples, so at most 7 shards"):
        samples.shard(1, 8)


def test_cli_three_shards_then_merge_equal_one_run_byte_for_byte(varied, tmp_path):
    model, _, folder = varied
    model_path = model.path
    whole = tmp_path / "whole.json"
    assert run_cli("calibrate", model_path, "--data", folder, "-o", whole).returncode == 0
    shards = []
    for k in (1, 2, 3):
        shards.append(tmp_path / f"shard{k}.json")
        r = run_cli("calibrate", model_path, "--data", folder, "--shard", f"{k}/3", "-o", shards[-1], "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["sample_count"] == [3, 3, 4][k - 1]
    out = tmp_path / "all.json"
    r = run_cli("stats", "merge", shards[2], shards[0], shards[1], "-o", out)
    assert r.returncode == 0, r.stderr
    assert f"merged 3 files: {N} samples from {folder} (dir)" in r.stdout
    assert out.read_bytes() == whole.read_bytes()


def test_cli_refusals_are_one_line_and_write_nothing(varied, tmp_path, save):
    model, _, folder = varied
    other = save(MODEL.replace("Neg(x)", "Abs(x)"), "other.onnx")
    files = {}
    for name, path, shard in (("a", model.path, "1/2"), ("b", model.path, "2/2"), ("o", other, "2/2"),
                              ("c", model.path, "1/3")):
        files[name] = tmp_path / f"{name}.json"
        assert run_cli("calibrate", path, "--data", folder, "--shard", shard, "-o", files[name]).returncode == 0
    old = tmp_path / "old.json"
    old.write_text(json.dumps(json.loads(files["b"].read_text()) | {"schema_version": 1}))
    out = tmp_path / "all.json"
    for pair, message in (((files["a"], files["o"]), "stats of another model"),
                          ((files["a"], old), "stats schema_version 1 is not supported (expected 2)"),
                          ((files["a"], files["c"]), "is also in"),
                          ((files["a"], tmp_path / "missing.json"), "stats file not found")):
        r = run_cli("stats", "merge", *pair, "-o", out)
        assert r.returncode == 2, r.stderr
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not out.exists()
    before = files["a"].read_bytes()
    r = run_cli("stats", "merge", files["a"], files["b"], "-o", files["a"])
    assert r.returncode == 2 and "refusing to overwrite a stats file to merge" in r.stderr
    assert files["a"].read_bytes() == before
    # An old file still loads where a single stats file is read.
    assert stats_from_dict(read_stats_doc(old)).sample_count == 5


def test_cli_shard_arguments(varied):
    model, _, folder = varied
    r = run_cli("calibrate", model.path, "--data", folder, "--shard", "4/3")
    assert r.returncode == 2 and "expected K/N with 1 <= K <= N" in r.stderr
    r = run_cli("calibrate", model.path, "--data", folder, "--shard", "1/11")
    assert r.returncode == 2 and f"holds only {N} samples, so at most {N} shards" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_saved_and_loaded_shard_merges_like_the_object(varied, tmp_path):
    model, samples, _ = varied
    parts = []
    for k in (1, 2):
        path = save_stats(calibrate(model, samples.shard(k, 2)), tmp_path / f"{k}.json")
        parts.append((str(path), stats_from_dict(read_stats_doc(path))))
    assert merge_stats(parts).to_dict() == calibrate(model, samples).to_dict()
