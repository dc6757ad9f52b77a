"""The bundled example: a diffusion trajectory planner whose naive FP16 overflows, with samples."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def example_model_path() -> Path:
    """The committed planner.onnx (inside the installed package or the checkout's examples/)."""
    return _HERE / "planner.onnx"


def example_data_dir() -> Path:
    """Folder of the committed calibration samples (sample_000.npz, ...)."""
    return _HERE / "data"
