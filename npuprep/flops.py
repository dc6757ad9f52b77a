"""FLOPs per node from inferred shapes; npuprep.verify.fp32_share turns them into the FP32 share.

A model with dynamic axes (a recogniser's width, a detector's image size) has no FLOPs until
its inputs have sizes: pass those of a real sample (`input_shapes`), or a 3x32xW Conv stack
counts one output element per Conv and its FP32 share means nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from npuprep.graph import attribute, node_label, walk_graphs, weightless
from npuprep.ops import RECURRENT_GATES, RECURRENT_OPS, SHAPE_ARITHMETIC_OPS

DATA_PROP_ELEMENTS = 2 ** 24
# Shape arithmetic is a few int64 values; a tensor larger than this is data, not a shape.
FOLD_ELEMENTS = 64
# Each round sizes what the last round's values unlock (a Where, then the Reshape after it).
FOLD_ROUNDS = 4


def _shapes(model: onnx.ModelProto,
            input_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, tuple[int, ...]]:
    # Weightless: inference serialises the model, and its weights are not needed.
    model = _with_input_shapes(model, input_shapes or {})
    # Data propagation (shapes computed by Shape/Gather/Concat chains) holds values as big as
    # the inputs: a rank-1 input of 2^26 elements took 9.7 GB. Above DATA_PROP_ELEMENTS it is
    # left out and shapes only data could give stay unknown.
    largest = max((math.prod(s) for s in (input_shapes or {}).values()), default=0)
    data_prop = largest <= DATA_PROP_ELEMENTS
    inferred = _infer(model, data_prop)
    for _ in range(FOLD_ROUNDS if data_prop else 0):
        folded = _fold_shape_values(inferred)
        if not folded:
            break
        model = _with_values(model, folded)
        inferred = _infer(model, data_prop)
    shapes: dict[str, tuple[int, ...]] = {}
    for scope in walk_graphs(inferred.graph):
        g = scope.graph
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            dims = vi.type.tensor_type.shape.dim
            if all(d.HasField("dim_value") for d in dims):
                shapes[vi.name] = tuple(d.dim_value for d in dims)
        for init in g.initializer:
            shapes[init.name] = tuple(init.dims)
    return shapes


def _infer(model: onnx.ModelProto, data_prop: bool) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=data_prop)
    except Exception:  # noqa: BLE001 - best effort; unknown shapes count as one element
        return model


def _fold_shape_values(inferred: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Values of the main graph's small integer tensors that shape inference's data
    propagation does not compute (it knows no Where, Equal, Range...), evaluated from the
    shapes it did infer: a ViT's `Expand(cls_token, Where(Equal(shape, -1), 1, shape))`
    and the Reshapes after it are sized only by them."""
    g = inferred.graph
    sized = {vi.name: vi for vi in (*g.input, *g.value_info, *g.output)
             if all(d.HasField("dim_value") for d in vi.type.tensor_type.shape.dim)}
    # Small float constants too: a patch count computed through Sqrt or Div of floats. Bytes
    # in an external file are weights, never shape arithmetic.
    values: dict[str, np.ndarray] = {
        i.name: numpy_helper.to_array(i) for i in g.initializer
        if math.prod(i.dims) <= FOLD_ELEMENTS and i.data_location != onnx.TensorProto.EXTERNAL}
    needed = _feeding_unsized(g, sized)
    folded: dict[str, np.ndarray] = {}
    for node in g.node:
        if not node.output or node.output[0] in values or node.output[0] not in needed:
            continue
        if node.op_type == "Shape" and node.input[0] in sized:
            dims = [d.dim_value for d in sized[node.input[0]].type.tensor_type.shape.dim]
            start, end = attribute(node, "start", 0), attribute(node, "end", None)
            values[node.output[0]] = np.asarray(dims[start:end], np.int64)
            continue
        if node.op_type not in SHAPE_ARITHMETIC_OPS or any(i and i not in values for i in node.input):
            continue
        try:
            got = ReferenceEvaluator(_one_node(node, inferred.opset_import)).run(
                None, {i: values[i] for i in node.input if i})
        except Exception:  # noqa: BLE001 - a node the reference cannot run stays unknown
            continue
        for name, value in zip(node.output, got, strict=False):
            value = np.asarray(value)
            if value.dtype.kind in "iubf" and value.size <= FOLD_ELEMENTS:
                values[name] = value
                if value.dtype.kind != "f":
                    folded[name] = value
    return folded


def _feeding_unsized(graph: onnx.GraphProto, sized: Mapping[str, object]) -> set[str]:
    """The tensors an unsized node's inputs are computed from (only those are worth a value)."""
    producer = {o: n for n in graph.node for o in n.output if o}
    todo = [i for n in graph.node if n.output and n.output[0] not in sized for i in n.input if i]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name in sized and name not in producer:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is not None and node.op_type in SHAPE_ARITHMETIC_OPS:
            todo.extend(i for i in node.input if i)
    return seen


