"""Opset handling: models from opset 7 up are instrumented and emulated on an upgraded copy.

The statistics and emulation nodes are written for opset >= WORKING_OPSET. An older model is
upgraded for those internal graphs only, with onnx's version converter working on a
skeleton (large initialisers swapped for external references while it runs, so the weights
are never re-serialised, whatever the model's size); every tensor of the user's graph keeps
its name, so statistics and comparisons map back by name. The converted model that
`convert` writes keeps the model's own opset (rewrites emit opset-aware nodes) unless the
user asks for another.
"""

from __future__ import annotations

import onnx

from npuprep.errors import NpuprepError
from npuprep.graph import copy_fields, walk_graphs
from npuprep.model_io import model_opset

# The oldest opset the instrumentation and emulation graphs are written for (ReduceSum's
# axes input, Unsqueeze/Split with inputs, Cast to BF16).
WORKING_OPSET = 13

# The oldest opset onnx's version converter and onnxruntime both handle.
OLDEST_OPSET = 7

# Initialisers at or below this many bytes stay inline while converting: a converter adapter
# may read a small constant (a shape, a scale).
_SKELETON_INLINE_BYTES = 1024
_PLACEHOLDER = "npuprep-upgrade-placeholder"


def newest_opset() -> int:
    """The newest default-domain opset the installed onnx knows."""
    return int(onnx.defs.onnx_opset_version())


def check_opset_supported(model: onnx.ModelProto, where: str) -> None:
    """One clear error for an opset outside OLDEST_OPSET..newest_opset()."""
    opset = model_opset(model)
    if opset < OLDEST_OPSET or opset > newest_opset():
        raise NpuprepError(
            f"{where}: the model declares opset {opset}; npuprep supports opsets "
            f"{OLDEST_OPSET} to {newest_opset()} (the installed onnx's newest)"
        )


def at_least(model: onnx.ModelProto, opset: int, *, why: str) -> tuple[onnx.ModelProto, int | None]:
    """`model` itself when it declares `opset` or newer, else an upgraded copy; with the
    opset it was upgraded from (None when unchanged)."""
    old = model_opset(model)
    if old >= opset:
        return model, None
    return upgrade_opset(model, opset, why=why), old


def convert_opset(model: onnx.ModelProto, opset: int, *, why: str) -> onnx.ModelProto:
    """`model` at default-domain `opset` (up or down), checked by onnx.checker at that
    opset; one clear error when onnx's version converter has no way there."""
    if opset < OLDEST_OPSET or opset > newest_opset():
        raise NpuprepError(f"{why}: opset {opset} is outside {OLDEST_OPSET}..{newest_opset()}")
    if opset == model_opset(model):
        return model
    new = upgrade_opset(model, opset, why=why)
    try:
        onnx.checker.check_model(new)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0]
        raise NpuprepError(f"{why}: the model converted to opset {opset} is not valid ({first})") from None
    return new


def upgrade_opset(model: onnx.ModelProto, opset: int, *, why: str) -> onnx.ModelProto:
    """The model converted to `opset`, keeping every tensor name; a clear error otherwise."""
    from onnx import version_converter

    old = model_opset(model)
    skeleton, parked = _park_weights(model)
    try:
        new = version_converter.convert_version(skeleton, opset)
    except Exception as exc:  # noqa: BLE001 - the converter raises many kinds
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NpuprepError(
            f"{why}: the model declares opset {old} and onnx's version converter could not "
            f"convert it to {opset} ({first}); convert it yourself first"
        ) from None
    _drop_contradicted_shapes(new)
    _restore_weights(new, parked)
    _restore_renamed(model.graph, new.graph)
    before = {o for s in walk_graphs(model.graph) for n in s.graph.node for o in n.output if o}
    after = {o for s in walk_graphs(new.graph) for n in s.graph.node for o in n.output if o}
    missing = sorted(before - after)
    if missing:
        raise NpuprepError(
            f"{why}: converting opset {old} to {opset} lost tensor '{missing[0]}'; "
            "convert the model yourself first"
        )
    return new


def _restore_renamed(old: onnx.GraphProto, new: onnx.GraphProto) -> None:
    """Tensors an adapter renamed get their names back. The Upsample-9 -> Resize-10 adapter
    names its Resize's output afresh ('c' -> '_v_10') where 'c' is not a graph output: found
    through a reader of 'c' that kept its own output names, the slot it read 'c' at."""
    new_outputs = {o for n in new.node for o in n.output if o}
    old_names = {o for n in old.node for o in n.output if o} | {t.name for t in old.input} | {
        t.name for t in old.initializer}
    producer = {o: n for n in new.node for o in n.output if o}
    renames: dict[str, str] = {}
    for reader in old.node:
        kept = next((producer[o] for o in reader.output if o in producer), None)
        if kept is None or len(kept.input) != len(reader.input):
            continue
        for was, now in zip(reader.input, kept.input, strict=True):
            if was and was not in new_outputs and now and now not in old_names:
                renames.setdefault(now, was)
    if not renames:
        return
    for node in new.node:
        node.input[:] = [renames.get(i, i) for i in node.input]
        node.output[:] = [renames.get(o, o) for o in node.output]
    for info in new.value_info:
        info.name = renames.get(info.name, info.name)


