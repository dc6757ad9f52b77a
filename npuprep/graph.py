"""Read-only views of an ONNX graph: subgraph walk, producers, consumers, constants, order."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from npuprep.errors import NpuprepError
from npuprep.numerics import FLOAT_ONNX_TYPES


@dataclass(frozen=True)
class GraphScope:
    """One graph in a model: the main graph or a body of an If/Loop/Scan node.

    `path` reads like `main` or `main/If_3.then_branch`, so findings inside bodies can be
    located.
    """

    graph: onnx.GraphProto
    path: str
    owner: onnx.NodeProto | None = None

    @property
    def is_main(self) -> bool:
        return self.owner is None


def walk_graphs(graph: onnx.GraphProto, path: str = "main") -> Iterator[GraphScope]:
    """The graph and every subgraph beneath it, depth first."""
    yield GraphScope(graph, path)
    for node in graph.node:
        for attr in node.attribute:
            subs: list[onnx.GraphProto] = []
            if attr.type == onnx.AttributeProto.GRAPH:
                subs = [attr.g]
            elif attr.type == onnx.AttributeProto.GRAPHS:
                subs = list(attr.graphs)
            for i, sub in enumerate(subs):
                suffix = attr.name if len(subs) == 1 else f"{attr.name}[{i}]"
                for scope in walk_graphs(sub, f"{path}/{node_label(node)}.{suffix}"):
                    if scope.owner is None:
                        scope = GraphScope(scope.graph, scope.path, node)
                    yield scope


def node_scopes(graph: onnx.GraphProto) -> dict[str, tuple[onnx.NodeProto, tuple[onnx.GraphProto, ...]]]:
    """Node label -> the node and the graphs its inputs may name: its own graph first, then
    each enclosing one out to `graph` (a body reads the weights its owner's scope holds). A
    label several scopes use is the first one's in walk_graphs' order."""
    found: dict[str, tuple[onnx.NodeProto, tuple[onnx.GraphProto, ...]]] = {}

    def visit(g: onnx.GraphProto, outer: tuple[onnx.GraphProto, ...]) -> None:
        chain = (g, *outer)
        for node in g.node:
            found.setdefault(node_label(node), (node, chain))
        for node in g.node:
            for attr in node.attribute:
                for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                    visit(sub, chain)

    visit(graph, ())
    return found


def scope_constant(chain: Sequence[onnx.GraphProto], name: str) -> np.ndarray | None:
    """`name`'s constant value as the first graph of `chain` (a body, then the graphs around
    it) that holds it gives it, else None."""
    for g in chain:
        value = constant_value(g, name)
        if value is not None:
            return value
    return None


def node_label(node: onnx.NodeProto) -> str:
    """A node's name, or a stable stand-in built from its first output (as TensorRT does)."""
    if node.name:
        return node.name
    first = next((o for o in node.output if o), "")
    return f"node_of_{first}" if first else f"{node.op_type}_unnamed"


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """Tensor name -> the node that writes it (this graph only)."""
    return {out: node for node in graph.node for out in node.output if out}


def consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Tensor name -> nodes that read it, including reads from inside their subgraphs."""
    result: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in dict.fromkeys(list(node.input) + sorted(_captured_names(node))):
            if name:
                result.setdefault(name, []).append(node)
    return result


def node_reads(node: onnx.NodeProto) -> list[str]:
    """Every tensor a node reads: its inputs, then what its subgraphs read from outside."""
    return [i for i in dict.fromkeys([*node.input, *sorted(_captured_names(node))]) if i]


def _captured_names(node: onnx.NodeProto) -> set[str]:
    """Outer-scope names a node's subgraphs read without declaring them."""
    names: set[str] = set()
    for attr in node.attribute:
        subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for sub in subs:
            local = {i.name for i in sub.input} | {i.name for i in sub.initializer}
            local |= {o for n in sub.node for o in n.output}
            for n in sub.node:
                names |= {i for i in n.input if i and i not in local}
                names |= _captured_names(n) - local
            names |= {o.name for o in sub.output if o.name not in local}
    return names


