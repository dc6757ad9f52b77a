"""Who may import whom: rewriting never decides (no plan/), libraries never reach into cli/."""

from __future__ import annotations

import ast
from pathlib import Path

import npuprep

ROOT = Path(npuprep.__file__).parent


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_rewrite_never_imports_plan_and_no_library_module_imports_cli():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("cli/") or rel == "__main__.py":
            continue
        for module in _imports(path):
            if module.startswith("npuprep.cli") or (
                    rel.startswith("rewrite/") and module.startswith("npuprep.plan")):
                offenders.append(f"{rel} imports {module}")
    assert offenders == []


def test_the_check_sees_an_offending_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from npuprep.cli.common import dump_json\nimport npuprep.plan.plan\n")
    assert _imports(bad) == {"npuprep.cli.common", "npuprep.plan.plan"}
