"""Typed graph-surgeon helpers shared by the rewrites: import, look-ups, constants, checked export."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from npuprep.errors import NpuprepError
from npuprep.graph import to_array, unanchored
from npuprep.model_io import PROTOBUF_LIMIT

# Graph surgeon logs its warnings (a BF16 initialiser it cannot type) on stdout, which would
# break `--json`; npuprep reports what matters itself.
gs.logger.G_LOGGER.severity = gs.logger.G_LOGGER.ERROR


def import_graph(model: onnx.ModelProto) -> gs.Graph:
    """The model's main graph as a graph-surgeon Graph (the input proto is not touched)."""
    return gs.import_onnx(model)


def export_model(graph: gs.Graph, like: onnx.ModelProto) -> onnx.ModelProto:
    """Export `graph` into a copy of `like`, keeping its IR version, opsets and metadata.

    Stale value_info is dropped: rewrites change which node writes a tensor, and the
    checker re-infers shapes anyway.
    """
    exported = gs.export_onnx(graph, do_type_check=False)
    out = onnx.ModelProto()
    out.CopyFrom(like)
    out.graph.CopyFrom(exported.graph)
    del out.graph.value_info[:]
    return out


def check_model(model: onnx.ModelProto) -> None:
    """onnx.checker with shape inference; models past the protobuf limit are checked from disk.

    A failure here is a bug in a rewrite, not a user mistake, so it keeps its traceback.
    """
    if model.ByteSize() < PROTOBUF_LIMIT - 64 * 2**20:
        onnx.checker.check_model(unanchored(model), full_check=True)
        return
    with tempfile.TemporaryDirectory(prefix="npuprep-check-") as tmp:
        path = os.path.join(tmp, "model.onnx")
        onnx.save_model(model, path, save_as_external_data=True, location="model.onnx.data")
        onnx.checker.check_model(path, full_check=True)


def node_label(node: gs.Node) -> str:
    """A node's name, or `node_of_<first output>` (the same stand-in npuprep.graph uses)."""
    if node.name:
        return node.name
    first = next((t.name for t in node.outputs if t.name), "")
    return f"node_of_{first}" if first else f"{node.op}_unnamed"


def find_node(graph: gs.Graph, label: str) -> gs.Node | None:
    """The main-graph node whose label is `label`, else None."""
    return next((n for n in graph.nodes if node_label(n) == label), None)


def require_node(graph: gs.Graph, label: str, what: str) -> gs.Node:
    node = find_node(graph, label)
    if node is None:
        raise NpuprepError(f"{what}: node '{label}' not found in the main graph")
    return node


def producer(tensor: gs.Tensor) -> gs.Node | None:
    return tensor.inputs[0] if tensor.inputs else None


def graph_input(graph: gs.Graph, name: str) -> gs.Variable | None:
    return next((t for t in graph.inputs if t.name == name), None)


def is_graph_output(graph: gs.Graph, tensor: gs.Tensor) -> bool:
    return any(t is tensor for t in graph.outputs)


def main_consumers(graph: gs.Graph, tensor: gs.Tensor) -> tuple[list[gs.Node], bool]:
    """Consumers of `tensor` in the main graph, and whether a subgraph body also reads it."""
    own = {id(n) for n in graph.nodes}
    nodes = [n for n in tensor.outputs if id(n) in own]
    return nodes, len(nodes) != len(tensor.outputs)


def sole_reader(graph: gs.Graph, tensor: gs.Tensor) -> gs.Node | None:
    """The one main-graph node reading `tensor`, when nothing else does (no other node, no
    subgraph body, not a graph output), else None."""
    readers, in_body = main_consumers(graph, tensor)
    if len(readers) != 1 or in_body or is_graph_output(graph, tensor):
        return None
    return readers[0]


def scalar_operand(node: gs.Node, index: int, attr: str) -> float | None:
    """A one-element constant given as input `index` (newer opsets) or as attribute `attr`
    (older ones, e.g. Clip's min/max before opset 11), else None."""
    if len(node.inputs) > index and node.inputs[index].name:
        value = const_value(node.inputs[index])
        return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None
    return float(node.attrs[attr]) if attr in node.attrs else None