def initializers(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {init.name: init for init in graph.initializer}


def without_weight_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """`model` (a copy where it changes) with no graph input that is also a main-graph
    initialiser, and those inputs' names. Old exporters listed every weight as an input too
    (an overridable default); a weight rewritten under a new name would leave such an input
    with no value, required by onnxruntime and fed by no sample."""
    weights = {i.name for i in model.graph.initializer}
    listed = [i.name for i in model.graph.input if i.name in weights]
    if not listed:
        return model, []
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    kept = [i for i in copy.graph.input if i.name not in weights]
    del copy.graph.input[:]
    copy.graph.input.extend(kept)
    return copy, listed


def constant_value(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    """The value of a tensor that is an initialiser or a Constant node's output, or a Cast
    of one to FP32 (how BF16 exports store weights), else None."""
    for node in graph.node:
        if node.op_type == "Cast" and node.output and node.output[0] == name and node.input:
            if attribute(node, "to") != onnx.TensorProto.FLOAT:
                return None
            source = constant_value(graph, node.input[0])
            return None if source is None else source.astype(np.float32)
    for init in graph.initializer:
        if init.name == name:
            return to_array(init)
    for node in graph.node:
        if node.op_type == "Constant" and node.output and node.output[0] == name:
            return constant_node_value(node)
    return None


def constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    """A Constant node's value (a tensor, or a float/int scalar or list), else None."""
    for attr in node.attribute:
        if attr.name == "value":
            return to_array(attr.t)
        if attr.name == "value_float":
            return np.array(attr.f, dtype=np.float32)
        if attr.name == "value_floats":
            return np.array(list(attr.floats), dtype=np.float32)
        if attr.name == "value_int":
            return np.array(attr.i, dtype=np.int64)
        if attr.name == "value_ints":
            return np.array(list(attr.ints), dtype=np.int64)
    return None


def to_array(tensor: onnx.TensorProto) -> np.ndarray:
    """A TensorProto as numpy; BF16 and FP8 come back in their ml_dtypes types. A tensor
    anchored to its file (external data at an absolute location, see
    npuprep.model_io.anchored) is read from there, so a weight is only in memory while a
    stage uses it."""
    if is_anchored(tensor):
        return _read_array(tensor)
    return numpy_helper.to_array(tensor)


# Element types whose stored bytes are a numpy array's as they are (little-endian).
_PLAIN_TYPES = {t: np.dtype(d) for t, d in (
    (onnx.TensorProto.FLOAT, np.float32), (onnx.TensorProto.FLOAT16, np.float16),
    (onnx.TensorProto.DOUBLE, np.float64), (onnx.TensorProto.INT8, np.int8),
    (onnx.TensorProto.UINT8, np.uint8), (onnx.TensorProto.INT16, np.int16),
    (onnx.TensorProto.UINT16, np.uint16), (onnx.TensorProto.INT32, np.int32),
    (onnx.TensorProto.UINT32, np.uint32), (onnx.TensorProto.INT64, np.int64),
    (onnx.TensorProto.UINT64, np.uint64), (onnx.TensorProto.BOOL, np.bool_))}


def _read_array(tensor: onnx.TensorProto) -> np.ndarray:
    """An anchored tensor's values read from its file straight into an array (one copy: a
    TensorProto in between cost three on a 2.4 GB model); other types through onnx."""
    dtype = _PLAIN_TYPES.get(tensor.data_type)
    location, offset, length = external_info(tensor)
    count = math.prod(tensor.dims)
    if dtype is None or sys.byteorder != "little" or (length is not None and length != count * dtype.itemsize):
        return numpy_helper.to_array(read_in(tensor))
    values = np.empty(tuple(tensor.dims), dtype)
    with open(location, "rb") as fh:
        fh.seek(offset)
        got = fh.readinto(values.reshape(-1).view(np.uint8))
    if got != values.nbytes:
        raise NpuprepError(f"{location}: tensor '{tensor.name}' needs {values.nbytes} bytes at offset "
                           f"{offset}, the file holds {got}")
    return values


def is_anchored(tensor: onnx.TensorProto) -> bool:
    """External data at an absolute location: a weight left in the user's file."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return False
    location = next((e.value for e in tensor.external_data if e.key == "location"), "")
    return location.startswith("/")


def name_maker(graph: onnx.GraphProto) -> Callable[[str], str]:
    """A function giving names no tensor, node or input of `graph` or its bodies uses yet
    (`base`, then `base_1`, ...), each name once: a body's new tensor must not shadow an outer
    one, and a new node or subgraph may take one too."""
    names = {n for scope in walk_graphs(graph) for node in scope.graph.node
             for n in (*node.input, *node.output, node.name)}
    names |= {i.name for scope in walk_graphs(graph) for i in scope.graph.initializer}
    names |= {i.name for scope in walk_graphs(graph) for i in scope.graph.input}

    def fresh(base: str) -> str:
        name, i = base, 1
        while name in names:
            name, i = f"{base}_{i}", i + 1
        names.add(name)
        return name

    return fresh


def with_values(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with its anchored tensors' bytes read in (a copy; `model` itself when none
    is): for a tool that reads the file on its own."""
    if not any(is_anchored(t) for t in onnx.external_data_helper._get_all_tensors(model)):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for tensor in onnx.external_data_helper._get_all_tensors(copy):
        if is_anchored(tensor):
            tensor.CopyFrom(read_in(tensor))
    return copy


def unanchored(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` for onnx's checker, which refuses absolute external locations: each
    anchored main-graph initialiser becomes a graph input of its type and shape (what the
    checker and shape inference read of it), any other anchored tensor is read in."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    inputs = {i.name for i in copy.graph.input}
    kept = []
    for init in copy.graph.initializer:
        if not is_anchored(init):
            kept.append(init)
        elif init.name not in inputs:
            copy.graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    if len(kept) != len(copy.graph.initializer):
        del copy.graph.initializer[:]
        copy.graph.initializer.extend(kept)
    for tensor in onnx.external_data_helper._get_all_tensors(copy):
        if is_anchored(tensor):
            tensor.CopyFrom(read_in(tensor))
    return copy


def external_info(tensor: onnx.TensorProto) -> tuple[str, int, int | None]:
    """(location, offset, length or None) of a tensor stored as external data."""
    info = {e.key: e.value for e in tensor.external_data}
    length = info.get("length")
    return info["location"], int(info.get("offset", 0)), int(length) if length is not None else None


def read_in(tensor: onnx.TensorProto, folder: str = "") -> onnx.TensorProto:
    """A copy of an external tensor with its bytes read into raw_data (its location
    relative to `folder`, or absolute)."""
    location, offset, length = external_info(tensor)
    with open(f"{folder}/{location}" if folder and not location.startswith("/") else location,
              "rb") as fh:
        fh.seek(offset)
        data = fh.read(length) if length is not None else fh.read()
    loaded = onnx.TensorProto()
    loaded.CopyFrom(tensor)
    loaded.ClearField("data_location")  # as a tensor that was never external serialises
    del loaded.external_data[:]
    loaded.raw_data = data
    return loaded


def attribute(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return default


# Initialisers up to this many bytes keep their values in the inference skeleton (Reshape
# shapes, axes, scalars); larger ones become typed inputs, so weights are never serialised.
_SKELETON_KEEP_BYTES = 64 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Tensor name -> element type; -> shape where every dimension is known; -> dims with
    None for a symbolic dimension."""

    types: dict[str, int]
    shapes: dict[str, tuple[int, ...]]
    dims: dict[str, tuple[int | None, ...]]


def infer_tensors(model: onnx.ModelProto) -> TensorInfo:
    """Types and shapes of every tensor in all scopes (best effort, never raises).

    onnx's shape inference serialises the whole model, which for hundreds of MB costs
    seconds and fails past 2 GB; it runs on a weightless skeleton instead, where large
    initialisers are typed graph inputs of the same shape.
    """
    inferred = inferred_with_schema_types(weightless(model), _inferred)
    types: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dims: dict[str, tuple[int | None, ...]] = {}
    for scope in walk_graphs(inferred.graph):
        g = scope.graph
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if not vi.type.HasField("tensor_type"):
                continue
            tt = vi.type.tensor_type
            if tt.elem_type:
                types[vi.name] = tt.elem_type
            if tt.HasField("shape"):
                # A negative size (Paddle2ONNX writes -1 for a dynamic batch) is no size.
                d = tuple(x.dim_value if x.HasField("dim_value") and x.dim_value >= 0 else None
                          for x in tt.shape.dim)
                dims[vi.name] = d
                if None not in d:
                    shapes[vi.name] = d  # type: ignore[assignment]
        for node in g.node:
            if node.op_type == "Constant":
                for attr in node.attribute:
                    if attr.name == "value":
                        types[node.output[0]] = attr.t.data_type
    for scope in walk_graphs(model.graph):
        for init in scope.graph.initializer:
            types[init.name] = init.data_type
            shapes[init.name] = dims[init.name] = tuple(init.dims)
    return TensorInfo(types, shapes, dims)


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor whose type is known (after shape inference), all scopes."""
    return infer_tensors(model).types


def _inferred(skeleton: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(skeleton, strict_mode=False, data_prop=False)
    except Exception:  # noqa: BLE001 - inference is best effort on exotic models
        return skeleton


def inferred_with_schema_types(skeleton: onnx.ModelProto,
                               infer: Callable[[onnx.ModelProto], onnx.ModelProto]) -> onnx.ModelProto:
    """`infer`(skeleton), run again where onnx typed no output of a node (GroupNormalization-21
    in onnx 1.23) and so nothing after it: such outputs are declared first with the type their
    schema's type parameter takes from a typed input (`skeleton` gains those declarations)."""
    inferred = infer(skeleton)
    hinted = same_type_outputs(inferred.graph, skeleton.opset_import)
    if not hinted:
        return inferred
    skeleton.graph.value_info.extend(onnx.helper.make_tensor_value_info(name, elem, None)
                                     for name, elem in hinted.items())
    return infer(skeleton)


def same_type_outputs(graph: onnx.GraphProto, opsets: Sequence[onnx.OperatorSetIdProto]
                       ) -> dict[str, int]:
    """Main-graph node outputs inference left untyped whose schema gives them the type
    parameter of an input whose type is known (`T` in, `T` out), in node order."""
    typed = {vi.name: vi.type.tensor_type.elem_type
             for vi in (*graph.input, *graph.output, *graph.value_info)
             if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type}
    typed.update({i.name: i.data_type for i in graph.initializer})
    versions = {o.domain or "": o.version for o in opsets}
    found: dict[str, int] = {}
    for node in graph.node:
        if all(not o or o in typed for o in node.output):
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, versions.get(node.domain or "", 1),
                                          node.domain or "")
        except onnx.defs.SchemaError:
            continue
        for name, formal in zip(node.output, schema.outputs, strict=False):
            source = next((i for i, f in zip(node.input, schema.inputs, strict=False)
                           if i in typed and f.type_str == formal.type_str), None)
            if name and name not in typed and source is not None:
                typed[name] = found[name] = typed[source]
    return found


# A schema output's type string -> its element type, where the string names one type.
_FIXED_TENSOR_TYPES = {"tensor(float)": onnx.TensorProto.FLOAT, "tensor(double)": onnx.TensorProto.DOUBLE,
                       "tensor(int64)": onnx.TensorProto.INT64, "tensor(string)": onnx.TensorProto.STRING}


def weightless(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` for shape inference: small initialisers kept, large ones become
    typed graph inputs of the same shape (no weight bytes copied)."""
    out = onnx.ModelProto()
    for name in ("ir_version", "producer_name", "domain", "model_version"):
        setattr(out, name, getattr(model, name))
    out.opset_import.extend(model.opset_import)
    out.functions.extend(model.functions)
    g, src = out.graph, model.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    g.value_info.extend(src.value_info)
    declared = {vi.name for vi in src.input}
    for init in src.initializer:
        if tensor_nbytes(init) <= _SKELETON_KEEP_BYTES:
            g.initializer.append(init)
        elif init.name not in declared:
            g.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    typed = {vi.name for vi in (*src.input, *src.output, *src.value_info)}
    g.value_info.extend(onnx.helper.make_tensor_value_info(name, elem_type, None)
                        for name, elem_type in _schema_typed_outputs(src, out.opset_import)
                        if name not in typed)
    return out


def _schema_typed_outputs(graph: onnx.GraphProto, opsets: Sequence[onnx.OperatorSetIdProto]
                          ) -> Iterator[tuple[str, int]]:
    """(tensor, element type) of main-graph node outputs whose op's schema fixes one type but
    gives no inference: ai.onnx.ml's Scaler, Imputer, Normalizer always write float, and
    without the type onnx's inference stops there (skl2onnx's Scaler -> Sub -> MatMul)."""
    versions = {o.domain or "": o.version for o in opsets}
    for node in graph.node:
        domain = node.domain or ""
        if domain != "ai.onnx.ml" or domain not in versions:
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, versions[domain], domain)
        except onnx.defs.SchemaError:
            continue
        for name, formal in zip(node.output, schema.outputs, strict=False):
            elem = _FIXED_TENSOR_TYPES.get(formal.type_str)
            if name and elem is not None:
                yield name, elem


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the main graph's initialisers, wherever they are stored."""
    return sum(tensor_nbytes(i) for i in model.graph.initializer)


def tensor_nbytes(tensor: onnx.TensorProto) -> int:
    """Size of a tensor's data from its dims, wherever its bytes are (ByteSize() fails on a
    >2 GB tensor and counts no external data)."""
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        itemsize = 8
    return int(np.prod(tensor.dims, dtype=np.int64)) * itemsize


def float_tensor_names(model: onnx.ModelProto, graph: onnx.GraphProto | None = None) -> list[str]:
    """Float activations of one graph (inputs, node outputs) in topological order."""
    graph = graph if graph is not None else model.graph
    types = tensor_types(model)
    inits = {i.name for i in graph.initializer}
    names: list[str] = []
    for vi in graph.input:
        if vi.name not in inits and types.get(vi.name) in FLOAT_ONNX_TYPES:
            names.append(vi.name)
    for node in graph.node:
        if node.op_type == "Constant":
            continue
        for out in node.output:
            if out and types.get(out) in FLOAT_ONNX_TYPES:
                names.append(out)
    return names


def topological_order(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Nodes in a topological order, stable with respect to the file's order."""
    produced_by = producers(graph)
    order: list[onnx.NodeProto] = []
    seen: set[int] = set()
    index = {id(n): i for i, n in enumerate(graph.node)}

    def visit(node: onnx.NodeProto) -> None:
        stack = [(node, False)]
        while stack:
            current, expanded = stack.pop()
            key = id(current)
            if key in seen:
                continue
            if expanded:
                seen.add(key)
                order.append(current)
                continue
            stack.append((current, True))
            deps = [produced_by[i] for i in list(current.input) + sorted(_captured_names(current))
                    if i in produced_by]
            for dep in sorted(deps, key=lambda d: -index[id(d)]):
                if id(dep) not in seen:
                    stack.append((dep, False))

    for node in graph.node:
        visit(node)
    return order


def copy_fields(src, dst, skip: str) -> None:  # noqa: ANN001 - any protobuf message pair
    """Copy every set field of `src` into `dst` but `skip`: a whole-model CopyFrom would
    copy the weights too."""
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        target = getattr(dst, fd.name)
        if type(value).__name__.startswith("Repeated"):
            target.extend(value)
        elif hasattr(value, "CopyFrom"):
            target.CopyFrom(value)
        else:
            setattr(dst, fd.name, value)
