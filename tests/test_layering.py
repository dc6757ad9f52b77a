"""Who may import whom: floors from the ground up, no circles, rewriting never decides.

Every import counts, at the top of a module or inside a function: a deferred import is still
a dependency a reader must follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import npuprep

ROOT = Path(npuprep.__file__).parent
README = ROOT.parent / "README.md"

# Low to high; a unit may import its own floor and those below it, never one above.
FLOORS: tuple[frozenset[str], ...] = tuple(frozenset(f.split()) for f in (
    "errors numerics detections names formatting yaml_io json_io progress provenance profile_names ops scale_rules "
    "graph bf16 vendors resources flops npuprep",
    "model_io fp16_source output_files data holdout held_out_bound profiles opsets sample_size",
    "runtime",
    "calibrate",
    "analyse",
    "rewrite",
    "plan",
    "report",
    "crosscheck",
    "verify",
    "probe",
    "ledger",
    "pipeline",
    "convert",
    "cli __main__",
))


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def _module_names(root: Path) -> dict[str, Path]:
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _edges(root: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports (a name imported from a module counts as
    that module unless it is a submodule itself)."""
    modules = _module_names(root)
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        edges[name] = targets
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _floor(module: str) -> int:
    unit = _unit(module)
    return next(i for i, units in enumerate(FLOORS) if unit in units)


def _upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} imports {b}" for a, targets in edges.items() for b in targets
                  if _unit(a) != _unit(b) and _floor(b) > _floor(a))


def test_every_unit_of_the_package_has_a_floor():
    units = {_unit(m) for m in _module_names(ROOT)} - {"npuprep"}
    assert units <= set().union(*FLOORS), units - set().union(*FLOORS)


def test_no_import_circle_in_the_package():
    assert _circles(_edges(ROOT)) == []


def test_no_import_runs_back_up_a_floor():
    assert _upward(_edges(ROOT)) == []


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


def test_the_checks_see_a_circle_and_an_import_back_up(tmp_path):
    # a.py -> b.py -> a.py (a circle); verify/x.py -> cli/y.py (back up)
    pkg = tmp_path / "npuprep"
    (pkg / "verify").mkdir(parents=True)
    (pkg / "cli").mkdir()
    for init in (pkg, pkg / "verify", pkg / "cli"):
        (init / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("import npuprep.numerics\n")
    (pkg / "numerics.py").write_text("from npuprep.errors import NpuprepError\n")
    (pkg / "verify" / "x.py").write_text("def f():\n    from npuprep.cli.y import g\n")
    (pkg / "cli" / "y.py").write_text("from npuprep.verify import x\n")
    edges = _edges(pkg)
    assert ["npuprep.errors", "npuprep.numerics"] in _circles(edges)
    assert _upward(edges) == ["npuprep.verify.x imports npuprep.cli.y"]


def test_the_readme_map_names_every_module_and_folder():
    text = README.read_text(encoding="utf-8")
    start = text.index("## Where things live")
    section = text[start:text.index("\n## ", start + 1)]
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if path.name in ("__init__.py", "__main__.py"):
            continue
        if f"{path.name}`" not in section:
            missing.append(rel.as_posix())
    for folder in sorted(p for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"):
        if f"{folder.name}/" not in section:
            missing.append(f"{folder.name}/")
    assert missing == []


def test_no_module_is_over_800_lines():
    long = {p.relative_to(ROOT).as_posix(): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 800}
    assert long == {}


# Parameters annotated plainly `Any` in the package (236 before issue 36): typing lowers it,
# nothing may raise it. Lower this number when you type more.
MAX_ANY_PARAMETERS = 116


def _any_parameters(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                    if arg is not None and arg.annotation is not None \
                            and ast.unparse(arg.annotation) == "Any":
                        found.append(f"{path.relative_to(root).as_posix()}:{node.name}({arg.arg})")
    return found


def test_parameters_typed_any_do_not_grow():
    found = _any_parameters(ROOT)
    assert len(found) <= MAX_ANY_PARAMETERS, f"{len(found)} > {MAX_ANY_PARAMETERS}: {found}"


def _op_sets_outside_ops(root: Path) -> list[str]:
    """Module-level sets of op names that restate ops.py's MAC or layout table."""
    from npuprep.ops import LAYOUT_OPS, MAC_OPS

    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "ops.py":
            continue
        for stmt in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(stmt, ast.Assign | ast.AnnAssign) or stmt.value is None:
                continue
            # The value itself, frozenset(...)'s argument, the operands of a union; not a
            # mapping's values (crosscheck/rknn.py: the vendor's own layer types).
            todo, names = [stmt.value], set()
            while todo:
                node = todo.pop()
                if isinstance(node, ast.Set | ast.Tuple | ast.List):
                    names |= {e.value for e in node.elts if isinstance(e, ast.Constant)}
                elif isinstance(node, ast.Call):
                    todo.extend(node.args)
                elif isinstance(node, ast.BinOp):
                    todo.extend((node.left, node.right))
            if len(names & MAC_OPS) >= 3 or len(names & LAYOUT_OPS) >= 4:
                found.append(f"{path.relative_to(root).as_posix()}:{stmt.lineno}")
    return found


def test_op_tables_are_stated_once_in_ops_py():
    assert _op_sets_outside_ops(ROOT) == []


def test_the_checks_see_an_any_parameter_and_a_restated_op_table(tmp_path):
    # f(x: Any), g(y: list[Any]) (only the first counts); a module-level MAC set, a layout tuple
    pkg = tmp_path / "npuprep"
    pkg.mkdir()
    (pkg / "a.py").write_text("from typing import Any\ndef f(x: Any, y: list[Any]) -> Any: ...\n")
    (pkg / "b.py").write_text('MACS = frozenset({"Conv", "MatMul", "Gemm"})\n'
                              'VIEWS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")\n'
                              'RKNN = {"Conv": {"Conv", "MatMul", "Gemm"}}\n')
    assert _any_parameters(pkg) == ["a.py:f(x)"]
    assert _op_sets_outside_ops(pkg) == ["b.py:1", "b.py:2"]


def test_only_the_openvino_vendor_module_imports_openvino():
    # OpenVINO is an optional extra: one module imports it, so every other one loads without it.
    importers = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
                       if any(m.split(".")[0] == "openvino" for m in _imports(p)))
    assert importers == ["vendors/openvino.py"]
