"""OpenVINO's runtime report (npuprep/vendors/openvino.py: `runtime_report`) -> LayerRecords.

    {"format": "openvino_runtime", "hint": "bf16", "layers": [
      {"name": "z", "type": "Subgraph", "runtime_precision": "f32",
       "original_names": ["n2_Exp", "n3_Mul", "z"], ...}, ...]}

Each executed layer names the ONNX nodes it came from; a node that writes a graph output
is named after that output, and the plugin adds suffixes to the parts it splits off
(`MatMul_3/transpose_b`, `z.0`). Layers it inserts (Reorder, Convert_123 between precisions)
move or re-type data: they are no compute. Inputs, outputs and constants are skipped.
"""

from __future__ import annotations

import re

from npuprep.crosscheck.names import NodeIndex
from npuprep.crosscheck.record import CompilerReport, LayerRecord, malformed
from npuprep.ops import MAC_OPS
from npuprep.vendors.openvino import PRECISIONS, REPORT_FORMAT

_SKIPPED = {"Input", "Output", "Const", "Parameter", "Result"}
# Layers that only move or re-type data between precisions and layouts.
_MOVES = {"Reorder", "Convert"}
_WEIGHT_PREP = {"/transpose_a", "/transpose_b"}
_MAC_LAYERS = {"FullyConnected", "Convolution", "MatMul", "Deconvolution"}
_SPLIT_OFF = re.compile(r"(/[^/]+|\.\d+|:\d+)$")
# A precision hint -> the OPTIMIZATION_CAPABILITIES entry of a device with kernels of its type.
_CAPABILITY = {"f16": "FP16", "bf16": "BF16"}
_TYPE = re.compile(r"(FP|BF|INT|UINT)\d+$")
# `risk_logits_compressed_to_f16`: the Convert OpenVINO puts after a node to store it in f16.
_COMPRESSED = re.compile(r"(.+)_compressed_to_f16(?:[.:]\d+)?")


def looks_like(data: object) -> bool:
    return isinstance(data, dict) and data.get("format") == REPORT_FORMAT


def read_openvino(path: str, data: object, index: NodeIndex) -> CompilerReport:
    """A record per executed layer; its nodes run in the layer's runtimePrecision."""
    if not isinstance(data, dict) or not looks_like(data) or not isinstance(data.get("layers"), list):
        raise malformed(path, "top level", f"not an OpenVINO runtime report (expected "
                        f"{{\"format\": \"{REPORT_FORMAT}\", \"layers\": [...]}})")
    records = []
    for i, layer in enumerate(data["layers"]):
        where = f"layers[{i}]"
        if not isinstance(layer, dict) or not isinstance(layer.get("name"), str):
            raise malformed(path, where, "a layer needs a 'name'")
        kind = str(layer.get("type", ""))
        if kind in _SKIPPED:
            continue
        nodes, unresolved, compressed, whole = [], [], [], False
        for name in layer.get("original_names", ()) or ():
            squeezed = _COMPRESSED.fullmatch(str(name))
            if squeezed:
                # OpenVINO's Convert of a node's output to f16, inside this layer.
                compressed += index.outputs.get(_node_for(squeezed.group(1), index)[0] or "", ())
                continue
            label, split_off = _node_for(str(name), index)
            if label:
                nodes.append(label)
                # `cond_in_mm/transpose_b` is the weight's transpose OpenVINO split off the
                # node before a fused FullyConnected, not where the node ran.
                whole = whole or not split_off
            elif not _inserted(str(name), kind):
                unresolved.append(str(name))
        nodes = _with_fused_mac(kind, nodes, index)
        precision = PRECISIONS.get(str(layer.get("runtime_precision", "")), "")
        outs = [PRECISIONS.get(str(p), "") for p in layer.get("output_precisions", ()) or ()]
        # The layer's last node writes what leaves it, in the layer's output precision (a
        # Subgraph computed in f32 may store `..._compressed_to_f16`); the others run in its
        # runtimePrecision.
        last = index.outputs.get(nodes[-1], ()) if nodes else ()
        records.append(LayerRecord(
            layer=layer["name"], onnx_nodes=tuple(dict.fromkeys(nodes)), op_type=kind,
            device=str(data.get("device", "")), in_dtypes=(),
            # A node stored in f16 first: precision_of takes the first dtype given for a tensor.
            out_dtypes=(*("fp16",) * len(compressed),
                        *(outs[:1] * len(last) if outs else ("",) * len(last))),
            out_tensors=(*compressed, *last),
            compute_dtype=precision,
            compute=kind not in _MOVES and (whole or bool(unresolved and not nodes)),
            unresolved=tuple(unresolved),
            metrics={"primitive": layer["primitive"]} if layer.get("primitive") else {},
            where=where))
    hint = data.get("hint", "")
    return CompilerReport(path=path, format="openvino", records=tuple(records),
                          notes=(f"OpenVINO {data.get('openvino', '')} on "
                                 f"{data.get('device', '')}, INFERENCE_PRECISION_HINT {hint}",
                                 *hint_unsupported(data)))


