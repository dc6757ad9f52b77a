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


def default_session_drift(proto: onnx.ModelProto, feed: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Each float output's rel L2 between a default onnxruntime session (every fusion on) and
    one with basic optimisations (npuprep's own, which verified it) on `feed`: a fusion that
    computes another function shows here (onnxruntime 1.32's ReluQuantRewrite drops a Relu
    before an FP8 QuantizeLinear, valid only for an integer zero point). Empty where either
    session fails (load_as_users_do says why)."""
    context = mp.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=_drift, args=(proto, dict(feed), writer), daemon=True)
    child.start()
    writer.close()
    try:
        drift = reader.recv()
    except EOFError:
        drift = {}
    finally:
        reader.close()
        child.join()
    return drift


def _drift(proto: onnx.ModelProto, feed: dict[str, np.ndarray], writer: Connection) -> None:
    ort.set_default_logger_severity(4)
    drift: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="npuprep-user-load-") as folder:
            path = Path(folder) / "model.onnx"
            write_model_files(proto, path, Path(folder) / "model.onnx.data", "model.onnx.data")
            basic = ort.SessionOptions()
            basic.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            outputs = []
            for options in (None, basic):
                session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                declared = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
                            for i in proto.graph.input if i.type.HasField("tensor_type")}
                names = [i.name for i in session.get_inputs()]
                got = session.run(None, {n: np.asarray(feed[n]).astype(
                    declared.get(n, np.asarray(feed[n]).dtype)) for n in names})
                outputs.append(dict(zip([o.name for o in session.get_outputs()], got, strict=True)))
            for name, value in outputs[1].items():
                want = np.asarray(value)
                if want.dtype.kind != "f" or not want.size:
                    continue
                diff = np.asarray(outputs[0][name], np.float64) - want
                drift[name] = float(np.sqrt(np.sum(diff ** 2) / max(np.sum(want.astype(np.float64) ** 2), 1e-30)))
    except Exception:  # noqa: BLE001 - a session that fails is load_as_users_do's to say
        drift = {}
    finally:
        writer.send(drift)
        writer.close()


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
