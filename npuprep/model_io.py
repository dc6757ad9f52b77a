"""Load and save ONNX models: external data, >2 GB, BF16 initialisers, fingerprints, atomic writes."""

from __future__ import annotations

import hashlib
import mmap
import os
import sys
import tempfile
import threading
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np
import onnx
from google.protobuf.message import DecodeError, Message

from npuprep.errors import NpuprepError
from npuprep.graph import copy_fields, external_info, is_anchored, read_in, with_values

# Protobuf cannot serialise a message of 2 GiB or more; such models keep weights outside.
PROTOBUF_LIMIT = 2**31 - 1

# A light load (weights="file") leaves inline raw_data above this many bytes in the file.
LIGHT_INLINE_BYTES = 4096


@dataclass(frozen=True)
class Model:
    """A loaded ONNX model with where it came from and a content fingerprint."""

    proto: onnx.ModelProto
    path: str
    # The fingerprint, or its computation still running (a light load hashes the weights on
    # disk while the caller goes on).
    digest: str | Future[str]

    @property
    def fingerprint(self) -> str:
        return self.digest if isinstance(self.digest, str) else self.digest.result()

    @property
    def opset(self) -> int:
        return model_opset(self.proto)

    @property
    def graph(self) -> onnx.GraphProto:
        return self.proto.graph


def model_opset(proto: onnx.ModelProto) -> int:
    """The default-domain opset the model declares."""
    for entry in proto.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    return 0


def uses_external_data(proto: onnx.ModelProto) -> bool:
    """Whether any tensor of the model (bodies included) keeps its values in an external file."""
    return any(
        t.data_location == onnx.TensorProto.EXTERNAL
        for t in onnx.external_data_helper._get_all_tensors(proto)
    )


def load_model(path: str | Path, weights: Literal["memory", "file"] = "memory") -> Model:
    """Load an ONNX file; a bad file is one clear NpuprepError.

    weights="memory": every initialiser holds its values (external data read in).
    weights="file": a light model for tools that only hand the graph to onnxruntime, so
    Python never holds the weights: each main-graph initialiser stored inline as raw_data
    over LIGHT_INLINE_BYTES becomes an external-data reference into the .onnx file itself
    (location = its name, offset and length of the payload); external data stays where it
    is. Its tensors resolve relative to the model's folder only (external_array(t, folder)).
    The fingerprint is the same either way; with weights="file" it is computed in a
    background thread (hashing the weights from disk takes ~1 s per GB, which overlaps with
    building onnxruntime sessions) and `Model.fingerprint` waits for it.
    """
    if weights not in ("memory", "file"):
        raise ValueError(f"weights must be 'memory' or 'file', got {weights!r}")
    path = Path(path)
    if not path.is_file():
        raise NpuprepError(f"{path}: model file not found")
    proto = light_proto(path) if weights == "file" else _parse(path)
    if not proto.HasField("graph") or (not proto.graph.node and not proto.graph.output):
        raise NpuprepError(f"{path}: not an ONNX model (no graph found; truncated or wrong file?)")
    _check_defined(proto.graph, set(), path)
    _check_outputs(proto.graph, path)
    # IR 3 wants every initialiser listed as a graph input; the constants npuprep adds
    # (instrumentation, rewrites) are not, and onnxruntime refuses them. IR 4 reads an IR 3
    # graph the same (an initialiser that is an input stays one); the fingerprint has no IR.
    proto.ir_version = max(proto.ir_version, 4)
    if uses_external_data(proto):
        _check_external_files(proto, path)
        if weights == "file":
            return Model(proto=proto, path=str(path), digest=_fingerprint_in_background(proto, path))
        try:
            onnx.load_external_data_for_model(proto, str(path.parent))
        except (OSError, ValueError) as exc:
            raise NpuprepError(f"{path}: cannot read external data ({exc})") from None
    return Model(proto=proto, path=str(path), digest=fingerprint(proto))


