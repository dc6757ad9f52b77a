"""Where a probe runs: a small Backend protocol, the profile's emulation, onnxruntime's FP16 kernels.

To add a backend (a board over ssh, a vendor simulator), write a class with a `name` and a
`run(probe, tensors)` that returns the probe's graph outputs, plus any of `tensors` it can
observe, as numpy arrays keyed by tensor name. `probe.target` is the model in the target
precision (None: lower `probe.reference` yourself); `probe.feeds` holds FP32 inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import onnx
from onnx import TensorProto, helper

from npuprep.errors import NpuprepError
from npuprep.graph import tensor_types
from npuprep.model_io import WeightScratch
from npuprep.numerics import NumberFormat
from npuprep.probe.micro import ProbeModel


class Backend(Protocol):
    """Runs a probe the way the target would."""

    name: str

    def run(self, probe: ProbeModel, tensors: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """Graph outputs, plus those of `tensors` this backend can observe."""
        ...


def expose(model: onnx.ModelProto, tensors: Sequence[str]) -> onnx.ModelProto:
    """A copy of `model` with `tensors` added as graph outputs (unknown names are skipped)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    types = tensor_types(model)
    present = {o.name for o in out.graph.output}
    produced = {name for node in out.graph.node for name in node.output}
    wanted = [n for n in dict.fromkeys(tensors) if n not in present and n in produced and n in types]
    # One shape-inference pass for all of them: a pass per tensor made `probe MODEL` take minutes.
    shapes = inferred_shapes(model) if wanted else {}
    out.graph.output.extend(output_info(model, name, types[name], shapes) for name in wanted)
    return out


def output_info(model: onnx.ModelProto, name: str, elem: int,
                shapes: dict[str, tuple[int | None, ...]] | None = None) -> onnx.ValueInfoProto:
    """A graph-output entry for `name`, with the inferred shape where inference knows it.

    `shapes` (from `inferred_shapes(model)`) saves the inference pass when several are made.
    """
    dims = (inferred_shapes(model) if shapes is None else shapes).get(name)
    return helper.make_tensor_value_info(name, elem, None if dims is None else list(dims))


def inferred_shapes(model: onnx.ModelProto) -> dict[str, tuple[int | None, ...]]:
    """Every tensor's inferred dimensions (None where symbolic), by name: one inference pass, on
    npuprep.graph's weightless skeleton (serialising the weights cost seconds per pass)."""
    from npuprep.graph import infer_tensors

    return infer_tensors(model).dims


