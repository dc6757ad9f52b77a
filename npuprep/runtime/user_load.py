"""The model convert writes, loaded and run once as a user loads it: written to a file, then
`onnxruntime.InferenceSession(path)` with default `SessionOptions`, in a forked child.

npuprep's own sessions (session.py) run basic optimisations without the fusions that look
through Casts, so a model they verify can still fail where a user's session applies every
fusion (a type error at load, or a crash inside onnxruntime). The child keeps a crash from
ending the conversion: its signal becomes one line for the caller to act on.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import tempfile
from collections.abc import Mapping
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


def load_as_users_do(proto: onnx.ModelProto, feed: Mapping[str, np.ndarray] | None) -> str | None:
    """None when `proto` loads (and runs on `feed`, cast to the types its inputs declare) in a
    default onnxruntime session; else one line: the stage and onnxruntime's error, or the
    signal that ended the process."""
    context = mp.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=_load_and_run, args=(proto, dict(feed or {}), writer), daemon=True)
    child.start()
    writer.close()
    stage, said = "loading or running it", None
    try:
        while True:
            kind, text = reader.recv()
            if kind == "stage":
                stage = text
            else:
                said = text
    except EOFError:  # the child has ended, or died mid-way
        pass
    finally:
        reader.close()
        child.join()
    if child.exitcode is not None and child.exitcode < 0:
        return f"onnxruntime crashed ({signal.Signals(-child.exitcode).name}) {stage}"
    return said


def _load_and_run(proto: onnx.ModelProto, feed: dict[str, np.ndarray], writer: Connection) -> None:
    # Each step is told before it starts, so a crash names the step it happened in.
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
                session.run(None, {n: np.asarray(feed[n]).astype(declared.get(n, np.asarray(feed[n]).dtype))
                                   for n in names})
        writer.send(("done", None))
    except Exception as exc:  # onnxruntime's refusal, said in one line
        text = " ".join(str(exc).split())
        writer.send(("done", f"{stage}: {text[:_SAID_CHARS]}"))
    finally:
        writer.close()