def _check_defined(graph: onnx.GraphProto, outer: set[str], path: Path) -> None:
    """Every tensor a node reads is defined somewhere in its graph or an enclosing one
    (order is not checked: onnxruntime sorts), so a dangling name is one error, not a crash."""
    known = outer | {vi.name for vi in graph.input} | {i.name for i in graph.initializer}
    known |= {i.name for i in graph.sparse_initializer if i.values.name}
    known |= {o for n in graph.node for o in n.output if o}
    for node in graph.node:
        for name in node.input:
            if name and name not in known:
                raise NpuprepError(f"{path}: node '{node.name or node.op_type}' reads tensor '{name}', "
                                   "which no node, input or initialiser of the model defines")
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                _check_defined(sub, known, path)
    for out in graph.output:
        if out.name not in known:
            raise NpuprepError(f"{path}: graph output '{out.name}' is not produced by any node")


def _check_outputs(graph: onnx.GraphProto, path: Path) -> None:
    """Each graph output names its own tensor (two outputs of one tensor have one value)."""
    seen: set[str] = set()
    for out in graph.output:
        if out.name in seen:
            raise NpuprepError(f"{path}: graph output '{out.name}' is listed twice; each output must "
                               "name its own tensor (add an Identity for the second)")
        seen.add(out.name)


def _fingerprint_in_background(proto: onnx.ModelProto, path: Path) -> Future[str]:
    """fingerprint(proto, path's folder), its external data hashed by a daemon thread
    (hashlib and file reads release the GIL), which never touches the proto; a read error
    comes back as an NpuprepError from its result."""
    result: Future[str] = Future()
    pieces = list(_hashed_pieces(proto, path.parent))

    def work() -> None:
        try:
            result.set_result(_digest(pieces))
        except OSError as exc:
            result.set_exception(NpuprepError(f"{path}: cannot read the weights ({exc})"))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller, not lost
            result.set_exception(exc)

    threading.Thread(target=work, name="npuprep-fingerprint", daemon=True).start()
    return result


def _parse(path: Path) -> onnx.ModelProto:
    try:
        return onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as exc:
        raise NpuprepError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None


def _check_external_files(proto: onnx.ModelProto, path: Path) -> None:
    """Every external-data file exists next to the model and is long enough."""
    for tensor in onnx.external_data_helper._get_all_tensors(proto):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = Path(info.get("location", ""))
        if location.is_absolute() or ".." in location.parts:
            raise NpuprepError(
                f"{path}: external data file '{location}' for initialiser '{tensor.name}' "
                "lies outside the model's folder"
            )
        data_file = path.parent / location
        if not data_file.is_file():
            raise NpuprepError(
                f"{path}: external data file '{info.get('location')}' for initialiser "
                f"'{tensor.name}' not found next to the model"
            )
        needed = int(info.get("offset", 0)) + int(info.get("length", 0))
        if data_file.stat().st_size < needed:
            raise NpuprepError(
                f"{path}: external data file '{info.get('location')}' is truncated "
                f"(initialiser '{tensor.name}' needs {needed} bytes)"
            )


def light_proto(path: str | Path) -> onnx.ModelProto:
    """The model at `path` as load_model(path, weights="file") holds it, unchecked and
    without a fingerprint: large raw_data of main-graph initialisers point into the file.

    The file is mapped and scanned in protobuf wire format (see _strip_payloads); only the
    bytes outside those payloads are copied and parsed, so no full proto ever exists.
    """
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                kept, refs = b"", []
            else:
                with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                    kept, refs = _strip_payloads(buf, size)
        proto = onnx.ModelProto()
        proto.ParseFromString(kept)
    except (_WireError, DecodeError, OSError) as exc:
        name = "DecodeError" if isinstance(exc, _WireError) else type(exc).__name__
        raise NpuprepError(f"{path}: not a readable ONNX model ({name}: {exc})") from None
    del kept
    for index, offset, length in refs:
        tensor = proto.graph.initializer[index]
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", path.name), ("offset", str(offset)), ("length", str(length))):
            tensor.external_data.add(key=key, value=value)
    return proto


