"""What one sample of given input sizes costs a run, before any run: `--input-shape x:1x1000000000`
is refused in one line instead of swapping for an hour.

    shapes inferred at the given sizes -> the node whose inputs + outputs are largest (bytes)
    -> x RUN_FACTOR -> the run's peak, against this machine's memory

The largest node bounds the run from below (onnxruntime holds a node's inputs and outputs at
once); calibration's statistics, emulation's rounded copies and the compare pass's second model
multiply it. RUN_FACTOR is the least multiple measured on convert, the costliest command
(BENCHMARKS.md, "Input sizes"): a sample refused would not have fitted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import onnx
from onnx import helper

from npuprep.graph import node_label, walk_graphs, weightless

# Growth of convert's peak resident memory over its largest node's inputs + outputs: 9.4x (an
# elementwise chain at 1e7 elements), 16x-20x (a DBNet text detector at 3x640x640..3x960x960).
RUN_FACTOR = 8


@dataclass(frozen=True)
class SampleSize:
    """`node`: the node whose activations (inputs and outputs, weights apart) are largest,
    `node_bytes` their size; `run_bytes`: what a run with such samples needs at least."""

    node: str
    node_bytes: int

    @property
    def run_bytes(self) -> int:
        return RUN_FACTOR * self.node_bytes


def sample_size(model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]]) -> SampleSize:
    """The largest node's activations with the graph inputs sized by `shapes` (tensors whose
    size shape inference cannot tell count as nothing: the estimate errs low, never refusing
    a sample that fits)."""
    skeleton = weightless(model)
    weights = {i.name for i in model.graph.initializer}
    for vi in skeleton.graph.input:
        dims = shapes.get(vi.name)
        if dims is not None and len(vi.type.tensor_type.shape.dim) == len(dims):
            for d, size in zip(vi.type.tensor_type.shape.dim, dims, strict=True):
                d.Clear()
                d.dim_value = int(size)
    # Stale value_info would keep the symbolic sizes in place of the inferred ones.
    del skeleton.graph.value_info[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - best effort: a model inference refuses is sized by its inputs
        inferred = skeleton
    size: dict[str, int] = {}
    for scope in walk_graphs(inferred.graph):
        for vi in (*scope.graph.input, *scope.graph.output, *scope.graph.value_info):
            size[vi.name] = _nbytes(vi)
    best = SampleSize("", 0)
    for scope in walk_graphs(inferred.graph):
        for node in scope.graph.node:
            total = sum(size.get(t, 0) for t in {*node.input, *node.output} if t and t not in weights)
            if total > best.node_bytes:
                best = SampleSize(node_label(node), total)
    return best


def _nbytes(vi: onnx.ValueInfoProto) -> int:
    tensor = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or tensor.elem_type in (0, onnx.TensorProto.STRING):
        return 0
    dims = tensor.shape.dim
    if not all(d.HasField("dim_value") and d.dim_value >= 0 for d in dims):
        return 0
    return math.prod(d.dim_value for d in dims) * helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
