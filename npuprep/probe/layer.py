"""Single-layer probe: `Conv(x, W, B)` -> `Conv(x, g*W, g*B)` with g raised until the FP32 output crosses the limit.

The amplified layer's output is made a graph output, so every backend (a board included)
returns it; the verdict is that tensor's classification. Backends that observe every tensor
(emulation, onnxruntime) also say where in the graph the behaviour first shows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from npuprep.errors import NpuprepError
from npuprep.graph import (
    constant_value,
    float_tensor_names,
    node_label,
    node_reads,
    tensor_types,
    topological_order,
    weight_bytes,
    without_weight_inputs,
)
from npuprep.model_io import WeightScratch
from npuprep.numerics import NumberFormat
from npuprep.ops import MAC_WEIGHT_INPUTS
from npuprep.probe.backends import Backend, output_info
from npuprep.probe.classify import Classification, Verdict, classify
from npuprep.probe.micro import ProbeModel
from npuprep.probe.runner import ProbeResult, reference_outputs

# Amplified weights stay below this fraction of max, so the weights themselves never overflow.
WEIGHT_LIMIT = 0.5
# "Clearly crosses": the raised gain aims at this multiple of the overflow threshold.
MARGIN = 2.0
MAX_RAISES = 4
# A model with this many bytes of weights or more gets a temporary file for the weights the
# probe makes (the amplified layer, a kit's lowered weights), not carried in its graphs.
SCRATCH_BYTES = 64 * 2**20


@dataclass(frozen=True)
class LayerChoice:
    """The layer to amplify: its node label, op, output tensor and constant weight inputs."""

    node: str
    op_type: str
    tensor: str
    weights: tuple[str, ...]


def pick_layer(model: onnx.ModelProto, layer: str | None = None) -> LayerChoice:
    """The named layer (node name, label or output tensor), else the first linear op with constant weights."""
    graph = model.graph
    candidates = []
    for node in topological_order(graph):
        if node.op_type not in MAC_WEIGHT_INPUTS:
            continue
        positions = MAC_WEIGHT_INPUTS[node.op_type]
        if node.op_type == "MatMul" and constant_value(graph, node.input[1]) is None:
            positions = (0,)
        weights = tuple(node.input[p] for p in positions
                        if p < len(node.input) and node.input[p]
                        and constant_value(graph, node.input[p]) is not None)
        if not weights or weights[0] != node.input[positions[0]]:
            continue
        candidates.append(LayerChoice(node_label(node), node.op_type, node.output[0], weights))
    if layer is None:
        if not candidates:
            raise NpuprepError("no Conv, ConvTranspose, Gemm or MatMul with constant weights in the "
                               "main graph; name a layer with --layer")
        return candidates[0]
    for c in candidates:
        if layer in (c.node, c.tensor):
            return c
    known = [node_label(n) for n in graph.node]
    if layer in known:
        raise NpuprepError(f"layer '{layer}' is not a Conv, ConvTranspose, Gemm or MatMul with "
                           "constant weights")
    raise NpuprepError(f"layer '{layer}' not found in the main graph")


def weight_absmax(model: onnx.ModelProto, choice: LayerChoice) -> float:
    values = [np.abs(np.asarray(constant_value(model.graph, w), np.float64)) for w in choice.weights]
    return max((float(v.max()) for v in values if v.size), default=0.0)


def amplify(model: onnx.ModelProto, choice: LayerChoice, gain: float,
            scratch: WeightScratch | None = None) -> onnx.ModelProto:
    """A copy with the layer's weights times `gain` (fresh initialisers) and its output exposed.
    With `scratch`, the amplified weights are written there and the copy refers to them (a
    large model's copies then carry no weight bytes)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    node = next(n for n in graph.node if node_label(n) == choice.node)
    for i, name in enumerate(node.input):
        if name not in choice.weights:
            continue
        value = constant_value(graph, name)
        scaled = (np.asarray(value, np.float64) * gain).astype(value.dtype)
        fresh = f"{name}__probe_gain"
        graph.initializer.append(scratch.anchor(scaled, fresh) if scratch is not None
                                 else numpy_helper.from_array(scaled, fresh))
        node.input[i] = fresh
    # What If/Loop bodies read from outside counts as used too (oww_hey_jarvis's If).
    used = {n for nd in graph.node for n in node_reads(nd)}
    # Deleted in place: rebuilding the list would copy every kept initialiser once more.
    for index in reversed(range(len(graph.initializer))):
        if graph.initializer[index].name not in used:
            del graph.initializer[index]
    if choice.tensor not in {o.name for o in graph.output}:
        elem = tensor_types(model).get(choice.tensor, onnx.TensorProto.FLOAT)
        graph.output.append(output_info(model, choice.tensor, elem))
    return out


@dataclass(frozen=True)
class LayerProbe:
    """The single-layer probe's verdict, the gain that produced it and where it first shows."""

    result: ProbeResult
    layer: LayerChoice
    gain: float
    max_gain: float
    first_shows: dict[str, Any] | None
    graph_outputs: dict[str, Classification]
    pre_existing: dict[str, Any] | None = None
    dirty_inputs: tuple[str, ...] = ()

    @property
    def verdict(self) -> str:
        return self.result.verdict

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.result.to_dict(),
            "layer": self.layer.node,
            "op_type": self.layer.op_type,
            "tensor": self.layer.tensor,
            "gain": self.gain,
            "max_gain": self.max_gain,
            "first_shows": self.first_shows,
            "pre_existing": self.pre_existing,
            "dirty_inputs": list(self.dirty_inputs),
            "graph_outputs": {k: v.to_dict() for k, v in sorted(self.graph_outputs.items())},
        }


