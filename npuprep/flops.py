"""FLOPs per node from inferred shapes; npuprep.verify.fp32_share turns them into the FP32 share.

A model with dynamic axes (a recogniser's width, a detector's image size) has no FLOPs until
its inputs have sizes: pass those of a real sample (`input_shapes`), or a 3x32xW Conv stack
counts one output element per Conv and its FP32 share means nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import onnx

from npuprep.graph import attribute, node_label, walk_graphs, weightless

DATA_PROP_ELEMENTS = 2 ** 24


def _shapes(model: onnx.ModelProto,
            input_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, tuple[int, ...]]:
    # Weightless: inference serialises the model, and its weights are not needed.
    model = _with_input_shapes(model, input_shapes or {})
    # Data propagation (shapes computed by Shape/Gather/Concat chains) holds values as big as
    # the inputs: a rank-1 input of 2^26 elements took 9.7 GB. Above DATA_PROP_ELEMENTS it is
    # left out and shapes only data could give stay unknown.
    largest = max((math.prod(s) for s in (input_shapes or {}).values()), default=0)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False,
                                                     data_prop=largest <= DATA_PROP_ELEMENTS)
    except Exception:  # noqa: BLE001 - best effort; unknown shapes count as one element
        inferred = model
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
            elif op in ("STFT", "DFT"):
                # Counted as the direct transform a compiler lowers it to (a Conv or MatMul
                # by the Fourier basis): one multiply-add per output value and input sample.
                flops[node_label(node)] = 2 * n_out * _transform_length(node, shapes, a)
            else:
                flops[node_label(node)] = n_out
    return flops


def _transform_length(node: onnx.NodeProto, shapes: Mapping[str, tuple[int, ...]],
                      signal: tuple[int, ...]) -> int:
    """Samples per transformed frame: an STFT's window length, a DFT's axis length (1 unknown)."""
    if node.op_type == "STFT":
        window = shapes.get(node.input[2], ()) if len(node.input) > 2 and node.input[2] else ()
        return window[0] if window else 1
    axis = int(attribute(node, "axis", 1) or 1)
    return signal[axis] if len(signal) > axis else 1

