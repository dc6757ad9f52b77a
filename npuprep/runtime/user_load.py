"""The model convert writes, loaded and run once as a user loads it: written to a file, then
`onnxruntime.InferenceSession(path)` with default `SessionOptions`, in a forked child.

npuprep's own sessions (session.py) run basic optimisations without the fusions that look
through Casts, so a model they verify can still fail where a user's session applies every
fusion (a type error at load, or a crash inside onnxruntime). The child keeps a crash from
ending the conversion: its signal becomes one line for the caller to act on.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import signal
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from npuprep.model_io import write_model_files

# One line of onnxruntime's message is enough to name the node and the reason.
_SAID_CHARS = 400


def onnxruntime_version() -> str:
    return ort.__version__


@dataclass(frozen=True)
class UserLoad:
    """How a default onnxruntime session took the model: `refused` None when it loaded (and ran
    on the sample), else one line: the stage and onnxruntime's error, or the signal that ended
    the process; `drift`, where asked: each float output's rel L2 between that session and one
    with basic optimisations (npuprep's own, which verified it) on the sample, so a fusion that
    computes another function shows (onnxruntime 1.32's ReluQuantRewrite drops a Relu before
    an FP8 QuantizeLinear, valid only for an integer zero point)."""

    refused: str | None
    drift: dict[str, float] = field(default_factory=dict)


def load_as_users_do(proto: onnx.ModelProto, feed: Mapping[str, np.ndarray] | None, *,
                     drift: bool = False) -> UserLoad:
    """`proto` written, loaded and run on `feed` (cast to the types its inputs declare) in a
    default onnxruntime session in a forked child; with `drift`, run too with basic
    optimisations and compared (UserLoad)."""
    context = mp.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=_load_and_run, args=(proto, dict(feed or {}), drift, writer),
                            daemon=True)
    child.start()
    writer.close()
    stage, said, drifted = "loading or running it", None, {}
    try:
        while True:
            kind, value = reader.recv()
            if kind == "stage":
                stage = value
            elif kind == "drift":
                drifted = value
            else:
                said = value
    except EOFError:  # the child has ended, or died mid-way
        pass
    finally:
        reader.close()
        child.join()
    if child.exitcode is not None and child.exitcode < 0:
        return UserLoad(f"onnxruntime crashed ({signal.Signals(-child.exitcode).name}) {stage}")
    return UserLoad(said, drifted if said is None else {})


def _load_and_run(proto: onnx.ModelProto, feed: dict[str, np.ndarray], drift: bool,
                  writer: Connection) -> None:
    # Each step is told before it starts, so a crash names the step it happened in; the
    # parent reports a crash, so a fault handler inherited from it (pytest's, a user's
    # PYTHONFAULTHANDLER) would only print a "Fatal Python error" that is not one.
    faulthandler.disable()
    stage = "writing it"
    # Its warnings (an initializer it drops) are the user's to see when they load it, not ours.
    ort.set_default_logger_severity(4)
    try:
        with tempfile.TemporaryDirectory(prefix="npuprep-user-load-") as folder:
            path = Path(folder) / "model.onnx"
            write_model_files(proto, path, Path(folder) / "model.onnx.data", "model.onnx.data")
            stage = "loading it"
            writer.send(("stage", stage))
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            declared = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
                        for i in proto.graph.input if i.type.HasField("tensor_type")}
            names = {i.name for i in session.get_inputs()}
            if feed and names <= set(feed):
                stage = "running it on one sample"
                writer.send(("stage", stage))
                typed = {n: np.asarray(feed[n]).astype(declared.get(n, np.asarray(feed[n]).dtype))
                         for n in names}
                outputs = [o.name for o in session.get_outputs()]
                got = session.run(outputs, typed)
                if drift:
                    stage = "running it with basic optimisations"
                    writer.send(("stage", stage))
                    basic = ort.SessionOptions()
                    basic.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
                    want = ort.InferenceSession(str(path), basic, providers=["CPUExecutionProvider"]
                                                ).run(outputs, typed)
                    writer.send(("drift", {name: _rel_l2(a, b) for name, a, b
                                           in zip(outputs, got, want, strict=True)
                                           if np.asarray(b).dtype.kind == "f" and np.asarray(b).size}))
        writer.send(("done", None))
    except Exception as exc:  # onnxruntime's refusal, said in one line
        text = " ".join(str(exc).split())
        writer.send(("done", f"{stage}: {text[:_SAID_CHARS]}"))
    finally:
        writer.close()


def _rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    diff = np.asarray(got, np.float64) - np.asarray(want, np.float64)
    return float(np.sqrt(np.sum(diff ** 2) / max(float(np.sum(np.asarray(want, np.float64) ** 2)), 1e-30)))
