"""The README's Python API runs as written, on the bundled example (model and samples swapped in).

README.md ```python block -> example paths -> python in a scratch folder -> exit 0, files written
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _snippet() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Python API"):text.index("## Where things live")]
    code = section[section.index("```python") + len("```python"):]
    return code[:code.index("```")]


def test_the_readme_python_api_runs_on_the_example(tmp_path):
    code = _snippet().replace('"model.onnx"', repr(str(ROOT / "examples" / "planner.onnx")))
    code = code.replace('"samples/"', repr(str(ROOT / "examples" / "data")))
    script = tmp_path / "api.py"
    script.write_text(code, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PASSED" in proc.stdout  # the int8 conversion's typed verdict
    assert (tmp_path / "model.a2000.onnx").stat().st_size > 0
    assert (tmp_path / "model.a2000.report.json").stat().st_size > 0
