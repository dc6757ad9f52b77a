"""A vendor tool's crash or refusal bisected to its nodes (a fake vendor here), and the exact rewrite of what it names."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from npuprep.graph import topological_order
from npuprep.rewrite.slice_rotation import rotations_as_one_op
from npuprep.runtime.session import make_session, run
from npuprep.vendors.bisection import Attempt, bisect, sub_model
from npuprep.verify.vendor_bisect import bisect_vendor, reference_values, rknn_build
from tests.conftest import model_from_text

FAKE_JOB = Path(__file__).parent / "fixtures" / "fake_rknn_job.py"

# x[1,8] -> Relu -> Sin | Cos -> Concat -> emb[1,16] -> Concat(Slice(emb, 8:), Slice(emb, :8)) -> Mul(2) -> y
FLIP = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,8] x) => (float[1,16] y)
  <int64[1] h = {8}, int64[1] zero = {0}, int64[1] big = {9223372036854775807},
   int64[1] axis = {1}, float two = {2.0}> {
  r = Relu(x)
  s = Sin(r)
  c = Cos(r)
  emb = Concat <axis = -1> (s, c)
  hi = Slice(emb, h, big, axis)
  lo = Slice(emb, zero, h, axis)
  flipped = Concat <axis = -1> (hi, lo)
  y = Mul(flipped, two)
}
"""
# x[2,16] -> Concat(Slice(x, 5:16), Slice(x, 0:5)) -> y (x not itself a Concat: a Gather)
ROTATE = """
<ir_version: 8, opset_import: ["" : 17]>
g ({x_type} x) => (float[2,16] y)
  <int64[1] h = {{5}}, int64[1] zero = {{0}}, int64[1] n = {{16}}, int64[1] axis = {{1}}> {{
  hi = Slice(x, h, n, axis)
  lo = Slice(x, zero, h, {lo_axis})
  y = Concat <axis = 1> (hi, lo)
}}
"""


def _feed(shape: tuple[int, ...] = (1, 8)) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}


@pytest.fixture
def fake_vendor(tmp_path, monkeypatch):
    """An executable that runs the fake job script where the vendor's python would run rknn_job.py."""
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_JOB}" "$@"\n')
    exe.chmod(0o755)
    monkeypatch.delenv("FAKE_RKNN_REFUSE_OP", raising=False)
    monkeypatch.setenv("FAKE_RKNN_CRASH_OP", "Slice")
    return exe


def test_a_crash_on_slices_is_narrowed_to_the_rotation_and_rewritten_exactly(fake_vendor):
    model = model_from_text(FLIP)
    build = rknn_build(fake_vendor)
    failure = build(model, _feed())
    assert not failure and failure.stage == "build (crashed)"
    found = bisect_vendor(model, _feed(), failure, build)
    assert found.bisection.nodes == ("node_of_hi",)  # the fake crashes on any Slice
    assert found.bisection.line == "rknn-toolkit2 build crashes (SIGSEGV) on node node_of_hi (op Slice)"
    assert found and found.retry.ok
    assert "rotation" in found.fix and not any(n.op_type == "Slice" for n in found.fixed.graph.node)
    before = run(make_session(model), _feed())["y"]
    np.testing.assert_array_equal(run(make_session(found.fixed), _feed())["y"], before)


def test_a_crash_with_no_known_rewrite_is_named_and_says_so(fake_vendor, monkeypatch):
    monkeypatch.setenv("FAKE_RKNN_CRASH_OP", "Cos")
    model = model_from_text(FLIP)
    build = rknn_build(fake_vendor)
    found = bisect_vendor(model, _feed(), build(model, _feed()), build)
    assert found.bisection.nodes == ("node_of_c",) and not found
    assert found.lines[1] == "no exact ONNX rewrite is known for it"


def test_bisection_finds_a_pair_that_fails_only_together():
    # a fake build that fails when Sin feeds a Concat in the same part (a fusion bug)
    model = model_from_text(FLIP)

    def build(part: onnx.ModelProto, feed: dict) -> Attempt:
        made = {o: n.op_type for n in part.graph.node for o in n.output}
        bad = any(n.op_type == "Concat" and made.get(i) == "Sin" for n in part.graph.node
                  for i in n.input)
        return Attempt(not bad, "build" if bad else "done", "TypeError: 'NoneType' at 's'" if bad else "")

    values = reference_values(model, _feed())
    found = bisect(model, build(model, {}), values, build)
    assert found.ops == ("Sin", "Concat") and found.builds <= 16
    assert found.line == ("rknn-toolkit2 build refuses nodes node_of_s (op Sin), node_of_emb "
                          "(op Concat) together: TypeError: 'NoneType' at 's'")
    capped = bisect(model, build(model, {}), values, build, max_builds=2)
    assert not capped and "stopped after 2 builds" in capped.line


