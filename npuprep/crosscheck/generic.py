"""Plain per-node precision list (CSV `node,precision[,device]` or JSON) -> LayerRecords.

JSON may be a list of {"node": ..., "precision": ...} objects or one {node: precision}
mapping; any vendor's report can be massaged into this shape.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from npuprep.crosscheck.names import NodeIndex
from npuprep.crosscheck.record import CompilerReport, LayerRecord, malformed, normalise_dtype


def read_generic_csv(path: str, text: str, index: NodeIndex) -> CompilerReport:
    """Records of a CSV whose header names at least `node` and `precision`."""
    rows = list(csv.reader(io.StringIO(text)))
    header_at = next((i for i, r in enumerate(rows) if any(c.strip() for c in r)), None)
    if header_at is None:
        raise malformed(path, "line 1", "empty report")
    header = [c.strip().lower() for c in rows[header_at]]
    for column in ("node", "precision"):
        if column not in header:
            raise malformed(path, f"line {header_at + 1}",
                            f"header needs a '{column}' column (got {','.join(header)})")
    col = {name: header.index(name) for name in header}
    records = []
    for i, row in enumerate(rows[header_at + 1:], start=header_at + 2):
        if not any(c.strip() for c in row):
            continue
        if len(row) < len(header):
            raise malformed(path, f"line {i}", f"{len(row)} fields, the header has {len(header)}")
        entry = {name: row[j].strip() for name, j in col.items()}
        records.append(_record(path, f"line {i}", entry, index))
    return CompilerReport(path=path, format="generic", records=tuple(records))


def read_generic_json(path: str, data: Any, index: NodeIndex) -> CompilerReport:
    """Records of a JSON list of {node, precision} objects or a {node: precision} mapping."""
    if isinstance(data, dict):
        entries = [({"node": k, "precision": v}, f"key '{k}'") for k, v in data.items()]
    elif isinstance(data, list):
        entries = [(e, f"[{i}]") for i, e in enumerate(data)]
    else:
        raise malformed(path, "top level", "expected a list of {node, precision} objects "
                        "or a {node: precision} mapping")
    records = []
    for entry, where in entries:
        if not isinstance(entry, dict):
            raise malformed(path, where, f"expected an object, got {type(entry).__name__}")
        for key in ("node", "precision"):
            if not isinstance(entry.get(key), str):
                raise malformed(path, f"{where}.{key}", "missing or not a string")
        records.append(_record(path, where, {k: str(v) for k, v in entry.items()}, index))
    return CompilerReport(path=path, format="generic", records=tuple(records))


def _record(path: str, where: str, entry: dict[str, str], index: NodeIndex) -> LayerRecord:
    node = entry["node"]
    if not node:
        raise malformed(path, f"{where} node", "empty node name")
    dtype = normalise_dtype(entry["precision"])
    if dtype is None:
        raise malformed(path, f"{where} precision", f"'{entry['precision']}' names no known data type")
    label = index.resolve(node)
    return LayerRecord(
        layer=node,
        onnx_nodes=(label,) if label else (),
        op_type=entry.get("op_type", "") or (index.op_types.get(label, "") if label else ""),
        device=entry.get("device", ""),
        in_dtypes=(dtype,),
        out_dtypes=(dtype,),
        compute_dtype=dtype,
        unresolved=() if label else (node,),
        where=where,
    )