class _WireError(ValueError):
    """The file is not well-formed protobuf (truncated, or not a model)."""


# Field numbers: ModelProto.graph, GraphProto.initializer, TensorProto raw_data,
# external_data and data_location.
_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5
_TENSOR_RAW_DATA, _TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 9, 13, 14


def _strip_payloads(buf: mmap.mmap, size: int) -> tuple[bytes, list[tuple[int, int, int]]]:
    """The file's bytes less the large raw_data payloads of main-graph initialisers, and
    (initialiser index, payload offset, payload length) of each one left out.

    Only tags and lengths are read: a skipped payload's pages are never touched. The graph
    fields are re-encoded with their new lengths; everything else is copied as it is.
    """
    parts: list[bytes] = []
    refs: list[tuple[int, int, int]] = []
    copied = index = 0
    for field, wire, start, value, end in _fields(buf, 0, size):
        if field == _MODEL_GRAPH and wire == 2:
            graph, index = _strip_graph(buf, value, end, index, refs)
            parts += [buf[copied:start], _varint_bytes(field << 3 | 2), _varint_bytes(sum(map(len, graph))), *graph]
            copied = end
    parts.append(buf[copied:size])
    return b"".join(parts), refs


def _strip_graph(
    buf: mmap.mmap, pos: int, stop: int, index: int, refs: list[tuple[int, int, int]]
) -> tuple[list[bytes], int]:
    """A GraphProto body (as pieces) without its initialisers' large payloads; `index`
    counts initialisers across graph fields (protobuf merges repeated ones in order)."""
    parts: list[bytes] = []
    copied = pos
    for field, wire, start, value, end in _fields(buf, pos, stop):
        if field != _GRAPH_INITIALIZER or wire != 2:
            continue
        payload = _large_raw_data(buf, value, end)
        if payload is not None:
            raw_start, raw_value, raw_end = payload
            tensor = buf[value:raw_start] + buf[raw_end:end]
            parts += [buf[copied:start], _varint_bytes(field << 3 | 2), _varint_bytes(len(tensor)), tensor]
            copied = end
            refs.append((index, raw_value, raw_end - raw_value))
        index += 1
    parts.append(buf[copied:stop])
    return parts, index


def _large_raw_data(buf: mmap.mmap, pos: int, stop: int) -> tuple[int, int, int] | None:
    """(field start, payload start, end) of a TensorProto's raw_data where it can stay in the
    file: a single raw_data field over LIGHT_INLINE_BYTES, in a tensor not already external."""
    found = []
    for field, wire, start, value, end in _fields(buf, pos, stop):
        if field == _TENSOR_RAW_DATA and wire == 2:
            found.append((start, value, end))
        elif field == _TENSOR_EXTERNAL_DATA or (field == _TENSOR_DATA_LOCATION and _varint(buf, value, end)[0]):
            return None
    if len(found) == 1 and found[0][2] - found[0][1] > LIGHT_INLINE_BYTES:
        return found[0]
    return None


def _fields(buf: mmap.mmap, pos: int, stop: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, field start, value start, value end) of each field of the
    message in buf[pos:stop]; a length-delimited value starts after its length."""
    while pos < stop:
        start = pos
        key, pos = _varint(buf, pos, stop)
        field, wire = key >> 3, key & 7
        value = pos
        if wire == 0:
            end = _varint(buf, pos, stop)[1]
        elif wire == 1:
            end = pos + 8
        elif wire == 2:
            length, value = _varint(buf, pos, stop)
            end = value + length
        elif wire == 5:
            end = pos + 4
        else:
            raise _WireError(f"unexpected wire type {wire} at byte {start}")
        if field == 0 or end > stop:
            raise _WireError(f"truncated or corrupt at byte {start}")
        yield field, wire, start, value, end
        pos = end


def _varint(buf: mmap.mmap, pos: int, stop: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it."""
    result = shift = 0
    while pos < stop and shift < 64:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise _WireError(f"truncated or corrupt at byte {pos}")


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def fingerprint(proto: onnx.ModelProto, base_dir: str | Path | None = None) -> str:
    """sha256 of the graph and its weights, independent of where the weights are stored.

    `base_dir`: the folder external data is read from (in chunks, never whole), for a model
    whose weights were not loaded; the hash is that of the same model with them loaded.
    """
    return _digest(_hashed_pieces(proto, base_dir))


