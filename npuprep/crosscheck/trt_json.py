"""TensorRT detailed layer JSON (trtexec --exportLayerInfo) -> LayerRecords.

Names come from `Metadata` ("[ONNX Layer: n | Local Function: F]", joined by \\x1E/\\x1F,
truncated with " ... " past 4000 characters) when present, else from the layer name:
"A + B" fusions, "PWN(PWN(a), b)" pointwise groups, "{ForeignNode[first...last]}" ranges
(expanded through the ONNX graph's topological order), "Reformatting CopyNode ... to X".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from npuprep.crosscheck.names import NodeIndex
from npuprep.crosscheck.record import (
    PRECISION_ORDER,
    CompilerReport,
    LayerRecord,
    malformed,
    normalise_dtype,
)

_PROFILE = re.compile(r"\s*\[profile \d+\]$")
_FOREIGN = re.compile(r"^\{ForeignNode\[(.*)\]\}$", re.S)
_REFORMAT = re.compile(r"^Reformatting CopyNode for (?:Input|Output) Tensor \d+ to (.*)$", re.S)
_METADATA_ENTRY = "[ONNX Layer: "
_LOCAL_FUNCTION = " | Local Function: "
_TRUNCATION = " ... "
_DYNAMIC = "N/A due to dynamic shapes"
_NON_COMPUTE_TYPES = frozenset({"Reformat", "NoOp", "Constant"})
_REBUILD = (
    "rebuild the engine with trtexec --profilingVerbosity=detailed --exportLayerInfo=layers.json "
    "(Python: config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED)"
)


@dataclass(frozen=True)
class _Names:
    """Names one layer claims: exact names, a first...last range, or both."""

    names: tuple[str, ...] = ()
    first_last: tuple[str, str] | None = None
    note: str = ""


def read_trt_json(path: str, data: Any, index: NodeIndex) -> CompilerReport:
    """Records of every layer in a parsed --exportLayerInfo document."""
    if isinstance(data, list) and data and isinstance(data[0], dict) and "count" in data[0]:
        raise malformed(path, "top level", "this is a trtexec --exportProfile timing file; "
                        "pass the --exportLayerInfo file instead")
    if not isinstance(data, dict) or "Layers" not in data:
        raise malformed(path, "top level", "expected an object with 'Layers' "
                        "(the file trtexec --exportLayerInfo writes)")
    layers = data["Layers"]
    if not isinstance(layers, list):
        raise malformed(path, "Layers", f"expected a list, got {type(layers).__name__}")
    if any(isinstance(layer, str) for layer in layers):
        raise malformed(path, "Layers", "holds only layer names, so the engine was built without "
                        f"detailed profiling; {_REBUILD}")
    parsed: list[tuple[dict[str, Any], str, _Names]] = []
    for i, layer in enumerate(layers):
        where = f"Layers[{i}]"
        if not isinstance(layer, dict):
            raise malformed(path, where, f"expected an object, got {type(layer).__name__}")
        name = layer.get("Name")
        if not isinstance(name, str) or not name:
            raise malformed(path, f"{where}.Name", "missing or not a string")
        metadata = layer.get("Metadata", "")
        if not isinstance(metadata, str):
            raise malformed(path, f"{where}.Metadata", "expected a string")
        names = _from_metadata(metadata) if metadata.strip() else _from_name(name, index)
        parsed.append((layer, where, names))
    # Nodes that a layer names outright are not members of a neighbouring range.
    claimed = {index.resolve(n) for _, _, names in parsed for n in names.names} - {None}
    records = []
    notes = []
    for layer, where, names in parsed:
        record = _record(path, layer, where, names, index, claimed)
        records.append(record)
        if names.note:
            notes.append(f"{record.layer}: {names.note}")
    # A Reformat serves the layer it names: it touches exactly that layer's nodes.
    by_name = {r.layer: r for r in records}
    for i, record in enumerate(records):
        target = _REFORMAT.match(record.layer)
        served = by_name.get(target.group(1)) if target else None
        if served is not None and served is not record:
            records[i] = replace(record, onnx_nodes=served.onnx_nodes, unresolved=served.unresolved)
    return CompilerReport(path=path, format="trt_json", records=tuple(records), notes=tuple(notes))


def _record(path: str, layer: dict[str, Any], where: str, names: _Names, index: NodeIndex,
            claimed: set[str | None]) -> LayerRecord:
    name = layer["Name"]
    layer_type = layer.get("LayerType", "")
    if not isinstance(layer_type, str):
        raise malformed(path, f"{where}.LayerType", "expected a string")
    in_tensors, in_dtypes = _bindings(path, layer, "Inputs", where)
    out_tensors, out_dtypes = _bindings(path, layer, "Outputs", where)
    resolved: list[str] = []
    unresolved: list[str] = []
    for n in names.names:
        label = index.resolve(n)
        (resolved if label else unresolved).append(label or n)
    if names.first_last:
        first, last = names.first_last
        a, b = index.resolve(first), index.resolve(last)
        for end, label in ((first, a), (last, b)):
            if label is None and end not in unresolved:
                unresolved.append(end)
        if a and b:
            resolved += index.expand_range(a, b, {c for c in claimed if c} - {a, b})
    reformat = layer_type == "Reformat" or name.startswith("Reformatting CopyNode")
    if not resolved and not reformat:
        # A helper layer the importer left unnamed still writes the ONNX node's output tensor.
        writers = [index.producer[t] for t in out_tensors if t in index.producer]
        if writers:
            resolved, unresolved = writers, []
    float_dtypes = [d for d in in_dtypes + out_dtypes if d in PRECISION_ORDER]
    tactic = str(layer.get("TacticName", ""))
    return LayerRecord(
        layer=name,
        onnx_nodes=tuple(dict.fromkeys(resolved)),
        op_type=layer_type or ("Reformat" if reformat else ""),
        device="DLA" if "DLA" in layer_type or "dla" in tactic.lower() else "GPU",
        in_dtypes=tuple(in_dtypes),
        out_dtypes=tuple(out_dtypes),
        compute_dtype=float_dtypes[0] if float_dtypes else "",
        compute=not (reformat or layer_type in _NON_COMPUTE_TYPES),
        unresolved=tuple(unresolved),
        in_tensors=tuple(in_tensors),
        out_tensors=tuple(out_tensors),
        where=where,
    )


def _bindings(path: str, layer: dict[str, Any], key: str, where: str) -> tuple[list[str], list[str]]:
    """Tensor names and normalised dtypes ("" where not reported) of a layer's Inputs or Outputs."""
    entries = layer.get(key, [])
    if not isinstance(entries, list):
        raise malformed(path, f"{where}.{key}", f"expected a list, got {type(entries).__name__}")
    tensors: list[str] = []
    dtypes: list[str] = []
    for j, entry in enumerate(entries):
        field = f"{where}.{key}[{j}]"
        if not isinstance(entry, dict):
            raise malformed(path, field, f"expected an object, got {type(entry).__name__}")
        tensors.append(str(entry.get("Name", "")))
        text = entry.get("Format/Datatype")
        if text is None:
            raise malformed(path, f"{field}.Format/Datatype", f"missing; {_REBUILD}")
        if not isinstance(text, str):
            raise malformed(path, f"{field}.Format/Datatype", "expected a string")
        if text.strip() == _DYNAMIC:
            dtypes.append("")
            continue
        dtype = normalise_dtype(text)
        if dtype is None:
            raise malformed(path, f"{field}.Format/Datatype", f"'{text}' names no known data type")
        dtypes.append(dtype)
    return tensors, dtypes


