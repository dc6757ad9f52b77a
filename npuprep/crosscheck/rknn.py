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
# Suffixes of the reshapes/transposes/matmul-as-conv the toolkit inserts, and `#N` instances.
_SUFFIX = re.compile(r"[-_](rs|tp|mm|sw)$")
_INSTANCE = re.compile(r"#\d+$")
# Conv + BatchNormalization + activation: the longest chain one RKNN layer is named after.
_MAX_FUSED = 3
_PAIR = re.compile(r"(\S+)\s*\|\s*(\S+)")
# The toolkit's layer types for ONNX ops it rewrites (MatMul/Gemm run as Conv, Sub as Add).
_OPS = {
    "Conv": {"Conv", "MatMul", "Gemm"},
    "Add": {"Add", "Sub"},
    "exNorm": {"LayerNormalization", "InstanceNormalization", "GroupNormalization"},
    "exSoftmax13": {"Softmax", "Div"},
}


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
        nodes = _nodes_for(op_type, tensor, index)
        if nodes is None:
            continue
        label = nodes[-1] if nodes else None
        records.append(LayerRecord(
            layer=f"[{op_type}] {tensor}",
            onnx_nodes=nodes,
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


def _nodes_for(op_type: str, tensor: str, index: NodeIndex) -> tuple[str, ...] | None:
    """The ONNX nodes a `[OpType] tensor` row stands for; None for the vendor's input reshapes.

    The toolkit names a layer after the tensor it writes, with suffixes for the reshapes
    and transposes it inserts (`y-rs_tp`, `h0_mm`, `d2n-rs_sw`, `ln0#1`), and a Conv fused
    with the BatchNormalization (or activation) after it carries the last node's output:
    `[Conv] bn2` is Conv + BatchNormalization.
    """
    for name in _candidates(tensor):
        if name in index.graph_inputs:
            return None
        label = index.producer.get(name) or index.resolve(name)
        if label:
            chain = _fused_chain(op_type, label, index)
            if index.op_types.get(chain[0]) in _OPS.get(op_type, {op_type}):
                return chain
            # Named after its input (`[exNorm] h2_tp_rs_sw` is the LayerNorm reading h2).
            readers = [n for n in index.order if name in index.node(n).input
                       and index.op_types[n] in _OPS.get(op_type, {op_type})]
            return (readers[0],) if len(readers) == 1 else chain
    return ()


def _candidates(tensor: str) -> list[str]:
    names = [tensor]
    base = _INSTANCE.sub("", tensor)
    while True:
        if base != names[-1]:
            names.append(base)
        stripped = _SUFFIX.sub("", base)
        if stripped == base or not stripped:
            return names
        base = stripped


def _fused_chain(op_type: str, label: str, index: NodeIndex) -> tuple[str, ...]:
    """`label` and the nodes before it back to the one of `op_type` the layer is named for."""
    chain = [label]
    node = index.node(label)
    for _ in range(_MAX_FUSED):
        if node is None or index.op_types.get(chain[0]) == op_type:
            break
        inputs = [i for i in node.input if i and i in index.producer]
        if not inputs:
            break
        chain.insert(0, index.producer[inputs[0]])
        node = index.node(chain[0])
    if index.op_types.get(chain[0]) != op_type:
        return (label,)
    return tuple(chain)


def _metrics(path: str, number: int, rest: str) -> dict[str, object]:
    """cos/euc per column (1.x reports: cos only); a marker (q_inf) stands where its value would."""
    markers: list[str] = []

    def value(token: str) -> float | str:
        if _MARKER.match(token):
            markers.append(token)
            return token
        try:
            return _finite_or_text(float(token))
        except ValueError:
            raise malformed(path, f"line {number}", f"'{token}' is not a number") from None

    metrics: dict[str, object] = {}
    if "|" in rest:
        pairs = _PAIR.findall(rest)
        for token in _PAIR.sub(" ", rest).split():
            if not _MARKER.match(token):
                raise malformed(path, f"line {number}", "cos | euc values come in pairs; one is missing")
            markers.append(token)
        if len(pairs) > len(_COLUMNS):
            raise malformed(path, f"line {number}", f"{len(pairs)} cos|euc pairs, at most 4")
        for column, (cos, euc) in zip(_COLUMNS, pairs, strict=False):
            metrics[f"{column}_cos"] = value(cos)
            metrics[f"{column}_euc"] = value(euc)
    else:
        tokens = rest.split()
        if len(tokens) > len(_COLUMNS):
            raise malformed(path, f"line {number}", f"{len(tokens)} cosine values, at most 4")
        for column, cos in zip(_COLUMNS, tokens, strict=False):
            metrics[f"{column}_cos"] = value(cos)
    if markers:
        metrics["markers"] = list(dict.fromkeys(markers))
    return metrics


def _finite_or_text(x: float) -> float | str:
    # JSON artefacts carry no NaN; a nan cosine means an all-zero, constant or huge tensor.
    return x if math.isfinite(x) else str(x)
