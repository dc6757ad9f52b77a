"""Bisect a vendor tool's refusal or crash to the nodes that cause it: model -> smallest failing node set.

    build(model) crashes -> build(nodes[:k]) for the shortest prefix that fails the same way
        -> build(nodes[s:k]) for the latest start that still does -> drop each node the failure
        does not need -> "rknn-toolkit2 build crashes (SIGSEGV) on node X (op Y)"

As Polygraphy's `debug reduce` does: the graph is cut at tensors (in topological order), the
cut tensors become the part's inputs (floating-point activations, fed their values from one
reference run) or initialisers (constants, shapes and integer tensors, whose values a
compiler folds), and every tensor a kept node makes that a dropped node or the graph's
output reads becomes the part's output, so no kept node is dead. Each part goes through
`build` (the vendor tool in its own process); a part "fails the same way" when the tool stops
in the same stage with the same words, names left out. Vendors' own floor: no onnxruntime
here, the caller gives the reference values.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from npuprep.graph import node_label, node_reads, tensor_types, topological_order
from npuprep.ops import CONSTANT_OPS

# Quoted names, bracketed lists and numbers: the same failure names other tensors in a part.
_NAMES = re.compile(r"'[^']*'|\"[^\"]*\"|\[[^\]]*\]|\d+")
# run_rknn's words for a crash: `the vendor process crashed (signal 11) in build`.
_SIGNAL = re.compile(r"crashed \(signal (\d+)\)")
# Past this many nodes, dropping nodes one at a time costs more builds than it tells.
MAX_MINIMISE = 16


@dataclass(frozen=True)
class Attempt:
    """One build of a model by the vendor tool: whether it went through, where it stopped, why."""

    ok: bool
    stage: str = ""
    said: str = ""

    def __bool__(self) -> bool:
        return self.ok

    @property
    def signature(self) -> tuple[str, str]:
        """Stage and words with names and numbers left out: the same failure in any part."""
        return self.stage, _NAMES.sub("…", self.said)[:120]


Build = Callable[[onnx.ModelProto, dict[str, np.ndarray]], Attempt]


@dataclass(frozen=True)
class Bisection:
    """The smallest node set found that fails as the whole model does; truthy when found."""

    vendor: str
    failure: Attempt
    nodes: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()
    builds: int = 0
    why_not: str = ""

    def __bool__(self) -> bool:
        return bool(self.nodes)

    @property
    def line(self) -> str:
        """One line: which nodes break the vendor tool, in its own words."""
        stage = self.failure.stage.replace(" (crashed)", "")
        crash = _SIGNAL.search(self.failure.said) if "crashed" in self.failure.stage else None
        if self.nodes:
            named = ", ".join(f"{n} (op {o})" for n, o in zip(self.nodes, self.ops, strict=True))
            where = f"node {named}" if len(self.nodes) == 1 else f"nodes {named} together"
        else:
            where = f"the model (not narrowed to nodes: {self.why_not})"
        if crash is not None:
            return f"{self.vendor} {stage} crashes ({_signal_name(int(crash.group(1)))}) on {where}"
        return f"{self.vendor} {stage} refuses {where}: {self.failure.said}"

    def to_dict(self) -> dict[str, object]:
        return {"vendor": self.vendor, "found": bool(self), "line": self.line,
                "nodes": list(self.nodes), "ops": list(self.ops), "builds": self.builds,
                "stage": self.failure.stage, "said": self.failure.said, "why_not": self.why_not}


def bisect(model: onnx.ModelProto, failure: Attempt, values: Mapping[str, np.ndarray],
           build: Build, *, vendor: str = "rknn-toolkit2", max_builds: int = 48) -> Bisection:
    """Narrow `failure` (the whole model's) to the smallest node set that fails the same way.

    `values`: every main-graph tensor's value on one sample (graph inputs included), from a
    reference run; `build` builds one part with the vendor tool.
    """
    order = topological_order(model.graph)
    cutter = Cutter(model, values)
    builds = 0

    def fails(keep: Sequence[int]) -> bool:
        nonlocal builds
        if builds >= max_builds:
            raise _OutOfBuilds
        part = cutter.part([order[i] for i in keep])
        if part is None:  # a cut with no reference value: such a part is not tried
            return False
        builds += 1
        got = build(*part)
        return not got.ok and got.signature == failure.signature

    try:
        # The shortest failing prefix ends with a node the failure needs.
        lo, hi = 1, len(order)
        if not fails(range(hi)):
            return Bisection(vendor, failure, builds=builds, why_not=(
                "the graph cut into parts does not fail the same way"))
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fails(range(mid)) else (mid + 1, hi)
        end = lo
        # The latest start that still fails.
        lo, hi = 0, end - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fails(range(mid, end)) else (lo, mid - 1)
        keep = list(range(lo, end))
        if len(keep) <= MAX_MINIMISE:
            for i in list(keep[:-1]):
                trial = [j for j in keep if j != i]
                if fails(trial):
                    keep = trial
    except _OutOfBuilds:
        return Bisection(vendor, failure, builds=builds,
                         why_not=f"stopped after {max_builds} builds")
    nodes = [order[i] for i in keep]
    return Bisection(vendor, failure, tuple(node_label(n) for n in nodes),
                     tuple(n.op_type for n in nodes), builds)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class _OutOfBuilds(Exception):
    pass


def sub_model(model: onnx.ModelProto, nodes: Sequence[onnx.NodeProto],
              values: Mapping[str, np.ndarray]) -> tuple[onnx.ModelProto, dict[str, np.ndarray]] | None:
    """The part of `model` made of `nodes` (in topological order) and its one sample, or None
    when a tensor it needs has no reference value or it has no output."""
    return Cutter(model, values).part(nodes)


class Cutter:
    """Parts of one model, fed from one sample's reference values (what every part shares,
    worked out once: shape inference alone takes a while on a large graph)."""

    def __init__(self, model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> None:
        graph = model.graph
        self.model, self.values = model, values
        self.inits = {t.name: t for t in graph.initializer}
        self.originals = {i.name: i for i in graph.input if i.name not in self.inits}
        self.constant = _constant_tensors(graph, set(self.inits))
        self.types = tensor_types(model)
        self.reads = [(id(n), node_reads(n)) for n in graph.node]
        self.graph_outputs = {o.name for o in graph.output}

    def value(self, name: str) -> np.ndarray:
        """The reference value in the model's own type (the values may be FP32, the model lowered)."""
        value = np.asarray(self.values[name])
        if name in self.types:
            value = value.astype(helper.tensor_dtype_to_np_dtype(self.types[name]), copy=False)
        return value

    def part(self, nodes: Sequence[onnx.NodeProto]) -> tuple[onnx.ModelProto, dict[str, np.ndarray]] | None:
        made = {o for n in nodes for o in n.output if o}
        kept = {id(n) for n in nodes}
        reads = [i for n in nodes for i in node_reads(n)]
        # The graph's own inputs first, in its order (a vendor tool names inputs by position).
        order = [*(i for i in self.originals if i in set(reads)), *reads]
        feeds: dict[str, np.ndarray] = {}
        inputs, new_inits = [], []
        for name in dict.fromkeys(order):
            if name in made:
                continue
            if name in self.inits:
                new_inits.append(self.inits[name])
                continue
            if name not in self.values:
                return None
            value = self.value(name)
            original = self.originals.get(name)
            if original is None and (name in self.constant
                                     or not np.issubdtype(value.dtype, np.floating)):
                new_inits.append(numpy_helper.from_array(value, name))
                continue
            feeds[name] = value
            inputs.append(original if original is not None else _info(name, value))
        outside = {i for key, r in self.reads if key not in kept for i in r} | self.graph_outputs
        outputs = [o for n in nodes for o in n.output if o and o in outside]
        if not outputs:
            outputs = [o for o in nodes[-1].output if o]
        if not outputs or any(o not in self.values for o in outputs):
            return None
        graph = helper.make_graph(list(nodes), f"{self.model.graph.name}_part", inputs,
                                  [_info(o, self.value(o)) for o in outputs], new_inits)
        out = helper.make_model(graph, opset_imports=list(self.model.opset_import))
        out.ir_version = self.model.ir_version
        return out, feeds


def _info(name: str, value: np.ndarray) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                         list(value.shape))


def _constant_tensors(graph: onnx.GraphProto, inits: set[str]) -> set[str]:
    """Tensors that follow from initialisers and the fixed input sizes alone."""
    constant = set(inits)
    for node in topological_order(graph):
        if node.op_type in CONSTANT_OPS or all(i in constant for i in node_reads(node)):
            constant.update(o for o in node.output if o)
    return constant