def _from_metadata(metadata: str) -> _Names:
    """Node names in a Metadata string; a truncated list keeps its two ends as a range."""
    # Entries are joined by \x1E or \x1F; some tools rewrite those as newlines or drop them.
    text = re.sub(r"[\x1e\x1f\r\n]", "\x1e", metadata).replace(_METADATA_ENTRY, "\x1e" + _METADATA_ENTRY)
    pieces = [p.strip() for p in text.split("\x1e") if p.strip()]
    names: list[str] = []
    truncated = False
    for piece in pieces:
        if _TRUNCATION in piece or not (piece.startswith(_METADATA_ENTRY) and piece.endswith("]")):
            truncated = True
            continue
        name = piece[len(_METADATA_ENTRY):-1]
        if _LOCAL_FUNCTION in name:
            name = name.rsplit(_LOCAL_FUNCTION, 1)[0]
        names.append(name)
    if truncated and len(names) >= 2:
        return _Names(tuple(names), (names[0], names[-1]),
                      "Metadata truncated; members between its first and last entries "
                      "recovered from the ONNX graph")
    return _Names(tuple(names), None, "Metadata truncated" if truncated else "")


def _from_name(name: str, index: NodeIndex) -> _Names:
    """Node names encoded in a layer name (TensorRT before 8.6 has no Metadata)."""
    name = _PROFILE.sub("", name).strip()
    if index.resolve(name):
        return _Names((name,))
    foreign = _FOREIGN.match(name)
    if foreign:
        first, sep, last = foreign.group(1).partition("...")
        return _Names((), (first, last)) if sep else _Names((first,))
    reformat = _REFORMAT.match(name)
    if reformat:
        return _from_name(reformat.group(1), index)
    parts: list[str] = []
    for part in name.split(" + "):
        part = part.strip()
        if part.startswith("PWN("):
            inner = part.replace("PWN(", "").replace(")", "")
            parts += [p.strip() for p in inner.split(",") if p.strip()]
        else:
            parts.append(part)
    return _Names(tuple(parts))