# What the fingerprint hashes, in order: bytes, or a range of a file (path, offset, length or
# None for the rest) streamed from disk.
_Piece = bytes | tuple[Path, int, int | None]


def _hashed_pieces(proto: onnx.ModelProto, base_dir: str | Path | None) -> Iterator[_Piece]:
    # The graph without its initialisers, built field by field: copying the whole graph first
    # would hold a second copy of every weight (4x the model size for a >2 GB model).
    graph = onnx.GraphProto()
    for desc, value in proto.graph.ListFields():
        if desc.name == "initializer":
            continue
        if hasattr(value, "extend"):
            getattr(graph, desc.name).extend(value)
        elif hasattr(value, "CopyFrom"):
            getattr(graph, desc.name).CopyFrom(value)
        else:
            setattr(graph, desc.name, value)
    yield graph.SerializeToString(deterministic=True)
    for init in proto.graph.initializer:
        yield init.name.encode()
        yield bytes(str(init.data_type), "ascii")
        yield bytes(str(list(init.dims)), "ascii")
        yield _value_piece(init, base_dir)
    for entry in proto.opset_import:
        yield f"{entry.domain}:{entry.version}".encode()


def _value_piece(init: onnx.TensorProto, base_dir: str | Path | None) -> _Piece:
    """The bytes _value_bytes gives for the tensor with its external data (if any) loaded:
    a file range where they are the file's bytes as they are."""
    if init.data_location != onnx.TensorProto.EXTERNAL or (base_dir is None and not is_anchored(init)):
        return _value_bytes(init)
    base_dir = base_dir or "/"  # an anchored tensor's location is absolute
    if sys.byteorder != "little" or init.data_type in _PACKED_TYPES:
        return _value_bytes(_loaded(init, base_dir))
    info = {e.key: e.value for e in init.external_data}
    length = int(info["length"]) if "length" in info else None
    return Path(base_dir) / info["location"], int(info.get("offset", 0)), length


def _digest(pieces: Iterable[_Piece]) -> str:
    h = hashlib.sha256()
    chunk = memoryview(bytearray(_HASH_CHUNK))
    for piece in pieces:
        if isinstance(piece, bytes):
            h.update(piece)
            continue
        path, offset, left = piece
        with open(path, "rb") as fh:
            fh.seek(offset)
            while left is None or left > 0:
                n = fh.readinto(chunk if left is None else chunk[:left])
                if not n:
                    break
                h.update(chunk[:n])
                if left is not None:
                    left -= n
    return h.hexdigest()[:16]


# External data is hashed in pieces of this many bytes.
_HASH_CHUNK = 1 << 22


def external_locations(proto: onnx.ModelProto) -> set[str]:
    """The files, relative to the model's folder, that hold the model's external data."""
    return {
        e.value
        for t in onnx.external_data_helper._get_all_tensors(proto)
        if t.data_location == onnx.TensorProto.EXTERNAL
        for e in t.external_data
        if e.key == "location"
    }


def external_home(proto: onnx.ModelProto, folder: str | Path) -> tuple[onnx.ModelProto, Path] | None:
    """Where onnxruntime can load `proto`, whose external data is relative to `folder`, from:
    the one folder all its data files really lie in (symlinks followed) and the proto naming
    them there (a copy where a name changes); None where they lie in several folders.

    onnxruntime refuses external data that resolves outside the model's folder, as it does
    in a symlinked model (a Hugging Face cache snapshot links each file into a blob store).
    """
    real = {loc: (Path(folder) / loc).resolve() for loc in external_locations(proto)}
    homes = {p.parent for p in real.values()}
    if len(homes) != 1:
        return None
    if all(p.name == loc for loc, p in real.items()):
        return proto, homes.pop()
    renamed = onnx.ModelProto()
    renamed.CopyFrom(proto)
    for tensor in onnx.external_data_helper._get_all_tensors(renamed):
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value in real:
                entry.value = real[entry.value].name
    return renamed, homes.pop()