def hint_unsupported(data: dict) -> tuple[str, ...]:
    """A note where the device has no kernels of the hint's type (its OPTIMIZATION_CAPABILITIES,
    a report without them says nothing): every layer then ran wider, by no choice of the plugin."""
    hint, device = str(data.get("hint", "")), str(data.get("device", ""))
    # The number types among the capabilities (not BIN, EXPORT_IMPORT).
    have = [c for c in (str(c).upper() for c in data.get("capabilities") or ()) if _TYPE.match(c)]
    wanted = _CAPABILITY.get(hint)
    if not have or wanted is None or wanted in have:
        return ()
    return (f"this {device} has no {wanted} kernels (OPTIMIZATION_CAPABILITIES: "
            f"{', '.join(have)}): OpenVINO ran the {hint} hint in FP32, so this report shows "
            f"neither {wanted}'s rounding nor its overflow; run it on a {device} that lists "
            f"{wanted}",)


def _with_fused_mac(kind: str, nodes: list[str], index: NodeIndex) -> list[str]:
    """A FullyConnected or Convolution named only after the bias Add it absorbed: the MatMul
    or Conv feeding that Add is in it too (OpenVINO keeps the last node's name)."""
    if kind not in _MAC_LAYERS or not nodes or any(index.op_types.get(n) in MAC_OPS for n in nodes):
        return nodes
    first = index.node(nodes[0])
    feeding = [index.producer[i] for i in (first.input if first is not None else ())
               if i in index.producer]
    macs = [n for n in feeding if index.op_types.get(n) in MAC_OPS]
    return [macs[0], *nodes] if len(macs) == 1 else nodes


def _node_for(name: str, index: NodeIndex) -> tuple[str | None, bool]:
    """The ONNX node `name` stands for (a node name, an output tensor, or either with a part
    split off), and whether the part cut off was its weight's preparation (`/transpose_b`),
    not the node itself (`Conv/WithoutBiases` is the Conv)."""
    split_off = False
    while name:
        label = index.resolve(name) or index.producer.get(name)
        if label:
            return label, split_off
        shorter = _SPLIT_OFF.sub("", name)
        if shorter == name:
            return None, False
        split_off = split_off or name[len(shorter):] in _WEIGHT_PREP
        name = shorter
    return None, False


def _inserted(name: str, kind: str) -> bool:
    """A name OpenVINO made itself (a Convert between precisions, an MVN it fused): the ONNX
    names it ran are resolved before this is asked."""
    base = _SPLIT_OFF.sub("", name)
    # `..._flatten_reshape`: the Reshape of a Conv bias it adds for its fused kernel.
    return kind in _MOVES or name.endswith(("_decompressed_to_f32", "_flatten_reshape")) or bool(
        re.fullmatch(r"[A-Z][A-Za-z0-9]*_\d+", base))  # its own `OpType_N` (MVN_36, Convert_12)
