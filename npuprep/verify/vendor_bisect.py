"""When the vendor tool refuses or crashes: bisect to the nodes, rewrite them where an exact rewrite exists, retry.

    rknn-toolkit2 crashes in build -> parts built one by one (npuprep.vendors.bisection)
        -> "rknn-toolkit2 build crashes (SIGSEGV) on node X (op Y)" -> exact rewrite of X -> build again

The parts are fed one sample's reference values (onnxruntime, every main-graph tensor). An
exact rewrite exists for some ops the toolkit cannot take: an If (its branches computed in
the main graph, `Where` selects; rknn-toolkit2 refuses inputs read only inside If branches
and If nodes as "dynamic graphs"), a rotation written as two Slices and a Concat (one
Gather; its build dies of SIGSEGV on the Slices). Where none exists the line says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from npuprep.data import Feed
from npuprep.errors import NpuprepError
from npuprep.graph import attribute, consumers, node_label, topological_order
from npuprep.vendors.bisection import Attempt, Bisection, Build, bisect

# Each branch is computed whether taken or not: exact, and the only form the toolkit takes.
_ALL_BRANCHES = 10**9


@dataclass(frozen=True)
class VendorBisection:
    """The bisection, the rewrite tried for the nodes found, and the retried build."""

    bisection: Bisection
    fix: str = ""
    fixed: onnx.ModelProto | None = field(default=None, repr=False)
    retry: Attempt | None = None

    def __bool__(self) -> bool:
        """True when a rewrite made the vendor tool build the model."""
        return self.retry is not None and self.retry.ok

    declined: str = ""
    pattern: str = ""

    @property
    def lines(self) -> tuple[str, ...]:
        said = [self.bisection.line, *([self.pattern] if self.pattern else [])]
        if self.retry is not None:
            after = "builds" if self.retry.ok else (f"still fails in {self.retry.stage}: "
                                                    f"{self.retry.said}")
            said.append(f"rewritten: {self.fix}; the vendor tool then {after}")
        elif self.declined:
            said.append(f"the exact rewrite for it declined: {self.declined}")
        elif self.bisection:
            said.append("no exact ONNX rewrite is known for it")
        return tuple(said)

    def to_dict(self) -> dict[str, Any]:
        return {**self.bisection.to_dict(), "fix": self.fix, "declined": self.declined,
                "retry": None if self.retry is None else {
                    "ok": self.retry.ok, "stage": self.retry.stage, "said": self.retry.said},
                "lines": list(self.lines)}


def rknn_build(python: str | Path | None = None, target_platform: str = "rk3588",
               timeout: float = 600.0) -> Build:
    """Build one part with rknn-toolkit2 in its subprocess and run the simulator on its sample."""
    from npuprep.vendors.rockchip import run_rknn

    def build(part: onnx.ModelProto, feed: dict[str, np.ndarray]) -> Attempt:
        try:
            done = run_rknn(part, [feed], python=python, target_platform=target_platform,
                            timeout=timeout)
        except NpuprepError as exc:  # a part past the time limit fails another way
            return Attempt(False, "npuprep", str(exc))
        return Attempt(done.ok, done.stage, done.refusal)

    return build


def reference_values(model: onnx.ModelProto, feed: Feed,
                     candidate: onnx.ModelProto | None = None) -> dict[str, np.ndarray]:
    """Every main-graph tensor's value on one sample (graph inputs included), by name.

    With `candidate` (the lowered model, whose FP16 ops onnxruntime's CPU may lack), the
    values are `model`'s, plus those of the Casts and Identities the lowering added.
    """
    from npuprep.runtime.session import make_session, run

    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    present = {o.name for o in exposed.graph.output}
    wanted = [o for n in model.graph.node for o in n.output if o and o not in present]
    # Untyped: onnxruntime types them itself, also where onnx's inference cannot (ai.onnx.ml).
    exposed.graph.output.extend(helper.make_empty_tensor_value_info(o) for o in wanted)
    values = {**{k: np.asarray(v) for k, v in feed.items()},
              **run(make_session(exposed, optimize=False), dict(feed))}
    for node in topological_order(candidate.graph) if candidate is not None else ():
        if node.op_type not in ("Cast", "Identity") or node.input[0] not in values \
                or node.output[0] in values:
            continue
        value = values[node.input[0]]
        if node.op_type == "Cast":
            value = value.astype(helper.tensor_dtype_to_np_dtype(int(attribute(node, "to"))))
        values[node.output[0]] = value
    return values


def _all_branches(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> Any:
    from npuprep.rewrite.control_flow import remove_control_flow

    return remove_control_flow(model, max_branch_nodes=_ALL_BRANCHES)


def _rotations(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> Any:
    from npuprep.rewrite.slice_rotation import rotations_as_one_op

    return rotations_as_one_op(model, {k: np.shape(v) for k, v in values.items()})


# op -> the exact rewrite that takes it out of the graph
FIXES: Mapping[str, Callable[[onnx.ModelProto, Mapping[str, np.ndarray]], Any]] = {
    "If": _all_branches, "Slice": _rotations, "Concat": _rotations}


def bisect_vendor(model: onnx.ModelProto, feed: Feed, failure: Attempt, build: Build, *,
                  reference: onnx.ModelProto | None = None, vendor: str = "rknn-toolkit2",
                  max_builds: int = 48) -> VendorBisection:
    """Narrow `failure` (of `model`) to its nodes, rewrite them where FIXES knows how, build
    again. `reference`: the FP32 model `model` was lowered from, run for the parts' values."""
    values = (reference_values(reference, feed, model) if reference is not None
              else reference_values(model, feed))
    found = bisect(model, failure, values, build, vendor=vendor, max_builds=max_builds)
    pattern = _inputs_only_in_branches(model, found)
    op = next((o for o in found.ops if o in FIXES), None)
    if op is None:
        return VendorBisection(found, pattern=pattern)
    done = FIXES[op](model, values)
    if not done:
        return VendorBisection(found, declined=done.reason, pattern=pattern)
    feeds = {k: np.asarray(v) for k, v in feed.items()}
    return VendorBisection(found, fix=done.reason, fixed=done.model,
                           retry=build(done.model, feeds), pattern=pattern)


def _inputs_only_in_branches(model: onnx.ModelProto, found: Bisection) -> str:
    """`graph inputs a, b are read only inside If_0's branches`, for a control-flow node found."""
    flows = {node_label(n): n for n in model.graph.node
             if node_label(n) in found.nodes and n.op_type in ("If", "Loop", "Scan")}
    readers = consumers(model.graph)
    said = []
    for label, node in flows.items():
        only = [i.name for i in model.graph.input
                if readers.get(i.name) == [node] and i.name not in node.input]
        if only:
            said.append(f"graph input{'s' if len(only) > 1 else ''} {', '.join(only)} "
                        f"{'are' if len(only) > 1 else 'is'} read only inside {label}'s branches")
    return "; ".join(said)