def external_array(tensor: onnx.TensorProto, folder: str | Path) -> np.ndarray:
    """The values of a tensor stored as external data, read relative to `folder` (symlinks
    followed, which onnx's own reader refuses)."""
    return onnx.numpy_helper.to_array(_loaded(tensor, folder))


def _unanchored_copy(model: Model) -> onnx.ModelProto | None:
    """A copy of `model`'s proto to rewrite its external tensors in, None where none needs it
    (every external tensor anchored already, or none external)."""
    if all(is_anchored(t) for t in onnx.external_data_helper._get_all_tensors(model.proto)
           if t.data_location == onnx.TensorProto.EXTERNAL):
        return None
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    return proto


def with_weights(model: Model) -> Model:
    """`model` with every external tensor's values read in (same path and fingerprint): what a
    stage that reads or rewrites weights needs after `load_model(path, weights="file")`."""
    proto = _unanchored_copy(model)
    if proto is None:
        return model  # inline only, or anchored already (the CLI anchors before convert does)
    folder = Path(model.path).parent
    try:
        for tensor in onnx.external_data_helper._get_all_tensors(proto):
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                tensor.CopyFrom(_loaded(tensor, folder))
    except (OSError, KeyError, ValueError) as exc:
        raise NpuprepError(f"{model.path}: cannot read external data ({exc})") from None
    return Model(proto=proto, path=model.path, digest=model.digest)


def anchored(model: Model) -> Model:
    """`model` with every external tensor's location made absolute (symlinks followed): its
    weights stay in the user's files and every stage reads one when it needs it
    (npuprep.graph.to_array), while rewritten copies of the graph carry no weight bytes.
    onnxruntime sessions read the files in place (npuprep.runtime.session.make_session);
    writing a model copies their bytes (write_model_files). Same path and fingerprint."""
    proto = _unanchored_copy(model)
    if proto is None:
        return model  # inline only, or anchored already (the CLI anchors before convert does)
    folder = Path(model.path).parent
    resolved: dict[str, str] = {}  # one lookup per file, not per tensor
    for tensor in onnx.external_data_helper._get_all_tensors(proto):
        for entry in tensor.external_data:
            if entry.key == "location" and not entry.value.startswith("/"):
                if entry.value not in resolved:
                    resolved[entry.value] = str((folder / entry.value).resolve())
                entry.value = resolved[entry.value]
    return Model(proto=proto, path=model.path, digest=model.digest)


