"""RKNN-Toolkit2 accuracy_analysis error_analysis.txt (keyed by tensor) -> LayerRecords.

    [Conv] 779    0.99999 | 1.0755    0.99999 | 1.0755
    [Relu] 524    0.99998 | 1.0397    1.00000 | 0.7689    0.99997 | 1.4931    1.00000 | 1.3477

Each row names the tensor a layer writes; the ONNX node is that tensor's producer. The
report carries cosine/euclidean errors (simulator entire/single, runtime entire/single_sim)
and nan/inf markers, but no dtypes.
"""

from __future__ import annotations

import math
import re

from npuprep.crosscheck.names import NodeIndex
from npuprep.crosscheck.record import CompilerReport, LayerRecord, malformed

ROW = re.compile(r"^\[(?P<op>[^\]]+)\]\s+(?P<tensor>\S+)(?P<rest>.*)$")
HEADER = re.compile(r"^\s*layer_name\b")
_COLUMNS = ("simulator_entire", "simulator_single", "runtime_entire", "runtime_single_sim")
# Newer toolkits mark non-finite results: q_nan, s_nan, rt_inf, rt_nan.
_MARKER = re.compile(r"^[a-z]+_(nan|inf)$")


def read_rknn(path: str, text: str, index: NodeIndex) -> CompilerReport:
    """Records of every `[OpType] tensor` row."""
    records: list[LayerRecord] = []
    for number, line in enumerate(text.splitlines(), start=1):
        match = ROW.match(line.strip())
        if not match:
            continue
        op_type, tensor = match.group("op"), match.group("tensor")
        if op_type == "Input" or tensor in index.graph_inputs:
            continue
        metrics = _metrics(path, number, match.group("rest"))
        label = index.producer.get(tensor) or index.resolve(tensor)
        records.append(LayerRecord(
            layer=f"[{op_type}] {tensor}",
            onnx_nodes=(label,) if label else (),
            op_type=op_type,
            device="NPU",
            in_dtypes=(),
            out_dtypes=(),
            compute_dtype="",
            unresolved=() if label else (tensor,),
            out_tensors=(tensor,),
            metrics=metrics,
            where=f"line {number}",
        ))
    if not records and not any(HEADER.match(line) for line in text.splitlines()):
        raise malformed(path, "line 1", "no RKNN error_analysis rows found "
                        "(expected '[OpType] tensor  cos | euc ...')")
    return CompilerReport(path=path, format="rknn", records=tuple(records), dtypes_reported=False)


def _metrics(path: str, number: int, rest: str) -> dict[str, object]:
    """cos/euc per column (1.x reports: cos only) and any nan/inf markers."""
    paired = "|" in rest
    values: list[float] = []
    markers: list[str] = []
    for token in rest.replace("|", " ").split():
        if _MARKER.match(token):
            markers.append(token)
            continue
        try:
            values.append(float(token))
        except ValueError:
            raise malformed(path, f"line {number}", f"'{token}' is not a number") from None
    metrics: dict[str, object] = {}
    if paired:
        if len(values) % 2:
            raise malformed(path, f"line {number}", "cos | euc values come in pairs; one is missing")
        pairs = [values[i:i + 2] for i in range(0, len(values), 2)]
        if len(pairs) > len(_COLUMNS):
            raise malformed(path, f"line {number}", f"{len(pairs)} cos|euc pairs, at most 4")
        for column, (cos, euc) in zip(_COLUMNS, pairs, strict=False):
            metrics[f"{column}_cos"] = _finite_or_text(cos)
            metrics[f"{column}_euc"] = _finite_or_text(euc)
    else:
        if len(values) > len(_COLUMNS):
            raise malformed(path, f"line {number}", f"{len(values)} cosine values, at most 4")
        for column, cos in zip(_COLUMNS, values, strict=False):
            metrics[f"{column}_cos"] = _finite_or_text(cos)
    if markers:
        metrics["markers"] = markers
    return metrics


def _finite_or_text(x: float) -> float | str:
    # JSON artefacts carry no NaN; a nan cosine means an all-zero, constant or huge tensor.
    return x if math.isfinite(x) else str(x)
