"""onnxruntime sessions: created from a proto (or a path for >2 GB models) and run on feeds."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from npuprep.bf16 import has_bf16, widen_array, widen_bf16
from npuprep.errors import InternalError, NpuprepError
from npuprep.graph import copy_fields, tensor_nbytes
from npuprep.model_io import external_array
from npuprep.names import shown

# onnxruntime's layer-norm fusions match a decomposed LayerNorm through a Cast at its input
# and keep the Cast's input: an FP32 norm fed by a rounded (FP16) tensor becomes one
# LayerNormalization with an FP16 input and FP32 weights, which fails to load ("bound to
# different types", 1.32), and a model loaded that way would skip the rounding emulation
# measures. Pinned norms behind FP16 layers are common, so no session fuses them.
CAST_BLIND_FUSIONS = ("LayerNormFusionL1", "LayerNormFusionL2", "SimplifiedLayerNormFusion")


def session_options(*, threads: int | None = None, optimize: bool | str = True) -> ort.SessionOptions:
    """`optimize`: True (basic), False (none) or "all" (every fusion, for measured speed)."""
    opts = ort.SessionOptions()
    # Fatal only: a refusal to load reaches the user as one line (_load_errors), not also as
    # onnxruntime's own log line before it.
    opts.log_severity_level = 4
    if optimize == "all":
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    else:
        opts.graph_optimization_level = (
            ort.GraphOptimizationLevel.ORT_ENABLE_BASIC if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        )
    if threads:
        opts.intra_op_num_threads = threads
    # The ready node of lowest index runs next (proto order): the rounding and widening
    # chains npuprep places right before a weight's reader then hold one weight's copy at a
    # time, where onnxruntime's default order ran every such chain first.
    opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    return opts


def make_session(
    model: onnx.ModelProto | bytes | str | Path,
    *,
    threads: int | None = None,
    optimize: bool | str = True,
    prepack: bool = True,
    produced: str | None = None,
    lean: bool = False,
    source: str | None = None,
) -> ort.InferenceSession:
    """A CPU session. A proto's large initialisers reach onnxruntime as arrays beside a
    weightless serialised graph (split_weights): no copy of the weights is ever serialised,
    and a model past protobuf's 2 GiB loads like any other.

    `bytes` is an already serialised model, a path a model file (its external data read by
    onnxruntime). A proto holding BF16 is widened to FP32 exactly first (npuprep.bf16).
    `prepack=False`: no prepacked copy of the weights (less memory, slower MatMuls).
    `produced`: what npuprep made this model from the user's (an emulation, the lowered
    model); a refusal to load it is npuprep's bug (InternalError), not the input's fault.
    """
    opts = session_options(threads=threads, optimize=optimize)
    if not prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    if lean:
        _lean(opts)
    if isinstance(model, bytes | str | Path):
        with _load_errors(produced, source):
            return _cpu_session(model if isinstance(model, bytes) else str(model), opts)
    if has_bf16(model):
        model = widen_bf16(model)
    skeleton, weights = split_weights(model)
    folder = _read_in_place(skeleton, weights)
    if folder is not None:
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", folder)
    values = [ort_value(w) for w in weights.values()]
    if weights:
        opts.add_external_initializers(list(weights), values)
    with _load_errors(produced, source):
        session = _cpu_session(skeleton.SerializeToString(), opts)
    # onnxruntime reads the arrays in place: they live as long as the session.
    session._npuprep_weights = (values, weights)  # type: ignore[attr-defined]
    return session


def _lean(opts: ort.SessionOptions) -> None:
    """No memory pattern and no arena, buffers served by malloc's heap instead.

    Measured on calibration graphs: the memory pattern cost ~80 MB of peak and no speed,
    the arena ~60 MB (it keeps the detail branches' buffers) and no speed once malloc
    serves large buffers from its heap (see _reuse_freed_buffers). Worker threads keep
    onnxruntime's default spinning: without it, waking them for each of the many small
    kernels made a 2-thread session 1.6x slower (transformer, 2 cores)."""
    opts.enable_mem_pattern = False
    opts.enable_cpu_mem_arena = False
    _reuse_freed_buffers()


def _read_in_place(skeleton: onnx.ModelProto, weights: dict[str, np.ndarray]) -> str | None:
    """Point the skeleton's anchored tensors (npuprep.model_io.anchored) at the one folder
    onnxruntime will read them from, which it maps instead of copying (a session holds no
    private copy of the user's weights); anchored tensors in any other folder are read into
    `weights`. Returns that folder, or None when no tensor is anchored."""
    from npuprep.graph import is_anchored, read_in, tensor_nbytes, to_array

    for tensor in _node_tensors(skeleton.graph.node):
        if is_anchored(tensor):
            tensor.CopyFrom(read_in(tensor))  # a body's constant: not a main-graph initialiser
    anchored = [t for t in skeleton.graph.initializer if is_anchored(t)]
    if not anchored:
        return None
    sizes: dict[str, int] = {}
    for tensor in anchored:
        home = _location(tensor).parent
        sizes[str(home)] = sizes.get(str(home), 0) + tensor_nbytes(tensor)
    folder = max(sizes, key=lambda f: sizes[f])
    for tensor in anchored:
        where = _location(tensor)
        if str(where.parent) != folder:
            weights[tensor.name] = to_array(tensor)
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = "npuprep-in-memory"
            continue
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = where.name
    return folder


def _node_tensors(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.TensorProto]:
    """Tensors in node attributes and in bodies (their initialisers too), all levels."""
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for body in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from body.initializer
                yield from _node_tensors(body.node)


def _location(tensor: onnx.TensorProto) -> Path:
    return Path(next(e.value for e in tensor.external_data if e.key == "location"))


def _cpu_session(source: bytes | str, opts: ort.SessionOptions) -> ort.InferenceSession:
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"],
                                disabled_optimizers=list(CAST_BLIND_FUSIONS))


@contextlib.contextmanager
def _load_errors(produced: str | None = None, source: str | None = None) -> Iterator[None]:
    """onnxruntime's refusal to load a model, as one NpuprepError line naming the user's file
    (`source`) and the node onnxruntime names, or an InternalError for a model npuprep
    `produced`."""
    try:
        yield
    except (ort.capi.onnxruntime_pybind11_state.Fail,
            ort.capi.onnxruntime_pybind11_state.InvalidGraph,
            ort.capi.onnxruntime_pybind11_state.NotImplemented) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if produced:
            raise InternalError(f"onnxruntime cannot load {produced} npuprep made: {first}") from None
        said = refusal(first)
        if source:
            raise NpuprepError(f"{shown(source)}: onnxruntime cannot load it: {said}") from None
        raise NpuprepError(f"onnxruntime cannot load the model: {said}") from None


@contextlib.contextmanager
def run_errors(source: str) -> Iterator[None]:
    """onnxruntime's failure to run the user's model (`source`) on a sample, as one
    NpuprepError line naming the file and the node (a model onnxruntime loads but cannot
    run: a kernel's unsupported attribute combination)."""
    try:
        yield
    except (ort.capi.onnxruntime_pybind11_state.Fail,
            ort.capi.onnxruntime_pybind11_state.InvalidArgument,
            ort.capi.onnxruntime_pybind11_state.RuntimeException,
            ort.capi.onnxruntime_pybind11_state.NotImplemented) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NpuprepError(f"{shown(source)}: onnxruntime cannot run it: {refusal(first)}") from None


def check_runs(model: onnx.ModelProto, feed: dict[str, np.ndarray], source: str) -> None:
    """Raise run_errors' line where the user's `model` itself fails on `feed`: called once
    a run of a graph npuprep built from it failed, to tell the user's fault from npuprep's."""
    session = make_session(model, optimize=False, prepack=False, lean=True, source=source)
    with run_errors(source):
        run(session, feed)


_STATUS = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")
# The file onnxruntime loaded is npuprep's temporary graph where a session reads weights in
# place: never the name to give the user.
_LOADED_FROM = re.compile(r"^Load model from .*? failed: ?")
# A kernel's refusal to be built names onnxruntime's source line and C++ constructor first.
_KERNEL_AT = re.compile(r"^Exception during initialization: \S+:\d+ \S+\(.*?\) ")
_NODE_OP = re.compile(r"^Node \((.*?)\) Op \((.*?)\) ")
_RUNNING = re.compile(r"^Non-zero status code returned while running (\S+) node\. Name:'(.*?)' "
                      r"Status Message: ")
_IN_NODE = re.compile(r" in node \((.*?)\)")


def refusal(text: str) -> str:
    """onnxruntime's load error without its status prefix and the path it loaded from, the
    node first where it names one: `node 'mm' (MatMul): [ShapeInferenceError] ...`."""
    text = _KERNEL_AT.sub("", _LOADED_FROM.sub("", _STATUS.sub("", text.strip())))
    if m := _NODE_OP.match(text):
        return f"node '{shown(m[1])}' ({shown(m[2])}): {text[m.end():]}"
    if m := _RUNNING.match(text):
        return f"node '{shown(m[2])}' ({shown(m[1])}): {text[m.end():]}"
    if m := _IN_NODE.search(text):
        return f"node '{shown(m[1])}': {(text[:m.start()] + text[m.end():]).rstrip('.')}"
    return text


def run(
    session: ort.InferenceSession,
    feeds: dict[str, np.ndarray],
    outputs: Sequence[str] | None = None,
) -> dict[str, np.ndarray]:
    """Run once; returns name -> array for the requested (default: all) outputs."""
    names = list(outputs) if outputs is not None else [o.name for o in session.get_outputs()]
    values = session.run(names, {k: widen_array(np.asarray(v)) for k, v in feeds.items()})
    return dict(zip(names, values, strict=True))


def run_in_streams(session: ort.InferenceSession, samples: Iterable[Mapping[str, np.ndarray]],
                   names: Sequence[str] | None, streams: int) -> Iterator[dict[str, np.ndarray]]:
    """`names` (default: all outputs) of each sample in order, `streams` samples running at
    once on threads sharing the session (as calibration runs them: small kernels keep one
    core each busier than two cores one run)."""
    if streams == 1:
        for feed in samples:
            yield run(session, dict(feed), names)
        return
    with ThreadPoolExecutor(streams) as pool:
        pending: deque[Future[dict[str, np.ndarray]]] = deque()
        for feed in samples:
            pending.append(pool.submit(run, session, dict(feed), names))
            if len(pending) >= streams:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


# glibc mallopt parameters, and the values set: buffers up to 64 MiB come from the heap and
# freed memory stays there up to 128 MiB (glibc's own dynamic rule, fixed at that size); one
# heap (arena) for every thread.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_MMAP_THRESHOLD = 64 * 2**20


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system: the buffers _reuse_freed_buffers keeps
    for the next run are dead weight once a stage's last session is gone (calibration left
    ~300 MB resident on a 340 MB transformer). glibc only, else nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return


@functools.cache
def _reuse_freed_buffers() -> None:
    """Without its arena, onnxruntime mallocs each activation; glibc maps every block above
    128 KiB afresh and unmaps it on free, so each run page-faults through every activation
    (calibration graphs ran 1.6x slower end to end). Serving such blocks from the heap
    instead keeps freed pages for the next run. With one heap for all threads, runs on
    several threads at once (calibration streams) reuse each other's freed buffers instead
    of each thread's heap keeping its own high-water mark (conv net, 2 streams: -8 MB of
    ~120 MB peak). Process-wide; glibc only, else nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD)
        libc.mallopt(_M_ARENA_MAX, 1)
    except (OSError, AttributeError):
        return


def make_session_external(
    model: onnx.ModelProto | str,
    weights: dict[str, np.ndarray] | None = None,
    *,
    threads: int | None = None,
    optimize: bool | str = True,
    prepack: bool = True,
    source: str | None = None,
) -> ort.InferenceSession:
    """A session for a graph of many small kernels, its large initialisers given as arrays.

    `model` declares each of `weights` as external data (any location); onnxruntime takes the
    arrays as they are instead of parsing a second copy out of a serialised model, which
    keeps peak memory near a session loaded from a file. The session keeps the arrays alive.
    A path is loaded as it is (its own external data). `prepack=False` builds it without
    onnxruntime's prepacked weights: faster to build, slower MatMuls. A proto holding BF16
    is widened to FP32 exactly first, its BF16 arrays too (npuprep.bf16). `source`: the user's
    file the graph is instrumented from, named in a refusal.
    """
    opts = session_options(threads=threads, optimize=optimize)
    if not prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    _lean(opts)
    # onnxruntime's default order runs the whole model before any side branch that feeds only
    # the statistics outputs, so each activation stayed alive to the end and was reduced
    # cold from memory. Priority order runs the ready node of lowest index (proto order)
    # next, and calibration graphs put their statistics ahead of the model (see
    # calibrate.instrument._main_order), so each reduction runs as soon as its tensor exists:
    # reductions read warm data (transformer, 1 thread: 8.6 -> 4.4 ms per sample) and
    # activations die as in plain inference.
    opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    # A model already holding Q/DQ pairs is measured as it computes, in float after each DQ;
    # onnxruntime's QDQ passes also abort (a failed assertion, exit 134) on a DQ whose output
    # statistics branches read as an implicit input.
    opts.add_session_config_entry("session.disable_quant_qdq", "1")
    _reuse_freed_buffers()
    weights = weights or {}
    if not isinstance(model, str) and has_bf16(model):
        model = widen_bf16(model)
        weights = {name: widen_array(value) for name, value in weights.items()}
    names = list(weights)
    values = [ort_value(weights[n]) for n in names]
    if names:
        opts.add_external_initializers(names, values)
    serialised = model if isinstance(model, str) else model.SerializeToString()
    with _load_errors(source=source):
        session = _cpu_session(serialised, opts)
    session._npuprep_weights = (values, weights)  # type: ignore[attr-defined]
    return session


# Initialisers above this size reach onnxruntime as arrays, not inside the serialised graph.
INLINE_BYTES = 4096


def ort_value(array: np.ndarray) -> ort.OrtValue:
    """An OrtValue over `array`'s memory (no copy). onnxruntime makes none from an ml_dtypes
    FP8 array ("only supported from non-string numpy arrays", 1.32), so those go as their
    bytes with the ONNX type named: FP8 weights then load as arrays or mapped from a file
    like any other, never serialised inside the graph."""
    if array.dtype.kind == "V":  # an ml_dtypes type
        onnx_type = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
        if onnx_type in _FP8_TYPES:
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint8), onnx_type)
    return ort.OrtValue.ortvalue_from_numpy(array)


_FP8_TYPES = frozenset({onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E4M3FNUZ,
                        onnx.TensorProto.FLOAT8E5M2, onnx.TensorProto.FLOAT8E5M2FNUZ})


def split_weights(
    proto: onnx.ModelProto, base_dir: Path | None = None
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A copy of the model without its large main-graph initialisers (declared as external
    data instead), and those initialisers as arrays. External data is read from `base_dir`;
    without one, external initialisers stay as they are."""
    skeleton = onnx.ModelProto()
    copy_fields(proto, skeleton, skip="graph")
    copy_fields(proto.graph, skeleton.graph, skip="initializer")
    weights: dict[str, np.ndarray] = {}
    for init in proto.graph.initializer:
        external = init.data_location == onnx.TensorProto.EXTERNAL
        # Sized by its dims: a proto's ByteSize() encodes it to count (MiniLM's 47 MB embedding:
        # 48 ms for every session made), and a string tensor stays in the graph.
        if (external and base_dir is None) or (not external and (
                init.data_type == onnx.TensorProto.STRING or tensor_nbytes(init) <= INLINE_BYTES)):
            skeleton.graph.initializer.append(init)
            continue
        weights[init.name] = external_array(init, base_dir) if external else numpy_helper.to_array(init)
        placeholder = skeleton.graph.initializer.add()
        placeholder.name, placeholder.data_type = init.name, init.data_type
        placeholder.dims.extend(init.dims)
        placeholder.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", "npuprep-in-memory"), ("offset", "0"), ("length", str(weights[init.name].nbytes))):
            entry = placeholder.external_data.add()
            entry.key, entry.value = key, value
    return skeleton, weights