def _drop_contradicted_shapes(model: onnx.ModelProto) -> None:
    """Declared shapes (graph outputs, value_info) that the new opset's shape inference
    contradicts are replaced by the inferred ones. An exporter's stale shape (ddddocr's
    output declared [1, seqlen], computed [20, 1, 8210]) only draws a warning from
    onnxruntime, but newer opsets infer through it and onnx's checker then refuses the model."""
    try:
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
        return
    except onnx.shape_inference.InferenceError as exc:
        if "existing shape differ" not in str(exc):
            return
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    for info in (*bare.graph.output, *bare.graph.value_info):
        info.type.tensor_type.ClearField("shape")
    inferred = onnx.shape_inference.infer_shapes(bare)
    found = {v.name: v.type.tensor_type for v in (*inferred.graph.output, *inferred.graph.value_info)}
    for info in (*model.graph.output, *model.graph.value_info):
        declared, got = info.type.tensor_type, found.get(info.name)
        if (got is not None and declared.HasField("shape") and got.HasField("shape")
                and _contradicts(declared.shape, got.shape)):
            declared.shape.CopyFrom(got.shape)


def _contradicts(declared: onnx.TensorShapeProto, inferred: onnx.TensorShapeProto) -> bool:
    """Ranks differ, or a dim both fix to different sizes."""
    if len(declared.dim) != len(inferred.dim):
        return True
    return any(a.HasField("dim_value") and b.HasField("dim_value") and a.dim_value != b.dim_value
               for a, b in zip(declared.dim, inferred.dim, strict=True))


def _park_weights(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, onnx.TensorProto]]:
    """A copy whose large inline initialisers (every scope) are external placeholders, and
    the originals by location key. Main-graph weights are never copied."""
    parked: dict[str, onnx.TensorProto] = {}

    def park(init: onnx.TensorProto, slot: onnx.TensorProto) -> None:
        key = f"{_PLACEHOLDER}:{len(parked)}"
        parked[key] = init
        slot.name, slot.data_type = init.name, init.data_type
        slot.dims.extend(init.dims)
        slot.data_location = onnx.TensorProto.EXTERNAL
        entry = slot.external_data.add()
        entry.key, entry.value = "location", key

    skeleton = onnx.ModelProto()
    copy_fields(model, skeleton, skip="graph")
    copy_fields(model.graph, skeleton.graph, skip="initializer")
    for init in model.graph.initializer:
        if _inline_large(init):
            park(init, skeleton.graph.initializer.add())
        else:
            skeleton.graph.initializer.append(init)
    for scope in walk_graphs(skeleton.graph):
        if scope.is_main:
            continue
        for init in scope.graph.initializer:
            if _inline_large(init):
                original = onnx.TensorProto()
                original.CopyFrom(init)
                init.Clear()
                park(original, init)
    return skeleton, parked


def _inline_large(init: onnx.TensorProto) -> bool:
    return init.data_location != onnx.TensorProto.EXTERNAL and init.ByteSize() > _SKELETON_INLINE_BYTES


def _restore_weights(model: onnx.ModelProto, parked: dict[str, onnx.TensorProto]) -> None:
    for scope in walk_graphs(model.graph):
        for init in scope.graph.initializer:
            if init.data_location != onnx.TensorProto.EXTERNAL:
                continue
            location = next((e.value for e in init.external_data if e.key == "location"), "")
            if location in parked:
                init.CopyFrom(parked[location])


def bf16_opset(model: onnx.ModelProto, skip: frozenset[str] = frozenset()) -> int:
    """The lowest default-domain opset, the model's own or newer, in which every op the model
    uses (but `skip`, ops lowering keeps FP32) takes BF16 wherever it takes FP32: ONNX added
    BF16 op by op (Add 13, Pow's exponent 15, Where 16, Conv 22). None newer than the
    installed onnx knows; an op that never takes BF16 does not count."""
    current = model_opset(model)
    ops = {n.op_type for s in walk_graphs(model.graph) for n in s.graph.node
           if n.domain in ("", "ai.onnx") and n.op_type not in skip}
    need = current
    for op in sorted(ops):
        since = next((v for v in range(current, newest_opset() + 1) if _takes_bf16(op, v)), None)
        if since is not None:
            need = max(need, since)
    return need


def _takes_bf16(op: str, opset: int) -> bool:
    """Whether `op` at `opset` lists tensor(bfloat16) in every type constraint with float."""
    try:
        schema = onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return False
    return all("tensor(bfloat16)" in c.allowed_type_strs for c in schema.type_constraints
               if "tensor(float)" in c.allowed_type_strs)
