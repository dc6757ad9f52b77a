"""`--synthetic` respects integer inputs: token ids stay inside their embedding table; --input-range/--input-shape."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import model_from_text, run_cli

from npuprep.data import index_limits, synthetic_samples
from npuprep.errors import NpuprepError

# ids (int64) -> Cast -> Gather(table[3,4]) -> ReduceSum -> y;  x -> Relu -> r
EMBED = """
<ir_version: 8, opset_import: ["" : 17]>
g (int64[1, N] ids, float[1, 4] x) => (float[1, 1] y, float[1, 4] r)
<float[3, 4] table = {1,2,3,4, 5,6,7,8, 9,10,11,12}> {
  i32 = Cast <to = 6> (ids)
  e = Gather (table, i32)
  y = ReduceSum <keepdims = 1> (e)
  r = Relu (x)
}"""


def test_token_ids_stay_within_the_embedding_table():
    model = model_from_text(EMBED)
    assert index_limits(model) == {"ids": 3}
    seen = np.concatenate([f["ids"].ravel() for f in synthetic_samples(model, 40, seed=1)])
    # The old default (0..3) indexes row 3 of a 3-row table; every id is now 0..2, all of them drawn.
    assert seen.min() >= 0 and seen.max() <= 2 and set(seen.tolist()) == {0, 1, 2}


def test_ranges_and_shapes_are_applied_and_checked():
    model = model_from_text(EMBED)
    feeds = list(synthetic_samples(model, 5, ranges={"x": (5.0, 6.0), "ids": (1, 1)},
                                   shapes={"ids": (1, 7)}))
    assert all(f["ids"].shape == (1, 7) and (f["ids"] == 1).all() for f in feeds)
    xs = np.stack([f["x"] for f in feeds])
    assert xs.min() >= 5.0 and xs.max() < 6.0
    with pytest.raises(NpuprepError, match="'nope'"):
        synthetic_samples(model, 1, ranges={"nope": (0, 1)})
    with pytest.raises(NpuprepError, match="fixed at 1"):
        synthetic_samples(model, 1, shapes={"ids": (2, 7)})


def test_calibrate_synthetic_on_an_embedding_runs_and_takes_the_options(save):
    path = save(EMBED)
    r = run_cli("calibrate", path, "--synthetic", "4")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    r = run_cli("calibrate", path, "--synthetic", "2", "--input-range", "x:-3:-2",
                "--input-shape", "ids:[1,5]", "--json")
    assert r.returncode == 0, r.stderr
    tensors = json.loads(r.stdout)["tensors"]
    assert -3 <= tensors["x"]["min"] <= tensors["x"]["max"] < -2
    assert tensors["r"]["max"] == 0
    bad = run_cli("calibrate", path, "--synthetic", "2", "--input-range", "x:3")
    assert bad.returncode == 2 and "NAME:LO:HI" in bad.stderr and "Traceback" not in bad.stderr
    bad = run_cli("calibrate", path, "--synthetic", "2", "--input-range", "y:0:1")
    assert bad.returncode == 2 and "'y'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


# x (float16) -> Relu -> r
HALF = """
<ir_version: 8, opset_import: ["" : 17]>
g (float16[1, N] x) => (float16[1, N] r) {
  r = Relu (x)
}"""


def test_ranges_past_the_inputs_type_or_table_and_huge_shapes_are_refused():
    model = model_from_text(EMBED)
    with pytest.raises(NpuprepError, match=r"ids:0:3: input 'ids' indexes a table of 3 rows: give a range within 0..2"):
        synthetic_samples(model, 1, ranges={"ids": (0, 3)})
    with pytest.raises(NpuprepError, match=r"ids:0:1e\+30: input 'ids' is int64, whose values lie in"):
        synthetic_samples(model, 1, ranges={"ids": (0, 1e30)})
    with pytest.raises(NpuprepError, match=r"x:-1e\+39:0: input 'x' is float32, whose largest value is 3.40282e\+38"):
        synthetic_samples(model, 1, ranges={"x": (-1e39, 0)})
    with pytest.raises(NpuprepError, match=r"x:0:1e\+06: input 'x' is float16, whose largest value is 65504"):
        synthetic_samples(model_from_text(HALF), 1, ranges={"x": (0, 1e6)})
    with pytest.raises(NpuprepError, match=r"--input-shape ids:1x1000000000000: a run needs at least .* GiB"):
        synthetic_samples(model, 1, shapes={"ids": (1, 10**12)})
    feeds = list(synthetic_samples(model_from_text(HALF), 2, ranges={"x": (-65504, 65504)}))
    assert all(np.isfinite(f["x"]).all() for f in feeds)


def test_input_range_with_data_is_refused_not_ignored(save, tmp_path):
    path = save(EMBED)
    np.savez(tmp_path / "s.npz", ids=np.zeros((1, 2), np.int64), x=np.ones((1, 4), np.float32))
    for flag, value in (("--input-range", "x:0:1"), ("--input-shape", "ids:1x3")):
        r = run_cli("calibrate", path, "--data", tmp_path / "s.npz", flag, value)
        assert r.returncode == 2 and f"{flag} shapes --synthetic samples" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
