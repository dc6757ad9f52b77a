"""Precision-constraint files from a Plan: TensorRT flags, per-node YAML, Horizon and RKNN dialects.

The primary artefact is the lowered ONNX with explicit Casts (strongly typed): it works
with any compiler, and with TensorRT 11, which dropped weak typing (`--fp16`,
`--layerPrecisions` and `--precisionConstraints` are no longer parsed). These files serve
toolchains that still take per-layer precision requests.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

import onnx

from npuprep.graph import node_label, tensor_types, topological_order, walk_graphs
from npuprep.model_io import Model
from npuprep.names import comment
from npuprep.numerics import FLOAT_ONNX_TYPES, get_format
from npuprep.plan.actions import PinFp32
from npuprep.plan.plan import Plan

TRT11_NOTE = (
    "TensorRT 11 dropped weak typing (--fp16, --layerPrecisions, --precisionConstraints are "
    "not parsed): build the lowered ONNX with explicit Casts, strongly typed, instead."
)
# trtexec's own precision flag per target format (TensorRT 8.6 / 10.x).
_TRT_BUILD_FLAG = {"fp16": "--fp16", "bf16": "--bf16", "fp8_e4m3": "--fp8"}
# Characters trtexec reads literally inside a layer name; anything else gets single quotes,
# which trtexec strips (removeSingleQuotationMarks) after splitting on ',' and the last ':'.
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_./\-]+$")
Types = dict[str, int]


@dataclass(frozen=True)
class PinnedNode:
    """One node the plan keeps in FP32, as the exporters see it."""

    name: str
    op_type: str
    outputs: tuple[str, ...]
    float_outputs: int
    reason: str
    request: bool


@dataclass(frozen=True)
class TrtFlags:
    """trtexec flags that keep the plan's pinned nodes in FP32 on TensorRT 8.6 / 10.x.

    `args` are argv elements (no shell quoting); `command_line()` quotes them for a shell.
    `skipped` lists nodes whose names trtexec cannot carry (a ',' splits the list, a quote
    is stripped), with the reason; `notes` says what the flags cannot promise.
    """

    args: tuple[str, ...]
    layer_precisions: str
    layer_output_types: str
    skipped: tuple[tuple[str, str], ...]
    notes: tuple[str, ...]

    def command_line(self, onnx_path: str = "model.onnx") -> str:
        return shlex.join(("trtexec", f"--onnx={onnx_path}", *self.args))


def pinned_nodes(
    plan: Plan, model: Model, *, also_pinned: Iterable[str] = (), types: Types | None = None,
) -> list[PinnedNode]:
    """The plan's FP32 nodes that compute floats, in topological order (main graph first).

    `model` is the model the compiler reads (the rewritten or lowered one: node names are
    kept). `also_pinned` adds nodes a rewrite keeps in FP32 (a rescale's exit Mul). `types`
    (tensor -> ONNX element type, from graph.tensor_types) skips shape inference when
    several exporters run on one model.
    """
    reasons: dict[str, tuple[str, bool]] = {}
    for action in plan.actions:
        if isinstance(action, PinFp32):
            for n in action.nodes:
                reasons.setdefault(n, (_pin_reason(action), action.request))
    for n in also_pinned:
        reasons.setdefault(n, ("FP32 boundary of a rewrite (rescale exit)", False))
    wanted = plan.pinned_nodes() | set(also_pinned)
    types = types if types is not None else tensor_types(model.proto)
    out: list[PinnedNode] = []
    for node, _scope in _nodes_in_order(model.proto):
        label = node_label(node)
        if label not in wanted:
            continue
        floats = sum(1 for o in node.output if o and types.get(o) in FLOAT_ONNX_TYPES)
        if floats == 0:
            continue
        reason, request = reasons[label]
        out.append(PinnedNode(label, node.op_type, tuple(node.output), floats, reason, request))
    return out


def trt_flags(
    plan: Plan, model: Model, *, also_pinned: Iterable[str] = (), types: Types | None = None,
) -> TrtFlags:
    """`--layerPrecisions` / `--layerOutputTypes` with `--precisionConstraints=obey`."""
    precisions: list[str] = []
    output_types: list[str] = []
    skipped: list[tuple[str, str]] = []
    notes: list[str] = []
    for p in pinned_nodes(plan, model, also_pinned=also_pinned, types=types):
        if "," in p.name or "'" in p.name:
            skipped.append((p.name, "trtexec splits layer lists on ',' and strips quotes"))
            continue
        if "*" in p.name:
            notes.append(f"'{p.name}': trtexec reads '*' as a wildcard; it may pin more layers")
        name = p.name if _PLAIN_NAME.match(p.name) else f"'{p.name}'"
        precisions.append(f"{name}:fp32")
        if p.float_outputs == len([o for o in p.outputs if o]):
            output_types.append(f"{name}:" + "+".join("fp32" for o in p.outputs if o))
        else:
            notes.append(f"'{p.name}' has non-float outputs: only its layer precision is set")
    flag = _TRT_BUILD_FLAG.get(plan.precision)
    args: list[str] = [flag] if flag else []
    if flag is None:
        notes.append(f"TensorRT has no build flag for {plan.precision}")
    layer_precisions = "--layerPrecisions=" + ",".join(precisions) if precisions else ""
    layer_output_types = "--layerOutputTypes=" + ",".join(output_types) if output_types else ""
    if precisions:
        args.append("--precisionConstraints=obey")
        args.append(layer_precisions)
    if output_types:
        args.append(layer_output_types)
    notes.append(TRT11_NOTE)
    return TrtFlags(tuple(args), layer_precisions, layer_output_types, tuple(skipped), tuple(notes))


def precision_yaml(
    plan: Plan, model: Model, *, also_pinned: Iterable[str] = (), types: Types | None = None,
) -> str:
    """Every node that computes floats -> its precision and the reason, in topological order.

    On the FP32 source model unpinned nodes take the target's precision; on a lowered model
    (one that already holds target-precision tensors) each node's stored type is read.
    """
    types = types if types is not None else tensor_types(model.proto)
    pinned = {p.name: p for p in pinned_nodes(plan, model, also_pinned=also_pinned, types=types)}
    target_type = get_format(plan.precision).onnx_type
    lowered = target_type in types.values()
    lines = [
        "# npuprep per-node precision: the precision each float node must run in, and why.",
        "# request: true marks pins the target's compiler decides itself (verify with crosscheck).",
        "schema_version: 1",
        "kind: precision",
        f"fingerprint: {_q(model.fingerprint)}",
        f"plan_fingerprint: {_q(plan.fingerprint)}",
        f"target: {_q(plan.target)}",
        f"default: {_q(plan.precision)}",
        f"note: {_q(TRT11_NOTE)}",
    ]
    entries: list[str] = []
    for node, scope in _nodes_in_order(model.proto):
        floats = [types[o] for o in node.output if o and types.get(o) in FLOAT_ONNX_TYPES]
        if not floats:
            continue
        label = node_label(node)
        p = pinned.get(label)
        if p is not None:
            precision, reason = "fp32", p.reason
        elif lowered:
            precision, reason = FLOAT_ONNX_TYPES[floats[0]], "as lowered"
        else:
            precision, reason = plan.precision, "target default"
        entries += [
            f"  - node: {_q(label)}",
            f"    op_type: {_q(node.op_type)}",
            f"    scope: {_q(scope)}",
            f"    precision: {_q(precision)}",
            f"    reason: {_q(reason)}",
        ]
        if p and p.request:
            entries.append("    request: true")
    lines.append("nodes:" if entries else "nodes: []")
    return "\n".join(lines + entries) + "\n"


def horizon_node_info(
    plan: Plan, model: Model, *, also_pinned: Iterable[str] = (), types: Types | None = None,
) -> str:
    """Horizon OpenExplorer overrides: XJ3/J5 `node_info` (CPU, float32) and J6 `node_config`.

    Confirm the accepted values with the OpenExplorer version in use: the J6 `qtype` for
    FP32 in particular varies between releases.
    """
    names = [p.name for p in pinned_nodes(plan, model, also_pinned=also_pinned, types=types)]
    node_info = {n: {"ON": "CPU"} for n in names}
    node_config = {n: {"qtype": "float32"} for n in names}
    return "\n".join([
        f"# npuprep FP32 pins for Horizon OpenExplorer (target {comment(plan.target)}, "
        f"model {comment(plan.fingerprint)}).",
        "# XJ3/J5 hb_mapper: put node_info under model_parameters (the CPU runs them in float32).",
        f"node_info: {json.dumps(node_info)}",
        "# J6 hb_compile: put node_config inside quant_config.",
        f"node_config: {json.dumps(node_config)}",
    ]) + "\n"


def rknn_custom_quantize_layers(
    plan: Plan, model: Model, *, also_pinned: Iterable[str] = (), types: Types | None = None,
) -> str:
    """RKNN hybrid quantisation entries (tensor -> float16) for the pinned nodes' outputs.

    RKNN's hybrid quantisation raises layers of an integer model to float16 at most; it has
    no FP32 setting, so for an FP16 target these pins can only be kept through the lowered
    ONNX's explicit Casts (the header says so).
    """
    types = types if types is not None else tensor_types(model.proto)
    lines = [
        f"# npuprep pins for RKNN hybrid quantisation (target {comment(plan.target)}, "
        f"model {comment(plan.fingerprint)}).",
        "# Merge into <model>.quantization.cfg before hybrid_quantization_step2.",
        "# RKNN has no FP32 layer setting: float16 is the most it grants.",
    ]
    entries = [
        f"    {json.dumps(o)}: float16"
        for p in pinned_nodes(plan, model, also_pinned=also_pinned, types=types) for o in p.outputs
        if o and types.get(o) in FLOAT_ONNX_TYPES
    ]
    lines.append("custom_quantize_layers:" if entries else "custom_quantize_layers: {}")
    return "\n".join(lines + entries) + "\n"


def trt_text(flags: TrtFlags, onnx_path: str = "model.onnx") -> str:
    """The trtexec command as a small shell file, with what it cannot carry as comments."""
    lines = ["# npuprep: keep the plan's FP32 nodes in FP32 on TensorRT 8.6 / 10.x."]
    lines += [f"# note: {comment(n)}" for n in flags.notes]
    lines += [f"# not expressible: {comment(name)} ({comment(why)})" for name, why in flags.skipped]
    return "\n".join([*lines, flags.command_line(onnx_path)]) + "\n"


def _pin_reason(action: PinFp32) -> str:
    word = "forced" if action.forced else "requested" if action.request else "pinned"
    # A pin without findings says why it was added (a verification round, lowering), not "user".
    causes = ", ".join(str(f) for f in action.findings) or action.why or "user"
    return f"{word} FP32: {causes}"


def _nodes_in_order(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, str]]:
    return [
        (node, scope.path)
        for scope in walk_graphs(model.graph)
        for node in topological_order(scope.graph)
    ]


def _q(text: str) -> str:
    """A YAML scalar that always reads back as the same string."""
    return json.dumps(text, ensure_ascii=False)