class WeightScratch:
    """A temporary file for the large tensors npuprep makes while it converts (the lowered
    weights): the graph names each by its absolute location (an anchored tensor, see
    anchored), so it carries no weight bytes; sessions map the file and writing the model
    copies from it. The folder goes when the last holder of this object does.
    `folder`: where to make it (default: the system's temporary folder)."""

    def __init__(self, folder: str | Path | None = None) -> None:
        self._home = tempfile.TemporaryDirectory(prefix="npuprep-weights-", dir=folder)
        self.path = Path(self._home.name) / "weights.bin"
        self._file = open(self.path, "wb")  # noqa: SIM115 - open for the object's life
        self._finalizer = weakref.finalize(self, self._file.close)

    def anchor(self, value: np.ndarray, name: str) -> onnx.TensorProto:
        """`value` written to the file, as a tensor named `name` that refers to it."""
        data = np.ascontiguousarray(value)
        if sys.byteorder != "little":  # ONNX stores raw data little-endian
            data = data.byteswap()
        tensor = onnx.TensorProto(name=name, dims=data.shape,
                                  data_type=onnx.helper.np_dtype_to_tensor_dtype(data.dtype))
        offset = -(-self._file.tell() // _DATA_ALIGN) * _DATA_ALIGN
        self._file.seek(offset)
        self._file.write(data.reshape(-1).view(np.uint8))  # no copy of the bytes
        self._file.flush()  # sessions read it by path while the file stays open
        length = data.nbytes
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, text in (("location", str(self.path)), ("offset", str(offset)), ("length", str(length))):
            tensor.external_data.add(key=key, value=text)
        return tensor


def _loaded(tensor: onnx.TensorProto, folder: str | Path) -> onnx.TensorProto:
    """A copy of an external tensor with its data read into raw_data."""
    return read_in(tensor, str(folder))


def _value_bytes(init: onnx.TensorProto) -> bytes:
    """The bytes of to_array(init).tobytes(), read straight from raw_data where they coincide."""
    if (init.HasField("raw_data") and sys.byteorder == "little"
            and init.data_type not in _PACKED_TYPES):
        return init.raw_data
    return onnx.numpy_helper.to_array(init).tobytes()


# Sub-byte types whose raw_data is packed while to_array unpacks them.
_PACKED_TYPES = frozenset(
    getattr(onnx.TensorProto, n) for n in ("INT4", "UINT4", "INT2", "UINT2", "FLOAT4E2M1",
                                          "FLOAT6E2M3", "FLOAT6E3M2")
    if hasattr(onnx.TensorProto, n)
)


def write_model_files(
    proto: onnx.ModelProto, tmp_model: Path, tmp_data: Path, data_name: str,
    *, external_data: bool | None = None,
) -> bool:
    """Write `proto` to `tmp_model` (fsynced); with external data, its weights to `tmp_data`
    and the model naming them `data_name` (their final name). Tensors anchored to the
    user's files (see anchored) are copied from there, one at a time. Returns whether it
    used the weights file."""
    anchored_bytes = sum(_anchored_length(t) for t in onnx.external_data_helper._get_all_tensors(proto)
                         if is_anchored(t))
    if external_data is None:
        external_data = proto.ByteSize() + anchored_bytes > PROTOBUF_LIMIT - 64 * 2**20
    if not external_data:
        if anchored_bytes:
            _write_streamed(proto, tmp_model)
        else:
            write_bytes(tmp_model, proto.SerializeToString(deterministic=True))
        return False
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    tensors = [t for t in onnx.external_data_helper._get_all_tensors(model)
               if is_anchored(t) or (t.HasField("raw_data") and len(t.raw_data) >= EXTERNAL_MIN_BYTES)]
    with open(tmp_data, "wb") as fh:
        for tensor in tensors:
            # Each tensor starts on a page boundary, so a reader can map it in place.
            offset = -(-fh.tell() // _DATA_ALIGN) * _DATA_ALIGN
            fh.seek(offset)
            if is_anchored(tensor):
                length = _copy_anchored(tensor, fh)
            else:
                length = len(tensor.raw_data)
                fh.write(tensor.raw_data)
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            del tensor.external_data[:]
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(length))):
                tensor.external_data.add(key=key, value=value)
        fh.flush()
        os.fsync(fh.fileno())
    write_bytes(tmp_model, model.SerializeToString(deterministic=True))
    return True


