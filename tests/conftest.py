"""Shared test helpers: build tiny models from ONNX text, run the CLI in a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import parser


def model_from_text(text: str) -> onnx.ModelProto:
    model = parser.parse_model(text)
    onnx.checker.check_model(model)
    return model


@pytest.fixture
def save(tmp_path: Path):
    """Save a ModelProto (or ONNX text) under tmp_path and return the path."""

    def _save(model: onnx.ModelProto | str, name: str = "model.onnx") -> Path:
        if isinstance(model, str):
            model = model_from_text(model)
        path = tmp_path / name
        onnx.save(model, str(path))
        return path

    return _save


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real `npuprep` CLI as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "npuprep", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, timeout=600,
    )
