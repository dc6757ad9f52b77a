"""Horizon hb_mapper node table (makertbin log or checker output) -> LayerRecords.

    Node                ON   Subgraph  Type              Cosine Similarity  Threshold  DataType
    /model.0/conv/Conv  BPU  id(0)     HzSQuantizedConv  0.999393           1.11671    int8
    /m/attn/Softmax     CPU  --        Softmax           --                 --         float
"""

from __future__ import annotations

import re

from npuprep.crosscheck.names import NodeIndex
from npuprep.crosscheck.record import CompilerReport, LayerRecord, malformed

HEADER = re.compile(r"\bNode\s+ON\s+Subgraph\s+Type\b.*\bDataType\b")
_COLUMNS = 7  # Node ON Subgraph Type Cosine Threshold DataType ("Cosine Similarity" is one column)
# Horizon's DataType column: BPU integer types, CPU "float"; J6 adds float16.
_DTYPES = {"int8": "int8", "int16": "int16", "int32": "int32", "float": "fp32", "float32": "fp32",
           "float16": "fp16"}


def read_horizon(path: str, text: str, index: NodeIndex) -> CompilerReport:
    """Records of every node table in the text; a table ends at a blank line."""
    records: list[LayerRecord] = []
    in_table = False
    for number, line in enumerate(text.splitlines(), start=1):
        if HEADER.search(line):
            in_table = True
            continue
        if not in_table:
            continue
        stripped = line.strip()
        if not stripped:
            in_table = False
            continue
        if set(stripped) <= set("-=+| "):
            continue
        fields = stripped.split()
        if len(fields) < _COLUMNS:
            raise malformed(path, f"line {number}",
                            f"{len(fields)} fields, a node row has {_COLUMNS} "
                            "(Node ON Subgraph Type Cosine Threshold DataType)")
        # Log prefixes (timestamps) come before the row, so read it from the right.
        node, device, _subgraph, op_type, cosine, _threshold, raw_dtype = fields[-_COLUMNS:]
        dtype = _DTYPES.get(raw_dtype.lower())
        if dtype is None:
            raise malformed(path, f"line {number} DataType",
                            f"'{raw_dtype}' is not one of {', '.join(sorted(_DTYPES))}")
        if device not in ("BPU", "CPU"):
            raise malformed(path, f"line {number} ON", f"'{device}' is not BPU or CPU")
        label = index.resolve(node)
        metrics = {}
        if cosine != "--":
            try:
                metrics["cosine"] = float(cosine)
            except ValueError:
                raise malformed(path, f"line {number} Cosine Similarity",
                                f"'{cosine}' is not a number") from None
        records.append(LayerRecord(
            layer=node,
            onnx_nodes=(label,) if label else (),
            op_type=op_type,
            device=device,
            in_dtypes=(dtype,),
            out_dtypes=(dtype,),
            compute_dtype=dtype,
            unresolved=() if label else (node,),
            metrics=metrics,
            where=f"line {number}",
        ))
    if not records:
        raise malformed(path, "line 1", "no hb_mapper node table found (expected a header "
                        "'Node ON Subgraph Type Cosine Similarity Threshold DataType')")
    return CompilerReport(path=path, format="horizon", records=tuple(records))
