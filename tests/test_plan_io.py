"""plan.yaml round trip, user edits, and one-line rejections naming the key path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from npuprep.errors import NpuprepError
from npuprep.model_io import load_model
from npuprep.plan import (
    Clamp,
    Declined,
    FindingRef,
    Hazard,
    PinFp32,
    Plan,
    Rescale,
    SoftmaxShift,
    Unpinnable,
    load_plan,
    save_plan,
)
from npuprep.plan.plan import dump_plan

# x -> MatMul(W) -> h -> Relu -> r -> Exp -> e -> Div(e, d) -> y ; d = ReduceSum(e)
TEXT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 4] x) => (float[2, 4] y, float[2, 4] r) <float[4, 4] W = {1.0,0.0,0.0,0.0,0.0,1.0,0.0,0.0,0.0,0.0,1.0,0.0,0.0,0.0,0.0,1.0}, int64[1] ax = {1}> {
    [mm] h = MatMul (x, W)
    [relu] r = Relu (h)
    [exp] e = Exp (r)
    [sum] d = ReduceSum <keepdims = 1> (e, ax)
    [div] y = Div (e, d)
}
"""


@pytest.fixture
def model(save):
    return load_model(save(TEXT))


def sample_plan(fingerprint: str) -> Plan:
    return Plan(
        fingerprint=fingerprint,
        target="orin",
        precision="fp16",
        actions=(
            Rescale(entry="mm", k=7, domain={"h": -7, "r": -7}, absorbers=("r",),
                    findings=(FindingRef("range.overflow", "mm", "h"),), absmax=3.0e6,
                    limit=32752.0, absmax_after=23437.5, why="exact and free: weights x 2^-7"),
            Clamp(tensor="r", lo=None, hi=10.397, kind="exp", consumers=("exp",),
                  findings=(FindingRef("hazard.exp", "exp", ""),),
                  measured={"absmax": 12.5, "share_clipped": 0.25}, why="pin impossible: 'none'"),
            PinFp32(nodes=("exp", "sum", "div"), exit_tensors=("y",),
                    findings=(FindingRef("range.overflow", "exp", "e"),),
                    measured={"absmax": 2.7e5, "exit_absmax": 1.0}, request=True,
                    why="rescale declined: Exp does not commute"),
            SoftmaxShift(exp="exp", covers=("e", "d", "y"), fp32_shift=True,
                     findings=(FindingRef("pattern.softmax", "exp", "e"),),
                     measured={"input_absmax": 40.0}, why="subtract the row maximum: exact"),
        ),
        declined=(Declined("rescale", "e", "Exp node exp does not commute with scaling",
                           (FindingRef("range.overflow", "exp", "e"),)),),
        forbid_pin=("relu",),
        notes=("hazard.square at q: measured absmax 3 is within the limit; no action",
               "a note a user wrote\nover two lines, with 'quotes' and # a hash"),
        unpinnable=(Unpinnable(Hazard.COARSE_PHASE, "r", ("relu", "exp"),
                               "exp reads phase r up to 1000 rad: only an FP32 pin could fix it"),),
    )


