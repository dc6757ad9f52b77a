"""Issue 30, what the broad sweep (bench/bench_bad_inputs.py) found unclean: each case is one
line, exit 2, and leaves the folder as it was."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from npuprep.examples import example_model_path
from tests.conftest import run_cli


def _relu(path: Path, opset: int = 17) -> Path:
    # x -> Relu -> y
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    return path


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "says"), [
    (["check", "new.onnx", "-t", "generic"], "declares opset 30; npuprep supports opsets 7 to"),
    (["check", "m.onnx", "-t", "generic", "--synthetic", "0"], "--synthetic: expected an integer >= 1"),
    (["check", "m.onnx", "-t", "generic", "--synthetic", "1", "--input-range", "x:1"], "--input-range:"),
    (["convert", "m.onnx", "-t", "generic", "--synthetic", "1", "-o", "a" * 251 + ".onnx"],
     "too long for the file system"),
])
def test_a_mistake_the_sweep_found_is_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    _relu(tmp_path / "m.onnx")
    _relu(tmp_path / "new.onnx", opset=30)
    before = _files(tmp_path)
    assert says in _one_line(run_cli(*args, cwd=tmp_path))
    assert _files(tmp_path) == before


def test_a_full_disk_while_writing_a_probe_kit_names_the_kit(tmp_path: Path) -> None:
    # Writes past 2 KB fail (EFBIG), as they would on a full disk; the kit's model is larger.
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

    proc = subprocess.run([sys.executable, "-m", "npuprep", "probe", str(example_model_path()), "-t", "generic",
                           "--export-kit", "K"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          preexec_fn=limit)
    line = _one_line(proc)
    assert line.startswith("npuprep: error: K: cannot write the kit (File too large)") and ".tmp" not in line
    assert list(tmp_path.iterdir()) == []