def _write_streamed(proto: onnx.ModelProto, path: Path) -> None:
    """`proto` as one file with every anchored tensor's bytes inline, written one
    initialiser at a time: neither the whole model nor its serialised copy is ever in
    memory. The bytes are those of proto.SerializeToString(deterministic=True) with the
    values read in: fields in number order, the graph's initialisers between its fields
    below and above theirs."""
    skeleton = onnx.ModelProto()
    copy_fields(proto.graph, skeleton.graph, skip="initializer")
    holder = with_values(skeleton)  # a body's or an attribute's tensor: small, read in
    graph_lo, graph_hi = _split_fields(holder.graph, _GRAPH_INITIALIZER)
    model_lo, model_hi = _split_fields(proto, _MODEL_GRAPH)
    sizes = [_inline_size(init) for init in proto.graph.initializer]
    graph_len = len(graph_lo) + len(graph_hi) + sum(1 + len(_varint_bytes(n)) + n for n in sizes)
    with open(path, "wb") as fh:
        fh.write(model_lo)
        fh.write(_varint_bytes(_MODEL_GRAPH << 3 | 2) + _varint_bytes(graph_len))
        fh.write(graph_lo)
        for init, size in zip(proto.graph.initializer, sizes, strict=True):
            fh.write(_varint_bytes(_GRAPH_INITIALIZER << 3 | 2) + _varint_bytes(size))
            if not is_anchored(init):
                fh.write(init.SerializeToString(deterministic=True))
                continue
            # The tensor's fields around raw_data, its bytes copied from their file between.
            meta = onnx.TensorProto()
            meta.CopyFrom(init)
            meta.ClearField("data_location")
            del meta.external_data[:]
            low, high = _split_fields(meta, _TENSOR_RAW_DATA)
            length = _anchored_length(init)
            fh.write(low + _varint_bytes(_TENSOR_RAW_DATA << 3 | 2) + _varint_bytes(length))
            copied = _copy_anchored(init, fh)
            fh.write(high)
            assert copied == length and len(low) + len(high) + 1 + len(_varint_bytes(length)) + length == size, \
                (init.name, size)
        fh.write(graph_hi)
        fh.write(model_hi)
        fh.flush()
        os.fsync(fh.fileno())


def _copy_anchored(tensor: onnx.TensorProto, out: BinaryIO) -> int:
    """Copy an anchored tensor's stored bytes into `out` through one reused buffer (never the
    whole tensor in memory); returns how many."""
    location, offset, length = external_info(tensor)
    remaining = length if length is not None else os.path.getsize(location) - offset
    total = remaining
    buffer = memoryview(bytearray(min(remaining, _COPY_CHUNK)))
    with open(location, "rb") as src:
        src.seek(offset)
        while remaining:
            got = src.readinto(buffer[:min(remaining, len(buffer))])
            if not got:
                raise NpuprepError(f"{location}: tensor '{tensor.name}' needs {total} bytes at offset "
                                   f"{offset}, the file ends {remaining} bytes short")
            out.write(buffer[:got])
            remaining -= got
    return total


_COPY_CHUNK = 16 * 2**20
_TENSOR_RAW_DATA = 9  # TensorProto.raw_data's field number


def _split_fields(message: Message, number: int) -> tuple[bytes, bytes]:
    """The deterministic serialisation of `message`'s fields numbered below `number` and
    above it (`number` itself left out: the caller writes it)."""
    low, high = type(message)(), type(message)()
    for desc, value in message.ListFields():
        if desc.number == number:
            continue
        target = low if desc.number < number else high
        field = getattr(target, desc.name)
        if hasattr(value, "extend"):
            field.extend(value)
        elif hasattr(value, "CopyFrom"):
            field.CopyFrom(value)
        else:
            setattr(target, desc.name, value)
    return low.SerializeToString(deterministic=True), high.SerializeToString(deterministic=True)


def _inline_size(tensor: onnx.TensorProto) -> int:
    """Serialised size of `tensor` with an anchored tensor's bytes inline, not reading them."""
    if not is_anchored(tensor):
        return tensor.ByteSize()
    meta = onnx.TensorProto()
    meta.CopyFrom(tensor)
    meta.ClearField("data_location")
    del meta.external_data[:]
    n = _anchored_length(tensor)
    return meta.ByteSize() + 1 + len(_varint_bytes(n)) + n  # raw_data: one tag byte, length, bytes


# Tensors of at least this many bytes go to the data file (onnx.save_model's threshold
# as npuprep used it); each starts at a multiple of _DATA_ALIGN.
EXTERNAL_MIN_BYTES = 1024
_DATA_ALIGN = 4096


def _anchored_length(tensor: onnx.TensorProto) -> int:
    info = {e.key: e.value for e in tensor.external_data}
    if "length" in info:
        return int(info["length"])
    return os.path.getsize(info["location"]) - int(info.get("offset", 0))


def write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