def const_value(tensor: gs.Tensor) -> np.ndarray | None:
    """The value of an initialiser or a Constant node's output, else None."""
    if isinstance(tensor, gs.Constant):
        # Read an untouched initialiser from its proto: graph surgeon mis-reads BF16 data.
        proto = getattr(getattr(tensor, "_values", None), "tensor", None)
        if isinstance(proto, onnx.TensorProto):
            return to_array(proto)
        return np.asarray(tensor.values)
    node = producer(tensor)
    if node is not None and node.op in ("Cast", "Identity") and node.inputs:
        # A weight stored in another type (BF16 export) and cast in-graph is still a constant.
        inner = const_value(node.inputs[0])
        if inner is None or node.op == "Identity":
            return inner
        to = onnx.helper.tensor_dtype_to_np_dtype(int(node.attrs.get("to", 0)))
        return inner.astype(to) if is_float_dtype(inner.dtype) and is_float_dtype(to) else None
    if node is None or node.op != "Constant":
        return None
    attrs = node.attrs
    if "value" in attrs and isinstance(attrs["value"], gs.Constant):
        return np.asarray(attrs["value"].values)
    if "value_float" in attrs:
        return np.array(attrs["value_float"], dtype=np.float32)
    if "value_floats" in attrs:
        return np.array(list(attrs["value_floats"]), dtype=np.float32)
    return None


def is_float_dtype(dtype: np.dtype) -> bool:
    """numpy floats and the ml_dtypes ones (bfloat16, float8_*), which numpy sees as void."""
    return dtype.kind == "f" or dtype.name.startswith(("bfloat16", "float8"))


def is_float_array(value: np.ndarray | None) -> bool:
    return value is not None and is_float_dtype(value.dtype)


def exact_pow2_scale(value: np.ndarray, exponent: int) -> np.ndarray | None:
    """`value * 2**exponent` in its own dtype, or None if that is not exact (over/underflow)."""
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = (value.astype(np.float64) * 2.0**exponent).astype(value.dtype)
        back = scaled.astype(np.float64) * 2.0**-exponent
    if not np.array_equal(back, value.astype(np.float64), equal_nan=True):
        return None
    return scaled


def replace_input(node: gs.Node, index: int, tensor: gs.Tensor) -> None:
    """Point one input of `node` at `tensor` (graph surgeon keeps both link directions)."""
    node.inputs[index] = tensor


def set_values(constant: gs.Constant, value: np.ndarray) -> None:
    """Give an initialiser new values, held in the graph: one that was external data
    (left in the user's file) no longer is."""
    constant.values = value
    constant.data_location = None


def set_constant_input(
    node: gs.Node, index: int, value: np.ndarray, name: str, cache: dict[str, gs.Constant]
) -> None:
    """Give `node` a constant input holding `value`.

    An initialiser read only by this node is edited in place and keeps its name; a shared
    one (or a Constant node's output) is left alone and `node` gets a copy named `name`,
    made once per name.
    """
    current = node.inputs[index]
    if isinstance(current, gs.Constant) and len(current.outputs) == 1:
        set_values(current, value)
        return
    if name not in cache:
        cache[name] = gs.Constant(name, np.ascontiguousarray(value))
    replace_input(node, index, cache[name])


def np_dtype(dtype: object) -> np.dtype:
    """A tensor's dtype as numpy: graph surgeon keeps types numpy lacks (BF16, FP8) as the
    ONNX enum."""
    if isinstance(dtype, int):
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(dtype))
    return np.dtype(dtype)


def scalar(name: str, value: float, dtype: np.dtype | type = np.float32) -> gs.Constant:
    return gs.Constant(name, np.array(value, dtype=dtype))


def unique_name(graph: gs.Graph, base: str) -> str:
    """`base` if no tensor or node uses it yet, else `base_2`, `base_3`, ... (deterministic)."""
    taken = set(graph.tensors().keys()) | {n.name for n in graph.nodes}
    if base not in taken:
        return base
    i = 2
    while f"{base}_{i}" in taken:
        i += 1
    return f"{base}_{i}"


def finish(graph: gs.Graph, like: onnx.ModelProto,
           run_checker: bool = True) -> onnx.ModelProto:
    """Clean up once, sort, export into a copy of `like` and run the checker unless
    `run_checker` is False (a caller that checks once after a series of rewrites, or one
    that only reads the rewrite's details)."""
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    model = export_model(graph, like)
    if run_checker:
        check_model(model)
    return model
