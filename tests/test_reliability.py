"""Issue 30's classes, run as a user would: each ends in one line (exit 2 for the input's
fault, exit 1 naming a bug) or works, and leaves every file that was there byte-identical."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from npuprep.examples import example_data_dir, example_model_path
from tests.conftest import run_cli


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_the_bundled_example_converts_with_synthetic_samples(tmp_path: Path) -> None:
    # A pinned LayerNorm behind an FP16 layer used to make onnxruntime refuse the emulation.
    for n in ("1", "4"):
        done = run_cli("convert", "--synthetic", n, "-t", "generic", "-o", f"ex{n}.onnx", cwd=tmp_path)
        assert done.returncode in (0, 1) and "Traceback" not in done.stderr, done.stderr
        assert "cannot load" not in done.stderr and (tmp_path / f"ex{n}.report.md").is_file()


def test_an_unexpected_exception_is_one_bug_line_with_the_details_in_a_file(tmp_path: Path) -> None:
    code = ("import sys\n"
            "import npuprep.cli.check as c\n"
            "def boom(args):\n    raise ValueError(\"'b' is not in list\")\n"
            "c.run = boom\n"
            "from npuprep.cli.main import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", code, "check", "m.onnx", "-t", "generic"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    line = _one_line(proc)
    assert proc.returncode == 1 and "this is a bug, please report" in line and "ValueError" in line
    details = Path(line.rsplit("details in ", 1)[1])
    try:
        assert "Traceback" in details.read_text() and "boom" in details.read_text()
    finally:
        details.unlink()


def test_a_trailing_slash_names_a_folder_the_files_go_in(tmp_path: Path) -> None:
    data = tmp_path / "D"
    shutil.copytree(example_data_dir(), data)
    before = _files(tmp_path)
    done = run_cli("convert", example_model_path(), "-t", "generic", "--data", "D", "-o", "out/",
                   "--html", "pages/", "--report-json", "json/", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    made = set(_files(tmp_path)) - set(before)
    assert {"out/planner.generic.onnx", "out/planner.generic.report.md", "pages/planner.generic.report.html",
            "json/planner.generic.report.json"} <= made
    assert not (tmp_path / "out").is_file() and {k: v for k, v in _files(tmp_path).items() if k in before} == before
    plan = run_cli("convert", example_model_path(), "-t", "generic", "--data", "D", "--plan-only", "-o",
                   "plans/", cwd=tmp_path)
    assert plan.returncode == 0 and (tmp_path / "plans" / "planner.generic.draft.plan.yaml").is_file()
    # A model written among the samples would be read as one next time.
    line = _one_line(run_cli("convert", example_model_path(), "-t", "generic", "--data", "D", "-o",
                             "D/model.npz", cwd=tmp_path))
    assert "D/model.npz" in line and "*.npz" in line and sorted(p.name for p in data.iterdir()) == sorted(
        p.name for p in example_data_dir().iterdir())


@pytest.mark.parametrize(("sig", "code", "says"), [(signal.SIGINT, 130, "npuprep: interrupted"),
                                                   (signal.SIGTERM, 143, "npuprep: terminated")])
def test_a_signal_while_the_command_loads_is_one_line(tmp_path: Path, sig: int, code: int, says: str) -> None:
    # Sent from the entry point's first line, then again while the compiled modules load.
    shutil.copy(example_model_path(), tmp_path / "m.onnx")
    script = ("import os, sys\n"
              "import npuprep.cli.start as start\n"
              f"os.kill(os.getpid(), {int(sig)})\n"
              "import npuprep.cli.main as main\n"
              "load = main._load_compiled\n"
              f"main._load_compiled = lambda: (os.kill(os.getpid(), {int(sig)}), load())\n"
              "sys.argv = ['npuprep', 'check', 'm.onnx', '-t', 'generic', '--html', 'c.html']\n"
              "start.entry()\n")
    before = _files(tmp_path)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode == code and _one_line(proc) == says
    assert _files(tmp_path) == before


def _save(tmp_path: Path, name: str, nodes: list, outputs: list, *, opset: int = 17, ir: int = 8,
          graph_name: str = "g", inits: tuple = ()) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    model = helper.make_model(helper.make_graph(nodes, graph_name, [x], outputs, list(inits)),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir
    onnx.save(model, tmp_path / name)
    return tmp_path / name


def _out(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 4])


def test_odd_but_valid_models_convert_and_an_ambiguous_one_is_refused(tmp_path: Path) -> None:
    relu = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    # x -> Relu -> y, in a graph without a name, and at opset 7 / IR 3 (constants npuprep adds
    # are not graph inputs there)
    for path in (_save(tmp_path, "noname.onnx", relu, [_out("y")], graph_name=""),
                 _save(tmp_path, "ir3.onnx", relu, [_out("y")], opset=7, ir=3)):
        done = run_cli("convert", path, "-t", "generic", "--synthetic", "2", "-o", path.with_suffix(".out.onnx"),
                       cwd=tmp_path)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    # x -> Relu -> b, listed twice as a graph output
    twice = _save(tmp_path, "twice.onnx", [helper.make_node("Relu", ["x"], ["b"])], [_out("b"), _out("b")])
    before = _files(tmp_path)
    for command in (["check", twice, "-t", "generic"], ["convert", twice, "-t", "generic", "--synthetic", "1"]):
        proc = run_cli(*command, cwd=tmp_path)
        assert proc.returncode == 2 and "graph output 'b' is listed twice" in _one_line(proc)
    assert _files(tmp_path) == before


def test_an_inf_inside_the_model_fails_with_its_reason(tmp_path: Path) -> None:
    # x -> Add(inf) -> y: FP32 itself is Inf, so no conversion error is defined
    inf = helper.make_tensor("inf", TensorProto.FLOAT, [1], [float("inf")])
    path = _save(tmp_path, "inf.onnx", [helper.make_node("Add", ["x", "inf"], ["y"])], [_out("y")], inits=(inf,))
    done = run_cli("convert", path, "-t", "generic", "--synthetic", "2", cwd=tmp_path)
    assert done.returncode == 1 and "RuntimeWarning" not in done.stderr, done.stderr
    # With 2 samples, one is held out by default: the count is that of the samples checked.
    assert re.search(r"FAILED: the FP32 model itself gives \d+ Inf/NaN in 'y'", " ".join(done.stdout.split()))


def test_a_precision_the_target_lists_unsupported_is_refused(tmp_path: Path) -> None:
    proc = run_cli("convert", example_model_path(), "-t", "a2000", "--precision", "bf16", "--synthetic", "1",
                   cwd=tmp_path)
    assert proc.returncode == 2 and "target 'a2000' lists bf16 as unsupported" in _one_line(proc)
    assert list(tmp_path.iterdir()) == []


def test_a_vendor_python_that_is_not_the_toolkits_is_refused(tmp_path: Path) -> None:
    # x -> Relu -> y
    path = _save(tmp_path, "m.onnx", [helper.make_node("Relu", ["x"], ["y"], name="relu")], [_out("y")])
    garbage = tmp_path / "garbage.sh"
    garbage.write_text("#!/bin/sh\necho garbage\n")
    garbage.chmod(0o755)
    before = _files(tmp_path)
    for python in ("/bin/false", sys.executable, "./garbage.sh"):
        proc = run_cli("convert", path, "-t", "rk3588", "--synthetic", "1", "--verify-with", "rknn",
                       "--vendor-python", python, cwd=tmp_path)
        assert proc.returncode == 2 and "this is not an rknn-toolkit2 python" in _one_line(proc), proc.stderr
    assert f"{tmp_path}/garbage.sh" in proc.stderr  # relative to where the command ran
    assert _files(tmp_path) == before


def test_an_output_name_too_long_for_the_file_system_is_refused_before_any_work(tmp_path: Path) -> None:
    path = _save(tmp_path, "m.onnx", [helper.make_node("Relu", ["x"], ["y"], name="relu")], [_out("y")])
    before = _files(tmp_path)
    proc = run_cli("convert", path, "-t", "generic", "--synthetic", "1", "-o", "a" * 240 + ".onnx", cwd=tmp_path)
    assert proc.returncode == 2 and "too long for the file system" in _one_line(proc)
    assert _files(tmp_path) == before