def layer_probe_model(model: onnx.ModelProto, feeds: dict[str, np.ndarray], fmt: NumberFormat, *,
                      layer: str | None = None, gain: float = 100.0,
                      raise_gain: bool = True) -> tuple[ProbeModel, LayerChoice, float, float]:
    """The amplified model as a probe, the chosen layer, the gain used and the largest allowed."""
    probe, choice, g, max_gain, _ = _amplified(model, feeds, fmt, layer, gain, raise_gain, all_tensors=False)
    return probe, choice, g, max_gain


def _amplified(model: onnx.ModelProto, feeds: dict[str, np.ndarray], fmt: NumberFormat, layer: str | None,
               gain: float, raise_gain: bool, *, all_tensors: bool
               ) -> tuple[ProbeModel, LayerChoice, float, float, dict[str, np.ndarray]]:
    """layer_probe_model, plus the FP32 reference of the last run (every float tensor with
    `all_tensors`, so the caller need not run the amplified model once more)."""
    if gain <= 0 or not math.isfinite(gain):
        raise NpuprepError(f"--gain must be a positive number, got {gain}")
    # The amplified weight takes a new name: an old exporter's input of the same name would
    # be left with no value.
    model, _ = without_weight_inputs(model)
    choice = pick_layer(model, layer)
    wmax = weight_absmax(model, choice)
    if wmax == 0:
        raise NpuprepError(f"layer '{choice.node}' has all-zero weights; amplifying them shows nothing")
    max_gain = WEIGHT_LIMIT * fmt.max / wmax
    g = min(gain, max_gain)
    target = MARGIN * fmt.overflow_threshold
    for _ in range(MAX_RAISES):
        probe = _probe(model, choice, g, feeds)
        tensors = float_tensor_names(probe.reference) if all_tensors else [choice.tensor]
        reference = reference_outputs(probe, tensors)
        absmax = _absmax(reference[choice.tensor])
        if not raise_gain or absmax >= target or absmax == 0 or g >= max_gain:
            break
        # The layer output is linear in the gain (weights and bias both scale).
        g = min(max_gain, g * 10.0 ** math.ceil(math.log10(target / absmax)))
    return probe, choice, g, max_gain, reference


def _probe(model: onnx.ModelProto, choice: LayerChoice, gain: float,
           feeds: dict[str, np.ndarray]) -> ProbeModel:
    scratch = WeightScratch() if weight_bytes(model) >= SCRATCH_BYTES else None
    return ProbeModel("layer", f"{choice.op_type} '{choice.node}' x{gain:g}",
                      amplify(model, choice, gain, scratch), None, dict(feeds), (choice.tensor,),
                      scratch=scratch)


