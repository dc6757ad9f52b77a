"""Shared test helpers: build tiny models from ONNX text, run the CLI in a subprocess."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper, parser

from npuprep.model_io import Model, fingerprint
from npuprep.runtime.session import make_session, run


def save_zoo(name: str, folder: Path, model_file: str = "m.onnx", data_dir: str = "data") -> tuple[Path, Path]:
    """A zoo model saved with its samples as a folder of .npz, as a user would have them."""
    import numpy as np

    from npuprep.examples.zoo import ZOO

    zoo = ZOO[name]()
    path = folder / model_file
    onnx.save(zoo.model, str(path))
    data = folder / data_dir
    data.mkdir()
    for i, feed in enumerate(zoo.samples):
        np.savez(data / f"sample_{i:03d}.npz", **feed)
    return path, data


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


def model_with_weights(tmp_path: Path, text: str, weights: dict[str, np.ndarray]) -> Model:
    """ONNX text with FP32 initialisers added, saved under tmp_path, as npuprep loads it."""
    proto = parser.parse_model(text)
    for name, value in weights.items():
        proto.graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), name))
    path = tmp_path / "model.onnx"
    onnx.save(proto, path)
    return Model(proto=proto, path=str(path), digest=fingerprint(proto))


# x -> MatMul(W) -> Relu -> MatMul(V) -> y
INT8_MLP = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4, 16] x) => (float[4, 8] y) {
    [mm1] h = MatMul (x, W)
    a = Relu (h)
    [mm2] y = MatMul (a, V)
}
"""


def int8_mlp(seed: int, samples: int = 8) -> tuple[Model, list[dict[str, np.ndarray]]]:
    """INT8_MLP with random weights (scale 0.4) and `samples` standard-normal inputs."""
    rng = np.random.default_rng(seed)
    proto = parser.parse_model(INT8_MLP)
    proto.graph.initializer.extend([
        numpy_helper.from_array((rng.standard_normal((16, 32)) * 0.4).astype(np.float32), "W"),
        numpy_helper.from_array((rng.standard_normal((32, 8)) * 0.4).astype(np.float32), "V")])
    feeds = [{"x": rng.standard_normal((4, 16)).astype(np.float32)} for _ in range(samples)]
    return Model(proto=proto, path="m.onnx", digest=fingerprint(proto)), feeds


def pooled_rel_l2(model: onnx.ModelProto, ref: onnx.ModelProto, feeds: list) -> float:
    """Rel L2 of `model`'s outputs against `ref`'s, pooled over every output and feed."""
    got, want = make_session(model), make_session(ref)
    err2 = ref2 = 0.0
    for f in feeds:
        a, b = run(got, f), run(want, f)
        err2 += sum(float(((a[k] - b[k]) ** 2).sum()) for k in b)
        ref2 += sum(float((b[k] ** 2).sum()) for k in b)
    return (err2 / ref2) ** 0.5


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real `npuprep` CLI as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "npuprep", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, timeout=600,
    )


@pytest.fixture
def opened_sessions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[frozenset[str] | None, ...]]:
    """(detailed, nan_checked, lean, prepack) of every calibration session opened in this process."""
    import npuprep.calibrate.run as calibrate_run

    calls: list[tuple[frozenset[str] | None, ...]] = []
    real_open = calibrate_run.Prepared.open

    def recording_open(self, threads, detailed, nan_checked=None, lean=(), prepack=True):  # noqa: ANN001, ANN202
        calls.append((*(None if s is None else frozenset(s) for s in (detailed, nan_checked, lean)), prepack))
        return real_open(self, threads, detailed, nan_checked, lean, prepack)

    monkeypatch.setattr(calibrate_run.Prepared, "open", recording_open)
    return calls


class _Column:
    """One column of the recorded (detailed, nan_checked, lean) sets, read when compared."""

    def __init__(self, rows: list, at: int) -> None:
        self.rows, self.at = rows, at

    def __getitem__(self, i: int) -> frozenset[str] | None:
        return self.rows[i][self.at]

    def __len__(self) -> int:
        return len(self.rows)

    def __eq__(self, other: object) -> bool:
        return [r[self.at] for r in self.rows] == other

    def clear(self) -> None:
        self.rows.clear()


@pytest.fixture
def opened_detailed(opened_sessions: list) -> _Column:
    """The `detailed` set of every calibration session opened, as it grows."""
    return _Column(opened_sessions, 0)