def cast_feeds(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Feeds converted to the element types `model` declares for its inputs."""
    types = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.input}
    out = {}
    for name, value in feeds.items():
        if name not in types:
            raise NpuprepError(f"probe input '{name}' is not an input of the model")
        out[name] = np.asarray(value).astype(helper.tensor_dtype_to_np_dtype(types[name]))
    return out


def _session_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from npuprep.runtime.session import make_session, run
    from npuprep.verify.compare import folds_weight_casts

    # One run: a prepacked copy of the weights, or folded rounded ones, would only double the
    # memory of a large model.
    return run(make_session(model, prepack=False, lean=True, optimize=folds_weight_casts(model)),
               cast_feeds(model, feeds))


class EmulateBackend:
    """The FP32 graph with Cast pairs after every op: the profile's overflow semantics, on any CPU.

    Cannot show FP16 accumulation inside one op or vendor kernels (see verify.emulate).
    """

    def __init__(self, fmt: NumberFormat, *, saturate: bool) -> None:
        self.fmt = fmt
        self.saturate = saturate
        self.name = f"emulate({fmt.name}, {'saturate' if saturate else 'ieee'})"

    def run(self, probe: ProbeModel, tensors: Sequence[str] = ()) -> dict[str, np.ndarray]:
        from npuprep.verify.emulate import emulate

        # Weights rounded in the graph: an anchored model's weights stay in its files.
        emulated = emulate(probe.reference, self.fmt, saturate=self.saturate, weights_in_graph=True).model
        return _session_run(expose(emulated, tensors), probe.feeds)


class OrtBackend:
    """The lowered model on onnxruntime's CPU provider.

    onnxruntime's CPU provider lacks FP16 kernels for most ops: it computes them in FP32
    between inserted Casts and drops Cast pairs, so an FP32 graph output can carry a value
    beyond 65504 exactly. With `io="fp16"` (default) every observed tensor is stored in FP16,
    as an FP16 runtime stores it, and overflow shows as IEEE Inf. With `io="fp32"` the
    lowered model keeps FP32 outputs and the probe reports the wider computation it sees.
    """

    def __init__(self, fmt: NumberFormat, *, io: str = "fp16") -> None:
        if fmt.name != "fp16":
            raise NpuprepError(f"the ort backend runs fp16 only (onnxruntime has no {fmt.name} compute "
                               "kernels); use --backend emulate")
        if io not in ("fp16", "fp32"):
            raise NpuprepError(f"ort backend io must be fp16 or fp32, got '{io}'")
        self.fmt = fmt
        self.io = io
        self.name = "ort" if io == "fp16" else "ort(fp32 io)"

    def run(self, probe: ProbeModel, tensors: Sequence[str] = ()) -> dict[str, np.ndarray]:
        model = probe.target if probe.target is not None else lower_model(probe.reference, self.fmt, probe.scratch)
        model = expose(model, tensors)
        if self.io == "fp16":
            model = store_outputs(model, self.fmt)
        return _session_run(model, probe.feeds)


def store_outputs(model: onnx.ModelProto, fmt: NumberFormat) -> onnx.ModelProto:
    """`y` (FP32 output) -> `y = Cast<fmt>(y__wide)`: every graph output is stored in `fmt`."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    casts = []
    for vo in g.output:
        if vo.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        wide = f"{vo.name}__wide"
        _rename(g, vo.name, wide)
        casts.append(helper.make_node("Cast", [wide], [vo.name], to=fmt.onnx_type,
                                      name=f"probe_store_{vo.name}"))
        vo.type.tensor_type.elem_type = fmt.onnx_type
    g.node.extend(casts)
    return out


def lower_model(model: onnx.ModelProto, fmt: NumberFormat,
                scratch: WeightScratch | None = None) -> onnx.ModelProto:
    """The model in `fmt` with FP32 inputs and outputs: npuprep.rewrite.lower where present.
    `scratch` (a WeightScratch the caller keeps alive) holds its large lowered weights."""
    try:
        from npuprep.rewrite.lower import lower
    except ImportError:
        return simple_lower(model, fmt)
    return lower(model, fmt, scratch=scratch).model


def simple_lower(model: onnx.ModelProto, fmt: NumberFormat) -> onnx.ModelProto:
    """Every FP32 weight, constant and activation in `fmt`; Casts keep the I/O FP32.

    Main graph only, enough for probe models; the full lowering lives in rewrite/lower.py.
    """
    from npuprep.graph import to_array
    from npuprep.ops import FP32_ONLY_INPUTS

    for node in model.graph.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise NpuprepError(f"node '{node.name or node.op_type}': the built-in probe lowering "
                               "does not handle subgraphs")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    low = fmt.np_dtype
    keep = {n for node in g.node for pos, n in enumerate(node.input)
            if pos in FP32_ONLY_INPUTS.get(node.op_type, ())}
    for init in g.initializer:
        if init.data_type == TensorProto.FLOAT and init.name not in keep:
            value = np.clip(to_array(init), -fmt.max, fmt.max).astype(low)
            init.CopyFrom(onnx.numpy_helper.from_array(value, init.name))
    for node in g.node:
        for attr in node.attribute:
            if attr.name == "to" and node.op_type == "Cast" and attr.i == TensorProto.FLOAT:
                attr.i = fmt.onnx_type
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT \
                    and node.output[0] not in keep:
                attr.t.CopyFrom(onnx.numpy_helper.from_array(to_array(attr.t).astype(low), attr.t.name))
    inits = {i.name for i in g.initializer}
    head: list[onnx.NodeProto] = []
    for vi in g.input:
        if vi.name in inits or vi.type.tensor_type.elem_type != TensorProto.FLOAT or vi.name in keep:
            continue
        alias = f"{vi.name}__low"
        for node in g.node:
            for i, name in enumerate(node.input):
                if name == vi.name:
                    node.input[i] = alias
        head.append(helper.make_node("Cast", [vi.name], [alias], to=fmt.onnx_type,
                                     name=f"probe_cast_in_{vi.name}"))
    tail: list[onnx.NodeProto] = []
    for vo in g.output:
        if vo.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        inner = f"{vo.name}__low"
        _rename(g, vo.name, inner)
        tail.append(helper.make_node("Cast", [inner], [vo.name], to=TensorProto.FLOAT,
                                     name=f"probe_cast_out_{vo.name}"))
    nodes = head + list(g.node) + tail
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]
    return out


def _rename(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Every node of `graph` that writes or reads `old` uses `new` instead."""
    for node in graph.node:
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