def test_a_part_takes_cut_activations_as_inputs_and_gives_the_reference_values():
    model = model_from_text(FLIP)
    values = reference_values(model, _feed())
    order = topological_order(model.graph)
    middle = [n for n in order if n.op_type in ("Sin", "Cos", "Concat")][:3]  # s, c, emb
    part, feeds = sub_model(model, middle, values)
    assert [i.name for i in part.graph.input] == ["r"] and set(feeds) == {"r"}
    assert {o.name for o in part.graph.output} == {"emb"}
    onnx.checker.check_model(part)
    np.testing.assert_allclose(run(make_session(part), feeds)["emb"], values["emb"], rtol=1e-6)


def test_a_rotation_of_a_plain_tensor_becomes_one_gather():
    model = model_from_text(ROTATE.format(x_type="float[2,16]", lo_axis="axis"))
    done = rotations_as_one_op(model)
    assert done and [n.op_type for n in done.model.graph.node] == ["Gather"]
    x = _feed((2, 16))
    np.testing.assert_array_equal(run(make_session(done.model), x)["y"],
                                  run(make_session(model), x)["y"])


def test_what_is_not_a_rotation_is_left_and_an_unknown_rank_declines():
    overlapping = model_from_text(ROTATE.format(x_type="float[2,16]", lo_axis="axis")
                                  .replace("h = {5}", "h = {4}", 1)
                                  .replace("lo = Slice(x, zero, h", "lo = Slice(x, zero, n"))
    kept = rotations_as_one_op(overlapping)
    assert not kept and kept.model is overlapping and "no Concat of two Slices" in kept.reason
    shapeless = model_from_text(ROTATE.format(x_type="float[2,16]", lo_axis="axis"))
    shapeless.graph.input[0].type.tensor_type.ClearField("shape")  # a rank nobody wrote down
    unknown = rotations_as_one_op(shapeless)
    assert not unknown and "the rank of x is unknown" in unknown.reason
    symbolic = model_from_text(ROTATE.format(x_type="float[a,b]", lo_axis="axis"))
    assert "no static size along axis 1" in rotations_as_one_op(symbolic).reason
    sized = rotations_as_one_op(symbolic, {"x": (2, 16)})  # measured on a sample
    assert sized and [n.op_type for n in sized.model.graph.node] == ["Gather"]


def test_vendor_check_after_a_crash_is_of_the_rewritten_model_that_builds(fake_vendor):
    from npuprep.verify.vendor import vendor_check

    model = model_from_text(FLIP)
    samples = [_feed(), {"x": _feed()["x"] * 3}]
    plain = vendor_check(model, model, samples, python=str(fake_vendor))
    assert not plain and not plain.built and plain.bisection is None
    check = vendor_check(model, model, samples, python=str(fake_vendor), bisect=True)
    assert check and check.built and check.outputs["y"]["rel_l2"] <= 1e-6
    assert check.bisection["nodes"] == ["node_of_hi"] and check.bisection["retry"]["ok"]
    assert not any(n.op_type == "Slice" for n in check.fixed_model.graph.node)


def test_check_vendor_names_the_node_and_the_rewrite_that_builds(fake_vendor, tmp_path):
    from tests.conftest import run_cli

    path = tmp_path / "flip.onnx"
    onnx.save(model_from_text(FLIP), str(path))
    done = run_cli("check", path, "--target", "rk3588", "--synthetic", "1", "--vendor", "rknn",
                   "--vendor-python", fake_vendor)
    said = " ".join(done.stdout.split())
    assert done.returncode == 1, done.stdout + done.stderr
    assert "rknn-toolkit2 build crashes (SIGSEGV) on node node_of_hi (op Slice)" in said
    assert "rotation(s) as one op; the vendor tool then builds" in said
    assert all(len(line) <= 100 for line in done.stdout.splitlines())