@pytest.fixture
def opened_nan_checked(opened_sessions: list) -> _Column:
    """The `nan_checked` set of every calibration session opened, as it grows."""
    return _Column(opened_sessions, 1)


@pytest.fixture
def opened_lean(opened_sessions: list) -> _Column:
    """The `lean` set (detailed tensors given the lean detail) of every session opened."""
    return _Column(opened_sessions, 2)


@pytest.fixture
def shown_progress(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[tuple[int, bool]]]:
    """What a calibration's progress bars showed: the counts they were set to, and each
    bar's (total, enabled)."""
    import npuprep.calibrate.run as calibrate_run

    shown: list[int] = []
    bars: list[tuple[int, bool]] = []

    @contextlib.contextmanager
    def recording_counter(total, description, enabled):  # noqa: ANN001, ANN202 - stands in for progress_counter
        bars.append((total, enabled))
        yield shown.append

    monkeypatch.setattr(calibrate_run, "progress_counter", recording_counter)
    return shown, bars


@pytest.fixture
def opened_prepacked(opened_sessions: list) -> _Column:
    """Whether each session opened was built with onnxruntime's prepacked weights."""
    return _Column(opened_sessions, 3)


def save_matmul_eye(save, tmp_path: Path, scale: float) -> tuple[Path, Path]:  # noqa: ANN001 - the save fixture
    """x [2,64] -> MatMul(x, W = scale * I) -> y, saved twice: W inline (inline.onnx) and W
    as external data (ext/m.onnx + ext/m.data). Returns (inline path, external path)."""
    import numpy as np

    proto = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 64])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 64])],
            [onnx.numpy_helper.from_array(np.eye(64, dtype=np.float32) * np.float32(scale), "w")],
        ),
        opset_imports=[onnx.helper.make_opsetid("", 18)],
    )
    inline = save(proto, "inline.onnx")  # first: saving as external data changes proto
    folder = tmp_path / "ext"
    folder.mkdir()
    onnx.save_model(proto, str(folder / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    return inline, folder / "m.onnx"


# x -> Mul(x, x) -> sq -> Sub(sq, x) -> y
SQUARES = """
<ir_version: 8, opset_import: ["" : 18]>
g (float[8,8] x) => (float[8,8] y) { sq = Mul(x, x)  y = Sub(sq, x) }
"""


def square_samples(tmp_path: Path, save, scales: list[float], seed: int) -> tuple:  # noqa: ANN001 - the save fixture
    """The SQUARES model, and a folder of .npz samples of x: standard normal times each scale.
    Returns (model, samples, folder)."""
    import numpy as np

    from npuprep.data import load_samples
    from npuprep.model_io import load_model

    model = load_model(save(SQUARES))
    rng = np.random.default_rng(seed)
    folder = tmp_path / "data"
    folder.mkdir()
    for i, scale in enumerate(scales):
        np.savez(folder / f"s{i:03d}.npz", x=(rng.standard_normal((8, 8)) * scale).astype(np.float32))
    return model, load_samples(folder, model.proto), folder


@pytest.fixture
def rknn_python() -> str:
    """The rknn-toolkit2 venv's python, or a skip saying how to build it."""
    from npuprep.vendors.rockchip import SETUP_HINT, vendor_python

    found = vendor_python()
    if found is None:
        pytest.skip(f"rknn-toolkit2 venv missing; {SETUP_HINT}")
    return str(found)


def external_mlp(folder: Path, rng: np.random.Generator, *, name: str = "m", width: int = 256,
                 batch: int = 4, scale: float = 0.1) -> tuple[onnx.ModelProto, str]:
    """The model (weights inline) and the path of its copy saved with external data."""
    # x[batch,width] -> MatMul(W1) -> Relu -> MatMul(W2) -> y, weights in <name>.onnx.data
    w1 = (rng.standard_normal((width, width)) * scale).astype(np.float32)
    w2 = (rng.standard_normal((width, width)) * scale).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
         helper.make_node("Relu", ["h"], ["r"], name="relu"),
         helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, width])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = Path(folder) / f"{name}.onnx"
    saved = onnx.ModelProto()
    saved.CopyFrom(model)  # onnx.save moves the weights of the proto it saves out to the file
    onnx.save(saved, str(path), save_as_external_data=True, location=f"{name}.onnx.data",
              size_threshold=1024)
    return model, str(path)


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray on 2 CPUs for the test module (its start-up takes seconds)."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'npuprep[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()