def write(tmp_path: Path, data: dict, name: str = "plan.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def test_round_trip_is_equal_and_byte_identical(model, tmp_path):
    plan = sample_plan(model.fingerprint)
    path = save_plan(plan, tmp_path / "plan.yaml")
    loaded = load_plan(path, model)
    assert loaded == plan
    assert loaded.pinned_nodes() == {"exp", "sum", "div"}
    again = save_plan(loaded, tmp_path / "again.yaml")
    assert path.read_bytes() == again.read_bytes()


def test_yaml_is_readable_with_comments(model):
    text = dump_plan(sample_plan(model.fingerprint))
    assert "k: 7  # scale = 2^-7 = 0.0078125" in text
    assert "# 1. rescale mm by 2^-7 (range.overflow at h)" in text
    assert "# 3. request FP32: 3 node(s) (range.overflow at e)" in text
    assert "consumers:\n      - exp" in text


def test_user_edits_are_accepted(model, tmp_path):
    data = sample_plan(model.fingerprint).to_dict()
    # A physical bound on an output, a forced pin written by hand (no exits), a forbidden node.
    data["actions"].append({"action": "clamp", "tensor": "y", "lo": 0, "hi": 1, "kind": "user",
                            "why": "probabilities"})
    data["actions"].append({"action": "pin_fp32", "nodes": ["mm"], "forced": True})
    data["forbid_pin"] = ["relu", "sum"]
    plan = load_plan(write(tmp_path, data), model)
    user_clamp = plan.clamps()[-1]
    assert (user_clamp.tensor, user_clamp.lo, user_clamp.hi, user_clamp.consumers) == ("y", 0.0, 1.0, ())
    forced = plan.pins()[-1]
    assert forced.forced and forced.exit_tensors == ("h",)
    # A forbidden node drops out of the planner's island; forced pins stay.
    assert plan.pinned_nodes() == {"exp", "div", "mm"}


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda d: d.update(colour="red"), "colour"),
        (lambda d: d["actions"][0].update(k="7"), "actions[0].k"),
        (lambda d: d["actions"][0].update(k=0), "actions[0].k"),
        (lambda d: d["actions"][0].update(entry="nope"), "actions[0].entry"),
        (lambda d: d["actions"][0]["domain"].update(ghost=1), "actions[0].domain.ghost"),
        (lambda d: d["actions"][1].update(kind="cubic"), "actions[1].kind"),
        (lambda d: d["actions"][1].update(lo=20.0), "actions[1].lo"),
        (lambda d: d["actions"][1].update(consumers=["div"]), "actions[1].consumers[0]"),
        (lambda d: d["actions"][1].update(speed=3), "actions[1].speed"),
        (lambda d: d["actions"][2].update(nodes=["exp", "ghost"]), "actions[2].nodes[1]"),
        (lambda d: d["actions"][2].update(forced="yes"), "actions[2].forced"),
        (lambda d: d["actions"][2].update(action="teleport"), "actions[2].action"),
        (lambda d: d["actions"][2]["findings"][0].pop("rule"), "actions[2].findings[0].rule"),
        (lambda d: d["declined"][0].update(remedy="magic"), "declined[0].remedy"),
        (lambda d: d["actions"][3].update(exp="ghost"), "actions[3].exp"),
        (lambda d: d["actions"][3].update(fp32_shift="yes"), "actions[3].fp32_shift"),
        (lambda d: d["actions"][3].update(covers=["e", "ghost"]), "actions[3].covers[1]"),
        (lambda d: d["unpinnable"][0].update(hazard="magic"), "unpinnable[0].hazard"),
        (lambda d: d["unpinnable"][0].update(tensor="ghost"), "unpinnable[0].tensor"),
        (lambda d: d["unpinnable"][0].update(nodes=["relu", "ghost"]), "unpinnable[0].nodes[1]"),
        (lambda d: d["unpinnable"][0].pop("why"), "unpinnable[0].why"),
        (lambda d: d.update(forbid_pin="relu"), "forbid_pin"),
        (lambda d: d.update(precision="fp12"), "precision"),
        (lambda d: d.update(fingerprint="0123456789abcdef"), "fingerprint"),
        (lambda d: d.pop("target"), "target"),
        (lambda d: d["actions"][2].update(forced=True) or d.update(forbid_pin=["div"]), "forbid_pin[0]"),
    ],
)
def test_malformed_plans_fail_in_one_line_naming_the_key(model, tmp_path, edit, key):
    data = sample_plan(model.fingerprint).to_dict()
    edit(data)
    path = write(tmp_path, data)
    with pytest.raises(NpuprepError) as err:
        load_plan(path, model)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: key '{key}':"), message
    assert err.value.exit_code == 2


def test_syntax_errors_and_missing_files_name_the_file(model, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actions: [\n", encoding="utf-8")
    with pytest.raises(NpuprepError, match=r"bad.yaml: line \d+: YAML syntax error"):
        load_plan(bad, model)
    with pytest.raises(NpuprepError, match="plan file not found"):
        load_plan(tmp_path / "missing.yaml", model)
    empty = tmp_path / "empty.yaml"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(NpuprepError, match="empty plan"):
        load_plan(empty, model)


def test_save_replaces_an_old_file_and_leaves_no_temporaries(model, tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("old", encoding="utf-8")
    save_plan(sample_plan(model.fingerprint), path)
    assert load_plan(path, model) == sample_plan(model.fingerprint)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "plan.yaml"]


def test_a_plan_written_with_the_softmax_shifts_old_action_name_still_loads(model, tmp_path):
    data = sample_plan(model.fingerprint).to_dict()
    shifts = [a for a in data["actions"] if a["action"] == "softmax_shift"]
    assert shifts, "the sample plan holds a softmax shift"
    for a in shifts:
        a["action"] = "shift_max"
    plan = load_plan(write(tmp_path, data), model)
    assert plan == sample_plan(model.fingerprint)
