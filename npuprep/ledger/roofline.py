"""Per node `max(flops / (peak[fmt] * eff[fmt]), bytes / (bandwidth * eff[bandwidth])) + launch`.

An estimate: one dense peak per format for the unit that runs the model and one memory
bandwidth, each scaled by the share a sustained kernel reaches (the profile's `efficiency`, 1
unless measured), every node reads its inputs and writes its outputs once (no cache reuse) and costs
the launch cost of its class (`ops.LAUNCH_CLASSES`: a GEMM, an elementwise op, a reduction...
each at the profile's figure), and every run the profile's per-inference cost. Where the
profile says the compiler fuses, an activation or elementwise op that is its producer's only
reader runs in that producer's epilogue: it moves only its other operands and launches nothing.
Views and aliases (Reshape, Squeeze, Identity, Shape..., and the layout ops the profile names
views) move nothing and launch nothing unless the profile gives views a cost; integer shape
arithmetic is folded (formats.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx

from npuprep.ops import GATHER_OPS, launch_class
from npuprep.profiles import Throughput

BYTES_PER_ELEMENT: dict[str, float] = {
    "fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "int4": 0.5,
}
# A weight's DequantizeLinear is folded into the weight at build time; a compiler turns views
# into no kernel at all (launch class `view`).
FOLDED_OPS = frozenset({"DequantizeLinear"})
# What compilers fold into the producing kernel's epilogue (TensorRT's pointwise fusion, NPU
# compilers' activation fusion): unary activations and binary elementwise ops.
FUSABLE_OPS = frozenset({"Relu", "LeakyRelu", "PRelu", "Sigmoid", "Tanh", "Clip", "HardSigmoid",
                         "HardSwish", "Gelu", "Erf", "Elu", "Selu", "Softplus", "Mish", "Add", "Sub",
                         "Mul", "Div", "Neg", "Abs", "Exp", "Sqrt", "Pow", "BatchNormalization"})


@dataclass(frozen=True)
class NodeCost:
    """One node (or inserted Cast) at its format."""

    node: str
    op_type: str
    fmt: str
    flops: int
    bytes: int
    ms: float | None  # None: the profile lacks the peak or the bandwidth
    bound: str  # compute | memory | free | unknown
    cast: bool = False
    fused: bool = False  # runs in its producer's epilogue
    launch_class: str = "view"  # ops.LAUNCH_CLASSES; what a launch of this node costs
    launch_ms: float = 0.0  # the launch within `ms`

    @property
    def launches(self) -> bool:
        """Whether the node pays a launch (not fused, not folded, a view only where views cost)."""
        return self.launch_ms > 0 or not self.fused and self.bound != "free"

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "op_type": self.op_type, "format": self.fmt,
                "flops": self.flops, "bytes": self.bytes, "estimated_ms": self.ms,
                "bound": self.bound, "cast": self.cast, "fused": self.fused,
                "launch_class": self.launch_class, "launch_ms": self.launch_ms}


def roofline_ms(flops: float, nbytes: float, fmt: str, throughput: Throughput, *,
                launch_us: float = 0.0) -> tuple[float | None, str]:
    """(milliseconds, bound) of one node plus its launch; (None, 'unknown') when a needed
    figure is unknown."""
    if flops == 0 and nbytes == 0:
        return 0.0, "free"
    peak = throughput.peak(fmt)
    bandwidth = throughput.bandwidth_gbs
    if peak is None or bandwidth is None:
        return None, "unknown"
    compute = 1e3 * flops / (peak * 1e12 * throughput.efficiency_of(fmt))
    memory = 1e3 * nbytes / (bandwidth * 1e9 * throughput.bandwidth_efficiency(fmt))
    ms = max(compute, memory) + launch_us / 1e3
    return ms, "compute" if compute >= memory else "memory"


def node_cost(node: onnx.NodeProto, label: str, fmt: str, flops: int,
              shapes: Mapping[str, tuple[int, ...]], itemsize: Callable[[str], float],
              throughput: Throughput, *, free: bool = False, fused_from: str | None = None) -> NodeCost:
    """The node's cost at `fmt`: each distinct input and output moved once at `itemsize`
    (a gather's table only as far as it is read). `fused_from`: the producer's output this
    node reads in that producer's epilogue (neither it nor this node's output goes to memory
    apart from the producer's write, which the producer pays)."""
    kind = throughput.launch_class_of(node.op_type)
    if free or kind == "view" or node.op_type in FOLDED_OPS:
        # Folded at build time (free), or a view: only a launch where the profile says views cost.
        launch = throughput.launch_of("view") / 1e3 if kind == "view" and not free else 0.0
        return NodeCost(label, node.op_type, fmt, 0, 0, launch, "free", node.op_type == "Cast",
                        launch_class=kind, launch_ms=launch)
    gather = node.op_type in GATHER_OPS and bool(node.output)
    inputs = node.input[1:] if gather else node.input
    names = dict.fromkeys(t for t in (*inputs, *node.output) if t)
    if fused_from is not None:
        names = dict.fromkeys(t for t in node.input if t and t != fused_from)
    nbytes = int(sum(math.prod(shapes.get(t, ())) * itemsize(t) for t in names))
    if gather:
        # A gather reads the rows it picks (as many as it writes), not the whole table.
        nbytes += int(math.prod(shapes.get(node.output[0], ())) * itemsize(node.output[0]))
    # A fused op's arithmetic hides under its producer's memory traffic: only its other
    # operands cost time.
    launch_us = 0.0 if fused_from else throughput.launch_of(kind)
    ms, bound = roofline_ms(0 if fused_from else flops, nbytes, fmt, throughput, launch_us=launch_us)
    return NodeCost(label, node.op_type, fmt, flops, nbytes, ms, bound, node.op_type == "Cast",
                    fused_from is not None, kind, launch_us / 1e3)


def fused_inputs(nodes: Sequence[onnx.NodeProto], graph_outputs: Collection[str]) -> dict[int, str]:
    """Node index -> the producer output it fuses on: a FUSABLE_OPS node whose first input
    comes from a computing node that no other node (nor the graph's output) reads."""
    producer = {o: n for n in nodes for o in n.output}
    readers: dict[str, int] = {}
    for n in nodes:
        for t in dict.fromkeys(n.input):
            readers[t] = readers.get(t, 0) + 1
    fused: dict[int, str] = {}
    for i, n in enumerate(nodes):
        src = n.input[0] if n.op_type in FUSABLE_OPS and n.input else ""
        p = producer.get(src)
        if (p is not None and launch_class(p.op_type) not in ("view", "cast")
                and readers.get(src) == 1 and src not in graph_outputs):
            fused[i] = src
    return fused


def cast_cost(tensor: str, elements: int, src: str, dst: str, throughput: Throughput) -> NodeCost:
    """A Cast that a format boundary needs: reads `src`, writes `dst`, one op per element, on
    the unit of its narrower side."""
    nbytes = int(elements * (BYTES_PER_ELEMENT[src] + BYTES_PER_ELEMENT[dst]))
    unit = src if dst == "fp32" else dst
    launch_us = throughput.launch_of("cast")
    ms, bound = roofline_ms(elements, nbytes, unit, throughput, launch_us=launch_us)
    return NodeCost(f"Cast({tensor}) {src}->{dst}", "Cast", unit, elements, nbytes, ms, bound, True,
                    launch_class="cast", launch_ms=launch_us / 1e3)


@dataclass(frozen=True)
class Estimate:
    """One way of running the model (all FP32, all FP16, the plan as converted...)."""

    label: str
    nodes: tuple[NodeCost, ...]
    unknown: str = ""  # why the time is unknown
    run_ms: float = 0.0  # per inference, beside the nodes (the profile's run_us)

    @property
    def estimated_ms(self) -> float | None:
        if any(n.ms is None for n in self.nodes):
            return None
        return sum(n.ms or 0.0 for n in self.nodes) + self.run_ms

    def ms_where(self, keep: Callable[[NodeCost], bool]) -> float | None:
        if self.estimated_ms is None:
            return None
        return sum(n.ms or 0.0 for n in self.nodes if keep(n))

    @property
    def memory_bound_share(self) -> float | None:
        """Share of the estimated time spent in memory-bound nodes."""
        total = self.estimated_ms
        if not total:
            return None
        return (self.ms_where(lambda n: n.bound == "memory") or 0.0) / total

    def bound_counts(self) -> dict[str, int]:
        counts = {"compute": 0, "memory": 0, "free": 0, "unknown": 0}
        for n in self.nodes:
            counts[n.bound] += 1
        return counts

    @property
    def casts(self) -> int:
        return sum(1 for n in self.nodes if n.cast and n.bound != "free")

    def costliest(self, k: int = 10) -> list[NodeCost]:
        timed = [n for n in self.nodes if n.ms]
        if timed:
            return sorted(timed, key=lambda n: (-(n.ms or 0.0), n.node))[:k]
        return sorted(self.nodes, key=lambda n: (-n.bytes, n.node))[:k]