def _absmax(x: np.ndarray) -> float:
    x = np.asarray(x, np.float64)
    x = x[np.isfinite(x)]
    return float(np.abs(x).max()) if x.size else 0.0


def probe_layer(model: onnx.ModelProto, feeds: dict[str, np.ndarray], fmt: NumberFormat,
                backend: Backend, *, layer: str | None = None, gain: float = 100.0,
                raise_gain: bool = True, progress: Callable[[str], None] | None = None) -> LayerProbe:
    """Amplify one layer, run it on `backend`, classify its output and locate the first anomaly.

    An anomaly outside the amplified layer's downstream cone is the model's own overflow, not
    the probe's: it is reported as `pre_existing`, and when it reaches the layer's inputs the
    verdict says it is mixed with it. `progress` is told each stage as it starts.
    """
    stage = progress or (lambda _: None)
    stage("choosing the gain (FP32 reference, every tensor)")
    probe, choice, g, max_gain, reference = _amplified(model, feeds, fmt, layer, gain, raise_gain,
                                                       all_tensors=True)
    tensors = float_tensor_names(probe.reference)
    stage(f"{backend.name}, every tensor")
    observed = backend.run(probe, tensors)
    stage("classifying")
    if choice.tensor not in observed:
        raise NpuprepError(f"backend {backend.name} did not return the probed tensor '{choice.tensor}'")
    c = classify(reference[choice.tensor], observed[choice.tensor], fmt)
    if c.verdict is Verdict.NO_OVERFLOW and not c.wider and c.reference_absmax < fmt.overflow_threshold:
        why = (f"weights would pass {WEIGHT_LIMIT:g}x the {fmt.name} max above gain {max_gain:.4g}"
               if g >= max_gain else "raise --gain")
        c = replace(c, reason=f"{c.reason} at gain {g:g}; {why}")
    cone = _downstream(probe.reference, choice.tensor)
    anomalies = _anomalies(probe.reference, tensors, reference, observed, fmt)
    first = next((a for a in anomalies if a["tensor"] in cone), None)
    pre = next((a for a in anomalies if a["tensor"] not in cone), None)
    node = next(n for n in probe.reference.graph.node if node_label(n) == choice.node)
    dirty = [i for i in node.input if i in observed and i not in choice.weights
             and not np.isfinite(np.asarray(observed[i], np.float64)).all()]
    if dirty:
        c = replace(c, reason=f"{c.reason}; the layer's input {', '.join(dirty)} is already non-finite "
                              f"(the model's own overflow at '{pre['tensor'] if pre else dirty[0]}'): "
                              "pick another --layer or fix that first")
    result = ProbeResult("layer", probe.unit, choice.tensor, c)
    outputs = {o.name: classify(reference[o.name], observed[o.name], fmt)
               for o in model.graph.output if o.name in observed and o.name in reference}
    return LayerProbe(result, choice, g, max_gain, first, outputs, pre, tuple(dirty))


def _downstream(model: onnx.ModelProto, tensor: str) -> set[str]:
    """`tensor` and every tensor computed from it."""
    cone = {tensor}
    for node in topological_order(model.graph):
        if any(i in cone for i in node.input):
            cone.update(o for o in node.output if o)
    return cone


def _anomalies(model: onnx.ModelProto, tensors: list[str], reference: dict[str, np.ndarray],
               observed: dict[str, np.ndarray], fmt: NumberFormat) -> list[dict[str, Any]]:
    """Tensors, in topological order, whose values show an overflow behaviour."""
    producer = {out: n for n in model.graph.node for out in n.output}
    found = []
    for name in tensors:
        if name not in observed or name not in reference:
            continue
        if np.shape(observed[name]) != np.shape(reference[name]):
            continue
        c = classify(reference[name], observed[name], fmt)
        if c.verdict.conclusive or c.wider:
            node = producer.get(name)
            found.append({"tensor": name, "node": node_label(node) if node else "(graph input)",
                          "op_type": node.op_type if node else "", "verdict": str(c.verdict),
                          "wider": c.wider, "reason": c.reason})
    return found
