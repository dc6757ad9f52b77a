"""Load and save ONNX models: external data, >2 GB, BF16 initialisers, fingerprints, atomic writes."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from npuprep.errors import NpuprepError

# Protobuf cannot serialise a message of 2 GiB or more; such models keep weights outside.
PROTOBUF_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class Model:
    """A loaded ONNX model with where it came from and a content fingerprint."""

    proto: onnx.ModelProto
    path: str
    fingerprint: str

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


def _uses_external_data(proto: onnx.ModelProto) -> bool:
    return any(
        t.data_location == onnx.TensorProto.EXTERNAL
        for t in onnx.external_data_helper._get_all_tensors(proto)
    )


def load_model(path: str | Path) -> Model:
    """Load an ONNX file (and its external data); a bad file is one clear NpuprepError."""
    path = Path(path)
    if not path.is_file():
        raise NpuprepError(f"{path}: model file not found")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as exc:
        raise NpuprepError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    if not proto.HasField("graph") or (not proto.graph.node and not proto.graph.output):
        raise NpuprepError(f"{path}: not an ONNX model (no graph found; truncated or wrong file?)")
    if _uses_external_data(proto):
        for tensor in onnx.external_data_helper._get_all_tensors(proto):
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {e.key: e.value for e in tensor.external_data}
            data_file = path.parent / info.get("location", "")
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
        try:
            onnx.load_external_data_for_model(proto, str(path.parent))
        except (OSError, ValueError) as exc:
            raise NpuprepError(f"{path}: cannot read external data ({exc})") from None
    return Model(proto=proto, path=str(path), fingerprint=fingerprint(proto))


def fingerprint(proto: onnx.ModelProto) -> str:
    """sha256 of the graph and its weights, independent of where the weights are stored."""
    h = hashlib.sha256()
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
    h.update(graph.SerializeToString(deterministic=True))
    for init in proto.graph.initializer:
        h.update(init.name.encode())
        h.update(bytes(str(init.data_type), "ascii"))
        h.update(bytes(str(list(init.dims)), "ascii"))
        h.update(_value_bytes(init))
    for entry in proto.opset_import:
        h.update(f"{entry.domain}:{entry.version}".encode())
    return h.hexdigest()[:16]


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


def save_model(
    proto: onnx.ModelProto,
    path: str | Path,
    *,
    protected: tuple[str | Path, ...] = (),
    external_data: bool | None = None,
) -> Path:
    """Write a model atomically; never over a protected (input) file.

    Models too big for one protobuf (or `external_data=True`) get their weights in
    `<name>.data` next to the model. The data file is renamed into place first, then the
    model, so a reader never sees a model pointing at missing weights.
    """
    path = Path(path)
    for p in protected:
        if Path(p).exists() and path.exists() and path.resolve() == Path(p).resolve():
            raise NpuprepError(f"{path}: refusing to overwrite the input model; choose another -o")
    path.parent.mkdir(parents=True, exist_ok=True)
    if external_data is None:
        external_data = proto.ByteSize() > PROTOBUF_LIMIT - 64 * 2**20
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    tmp_model = _temp_name(path)
    try:
        if external_data:
            data_name = path.name + ".data"
            tmp_data = path.parent / (data_name + ".tmp")
            onnx.save_model(
                model,
                str(tmp_model),
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location=tmp_data.name,
                size_threshold=1024,
            )
            # Point the model at the final data file name before renaming both into place.
            final = onnx.load(str(tmp_model), load_external_data=False)
            for tensor in onnx.external_data_helper._get_all_tensors(final):
                for entry in tensor.external_data:
                    if entry.key == "location":
                        entry.value = data_name
            _write_bytes(tmp_model, final.SerializeToString(deterministic=True))
            os.replace(tmp_data, path.parent / data_name)
        else:
            _write_bytes(tmp_model, model.SerializeToString(deterministic=True))
        os.replace(tmp_model, path)
    finally:
        if tmp_model.exists():
            tmp_model.unlink()
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write a text artefact atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    try:
        _write_bytes(tmp, text.encode("utf-8"))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _temp_name(path: Path) -> Path:
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    # mkstemp makes the file private (0600); outputs get the usual umask-based mode.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(name, 0o666 & ~umask)
    return Path(name)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
