"""The bundled planner: regenerates byte for byte, overflows in naive FP16, and check finds why."""

import filecmp
from pathlib import Path

import numpy as np

from npuprep.analyse import static_findings
from npuprep.data import load_samples
from npuprep.examples import example_data_dir, example_model_path
from npuprep.examples.planner import GUIDANCE, SAMPLES, planner_samples, write_example
from npuprep.model_io import load_model
from npuprep.numerics import get_format
from npuprep.profiles import load_profile
from npuprep.runtime.session import make_session, run
from npuprep.verify.emulate import emulate


def test_committed_files_regenerate_byte_identically(tmp_path: Path):
    written = write_example(tmp_path)
    names = sorted(p.relative_to(tmp_path).as_posix() for p in written)
    assert names[0] == "data/sample_000.npz" and "planner.onnx" in names and len(names) == SAMPLES + 1
    committed = example_model_path().parent
    for name in names:
        assert filecmp.cmp(tmp_path / name, committed / name, shallow=False), name


def test_committed_samples_are_the_seeded_ones():
    files = sorted(example_data_dir().glob("*.npz"))
    assert len(files) == SAMPLES
    expected = planner_samples(SAMPLES, seed=0)
    with np.load(files[3]) as sample:
        for name, value in expected[3].items():
            assert np.array_equal(sample[name], value)
    assert not np.array_equal(planner_samples(1, seed=1)[0]["traj"], expected[0]["traj"])


def test_naive_fp16_really_overflows_where_fp32_is_finite():
    model = load_model(example_model_path())
    samples = load_samples(str(example_data_dir()), model.proto)
    reference = make_session(model.proto)
    naive = make_session(emulate(model.proto, get_format("fp16"), saturate=False).model)
    broken = 0
    for feed in samples:
        ref = run(reference, feed)
        assert all(np.isfinite(v).all() for v in ref.values())
        # Decimetre coordinates: squared distances reach 1e5..1e6, past FP16's 65504.
        assert ref["risk_cost"].max() > get_format("fp16").max
        low = run(naive, feed)
        broken += not all(np.isfinite(v).all() for v in low.values())
    assert broken == len(samples) == SAMPLES


def test_check_finds_the_planners_hazards():
    model = load_model(example_model_path())
    found = static_findings(model, load_profile("a2000").resolve())
    by_rule: dict[str, list] = {}
    for f in found:
        by_rule.setdefault(f.rule, []).append(f)
    assert by_rule["pattern.guidance"][0].evidence["w"] == GUIDANCE
    assert len(by_rule["pattern.layernorm"]) == 2  # conditional and unconditional trunks
    assert by_rule["pattern.softmax"][0].node == "risk_exp"
    assert {f.node for f in by_rule["hazard.square"]} == {"offset_sq"}
    assert by_rule["hazard.reduce_square"][0].node == "dist2"
