"""plan.yaml through the CLI: `convert --plan-only` writes it, `convert --plan` refuses a bad one."""

from __future__ import annotations

import yaml
from conftest import run_cli

from npuprep.examples import example_model_path
from npuprep.model_io import load_model
from npuprep.plan import load_plan


def test_plan_only_writes_a_loadable_plan_and_a_bad_edit_exits_2(tmp_path):
    # The bundled example planner with its bundled samples (the command's defaults).
    first = run_cli("convert", "--target", "orin", "--plan-only", "-o", "plan.yaml", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    plan = load_plan(tmp_path / "plan.yaml", load_model(example_model_path()))
    # The planner's softmax attention is shifted, not pinned: only the elementwise logits
    # and the shift itself run in FP32, no matmul.
    model = load_model(example_model_path())
    ops = {n.name: n.op_type for n in model.graph.node}
    assert plan.target == "orin" and plan.shifts() and plan.shifts()[0].fp32_shift
    assert {ops[n] for n in plan.pinned_nodes()} == {"Add"}
    again = run_cli("convert", "--target", "orin", "--plan-only", "-o", "again.yaml", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "plan.yaml").read_bytes() == (tmp_path / "again.yaml").read_bytes()

    data = yaml.safe_load((tmp_path / "plan.yaml").read_text(encoding="utf-8"))
    i = next(i for i, a in enumerate(data["actions"]) if a["action"] == "softmax_shift")
    data["actions"][i]["exp"] = "no_such_node"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    bad = run_cli("convert", "--target", "orin", "--plan", "bad.yaml", "-o", "out.onnx", cwd=tmp_path)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1
    assert f"bad.yaml: key 'actions[{i}].exp': node 'no_such_node' is not in the model" in lines[0]
    assert not (tmp_path / "out.onnx").exists()