def _one_node(node: onnx.NodeProto, opsets: Sequence[onnx.OperatorSetIdProto]) -> onnx.ModelProto:
    graph = onnx.helper.make_graph(
        [node], "fold", [onnx.helper.make_tensor_value_info(i, onnx.TensorProto.UNDEFINED, None)
                         for i in dict.fromkeys(i for i in node.input if i)],
        [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None)
         for o in node.output if o])
    return onnx.helper.make_model(graph, opset_imports=list(opsets))


def _with_values(model: onnx.ModelProto, folded: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """`model` with the nodes that make `folded`'s tensors replaced by their values."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    # A node stays while one of its outputs is still computed (then it makes them all).
    keep = [n for n in out.graph.node if not all(o in folded for o in n.output if o)]
    made = {o for n in keep for o in n.output}
    del out.graph.node[:]
    out.graph.node.extend(keep)
    out.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in folded.items()
                                 if k not in made)
    return out


def tensor_shapes(model: onnx.ModelProto,
                  input_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, tuple[int, ...]]:
    """Static shapes of every tensor, with dynamic graph inputs sized by `input_shapes`."""
    return _shapes(model, input_shapes)


def _with_input_shapes(model: onnx.ModelProto,
                       input_shapes: Mapping[str, tuple[int, ...]]) -> onnx.ModelProto:
    """A weightless copy of `model` whose graph inputs have the given sizes."""
    skeleton = weightless(model)
    for vi in skeleton.graph.input:
        dims = input_shapes.get(vi.name)
        if dims is None or not vi.type.HasField("tensor_type"):
            continue
        shape = vi.type.tensor_type.shape
        if len(shape.dim) != len(dims):
            continue
        for d, size in zip(shape.dim, dims, strict=True):
            d.Clear()
            d.dim_value = int(size)
    # Stale value_info would keep the dynamic sizes in place of the inferred ones.
    del skeleton.graph.value_info[:]
    return skeleton


def node_flops(model: onnx.ModelProto,
               input_shapes: Mapping[str, tuple[int, ...]] | None = None, *,
               shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, int]:
    """Node label -> FLOPs (multiply-adds count 2); elementwise ops count one per output.
    `input_shapes` sizes dynamic graph inputs (a sample's shapes); shapes still unknown
    count as one element. `shapes`: tensor_shapes' result already at hand (one inference)."""
    if shapes is None:
        shapes = _shapes(model, input_shapes)
    flops: dict[str, int] = {}
    for scope in walk_graphs(model.graph):
        for node in scope.graph.node:
            out = shapes.get(node.output[0], ()) if node.output else ()
            n_out = math.prod(out) if out else 1
            op = node.op_type
            w = shapes.get(node.input[1], ()) if len(node.input) > 1 else ()
            a = shapes.get(node.input[0], ()) if node.input else ()
            if op in ("Conv", "ConvTranspose") and len(w) >= 3:
                group = int(attribute(node, "group", 1) or 1)
                per_out = math.prod(w[1:]) if op == "Conv" else math.prod(w[2:]) * w[0] // group
                flops[node_label(node)] = 2 * n_out * per_out
            elif op in ("MatMul", "Gemm") and len(a) >= (1 if op == "MatMul" else 2):
                # A rank-1 MatMul operand is a vector: its length is the reduced dimension.
                k = a[-1] if op == "MatMul" or not attribute(node, "transA", 0) else a[-2]
                flops[node_label(node)] = 2 * n_out * k
            elif op in RECURRENT_OPS and len(a) == 3 and len(w) == 3:
                flops[node_label(node)] = _recurrent_flops(op, a, w)
            elif op in ("STFT", "DFT"):
                # Counted as the direct transform a compiler lowers it to (a Conv or MatMul
                # by the Fourier basis): one multiply-add per output value and input sample.
                flops[node_label(node)] = 2 * n_out * _transform_length(node, shapes, a)
            else:
                flops[node_label(node)] = n_out
    return flops


def _recurrent_flops(op: str, x: tuple[int, ...], w: tuple[int, ...]) -> int:
    """An RNN/GRU/LSTM's gate products: per step, batch row and direction, W (gates x hidden
    by input) on the input and R (gates x hidden by hidden) on the state. X is [seq, batch,
    input] (or batch first: the product is the same), W [directions, gates x hidden, input]."""
    directions, gate_rows, inputs = w
    hidden = gate_rows // RECURRENT_GATES[op]
    return 2 * x[0] * x[1] * directions * gate_rows * (inputs + hidden)


def _transform_length(node: onnx.NodeProto, shapes: Mapping[str, tuple[int, ...]],
                      signal: tuple[int, ...]) -> int:
    """Samples per transformed frame: an STFT's window length, a DFT's axis length (1 unknown)."""
    if node.op_type == "STFT":
        window = shapes.get(node.input[2], ()) if len(node.input) > 2 and node.input[2] else ()
        return window[0] if window else 1
    axis = int(attribute(node, "axis", 1) or 1)
    return signal[axis] if len(signal) > axis else 1

