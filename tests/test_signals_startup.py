"""Issue 30, a signal in the first milliseconds: the console script imports nothing before
npuprep.cli.start holds SIGINT and SIGTERM (pip's generated wrapper imported `re` first, ~10 ms
in which Ctrl-C was a traceback; bench/bench_signal_startup.py measures the rest, Python's own
start-up)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "npuprep"

# Runs the console script as Python would, recording the modules loaded by the time the
# SIGINT handler is set (the first thing npuprep.cli.start does).
SPY = """
import json, sys, _signal
before = set(sys.modules)
real, seen = _signal.signal, []
def spy(sig, handler):
    if sig == _signal.SIGINT and not seen:
        seen.append(sorted(set(sys.modules) - before))
    return real(sig, handler)
_signal.signal = spy
sys.argv = ["npuprep", "--version"]
try:
    exec(compile(open(sys.argv_path).read(), sys.argv_path, "exec"), {"__name__": "__main__"})
except SystemExit:
    pass
print(json.dumps(seen))
"""


def test_the_console_script_holds_signals_before_any_other_import() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["script-files"] == ["scripts/npuprep"]
    assert "npuprep" not in project["project"].get("scripts", {})
    code = SPY.replace("sys.argv_path", repr(str(SCRIPT)))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("npuprep ")
    (loaded,) = json.loads(done.stdout.splitlines()[-1])
    assert set(loaded) <= {"npuprep", "npuprep.cli", "npuprep.cli.start"}, loaded