# x[1,32] -> Concat(Slice(x, 16:, steps 1), Slice(x, :16, steps 1)): diffusers' flip_sin_to_cos
STEPPED = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,32] x) => (float[1,32] y)
  <int64[1] h = {16}, int64[1] zero = {0}, int64[1] big = {9223372036854775807},
   int64[1] axis = {1}, int64[1] one = {1}> {
  hi = Slice(x, h, big, axis, one)
  lo = Slice(x, zero, h, axis, one)
  y = Concat <axis = -1> (hi, lo)
}
"""


def test_the_real_toolkit_crash_on_a_stepped_rotation_is_found_and_rewritten(rknn_python):
    model = model_from_text(STEPPED)
    feed = {"x": np.arange(32, dtype=np.float32).reshape(1, 32)}
    build = rknn_build(rknn_python)
    failure = build(model, feed)
    assert failure.stage == "build (crashed)", failure  # rknn-toolkit2 2.5.0: SIGSEGV
    found = bisect_vendor(model, feed, failure, build)
    assert found.bisection.ops == ("Slice", "Slice", "Concat"), found.lines
    assert found and [n.op_type for n in found.fixed.graph.node] == ["Gather"]
    np.testing.assert_array_equal(run(make_session(found.fixed), feed)["y"],
                                  run(make_session(model), feed)["y"])


def test_convert_verify_with_writes_the_rewritten_model_the_vendor_builds(fake_vendor, tmp_path):
    from tests.conftest import run_cli

    path, data = tmp_path / "flip.onnx", tmp_path / "data"
    onnx.save(model_from_text(FLIP), str(path))
    data.mkdir()
    for i in range(4):
        np.savez(data / f"s{i}.npz", x=_feed()["x"] * (i + 1))
    done = run_cli("convert", path, "--target", "rk3588", "--data", data, "--verify-with", "rknn",
                   "--vendor-python", fake_vendor, "-o", tmp_path / "out.onnx")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "build crashes (SIGSEGV) on node node_of_hi (op Slice)" in " ".join(done.stdout.split())
    written = onnx.load(str(tmp_path / "out.onnx"))
    assert not any(n.op_type == "Slice" for n in written.graph.node)
    vendor = json.loads((tmp_path / "out.report.json").read_text())["vendor"]
    assert vendor["passed"] and vendor["bisection"]["retry"]["ok"]


# c, x -> If(c, then: Relu(x), else: Neg(x)) -> y: x is read only inside the branches
BRANCHES = """
<ir_version: 8, opset_import: ["" : 17]>
g (bool c, float[2,3] x) => (float[2,3] y) {
  y = If (c) <then_branch = g1 () => (float[2,3] t) { t = Relu(x) },
              else_branch = g2 () => (float[2,3] e) { e = Neg(x) }>
}
"""


def test_a_refused_if_is_named_with_its_inputs_and_computed_as_where(fake_vendor, monkeypatch):
    monkeypatch.setenv("FAKE_RKNN_REFUSE_OP", "If")
    model = model_from_text(BRANCHES)
    feed = {"c": np.array(False), "x": _feed((2, 3))["x"]}
    build = rknn_build(fake_vendor)
    failure = build(model, feed)
    assert failure.stage == "load_onnx" and "is invalid" in failure.said
    found = bisect_vendor(model, feed, failure, build)
    assert found.bisection.ops == ("If",)
    assert found.lines[0].startswith("rknn-toolkit2 load_onnx refuses node node_of_y (op If): ")
    assert found.lines[1] == "graph input x is read only inside node_of_y's branches"
    assert found and "Where" in [n.op_type for n in found.fixed.graph.node]
    for c in (False, True):
        np.testing.assert_array_equal(run(make_session(found.fixed), {**feed, "c": np.array(c)})["y"],
                                      run(make_session(model), {**feed, "c": np.array(c)})["y"])


def test_check_vendor_with_a_python_that_is_not_there_is_one_line_and_exit_2(tmp_path):
    from tests.conftest import run_cli

    path = tmp_path / "flip.onnx"
    onnx.save(model_from_text(FLIP), str(path))
    done = run_cli("check", path, "--target", "rk3588", "--vendor", "rknn",
                   "--vendor-python", tmp_path / "missing")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--vendor-python" in done.stderr and "is not a file" in done.stderr
