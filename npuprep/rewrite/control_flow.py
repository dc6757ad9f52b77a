"""Remove If nodes: `If(c, then: A(x), else: B(x))` becomes `A(x)` when c is constant, else `Where(c, A(x), B(x))`.

For compilers that refuse control flow or cannot pin inside a body (rknn-toolkit2 refuses an
If whose branch reads an outer tensor). A condition that is constant, or computable from
constants and static shapes alone, selects its branch once: the taken branch is spliced
into the main graph, exactly. Otherwise, when both branches are side-effect free, small
and give outputs of the same type and static shape, both are computed in the main graph
and `Where` selects per output: exact too, since Where only picks values, so an Inf or NaN
in the branch not taken never reaches the output (verification compares graph outputs).
A branch-local tensor or node keeps its name unless the name is taken elsewhere (then it
gets `<if>.<branch>.<name>`), so calibration statistics and name-based comparisons still
find it; reads of outer tensors wire to the outer tensor itself. Loop and Scan are left
as they are (unrolling changes the graph's size with its trip count), with a reason.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper

from npuprep.graph import TensorInfo, infer_tensors, node_label, to_array
from npuprep.model_io import model_opset
from npuprep.rewrite import graph_ops as go
from npuprep.rewrite.result import RewriteResult, sites_result

# Ops whose output differs from run to run: computing them when not asked is not exact.
_SIDE_EFFECTS = frozenset({
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
    "Bernoulli",
})
# Ops that compute a shape-derived constant and may stand in a constant condition's cone.
_SHAPE_OPS = ("Shape", "Size")
# The largest cone of nodes evaluated to decide a constant condition.
_MAX_CONE = 64
DEFAULT_MAX_BRANCH_NODES = 64


def remove_control_flow(model: onnx.ModelProto, *,
                        max_branch_nodes: int = DEFAULT_MAX_BRANCH_NODES) -> RewriteResult:
    """Remove every main-graph If that can go (nested ones too, once their parent is gone).

    details: "replaced" {If node: how}, "declined" {node: why} for each If, Loop or Scan
    left in the main graph. `max_branch_nodes` bounds the nodes of each branch a Where
    computes when it is not taken.
    """
    current = model
    replaced: dict[str, str] = {}
    declined: dict[str, str] = {}
    while True:
        for node in current.graph.node:
            label = node_label(node)
            if node.op_type != "If" or label in declined:
                continue
            step = inline_if(current, label, max_branch_nodes=max_branch_nodes)
            if step:
                current = step.model
                replaced[label] = step.reason
                break
            declined[label] = step.reason
        else:
            break
    for node in current.graph.node:
        if node.op_type in ("Loop", "Scan"):
            declined[node_label(node)] = (f"{node.op_type} is left as it is (only If is "
                                          "removed; unrolling depends on the trip count)")
    return sites_result(model, lambda: current, replaced, declined, nothing="no If, Loop or Scan",
                        done="; ".join(f"{n}: {r}" for n, r in replaced.items()))


def inline_if(model: onnx.ModelProto, if_node: str, *,
              max_branch_nodes: int = DEFAULT_MAX_BRANCH_NODES) -> RewriteResult:
    """Splice the taken branch of main-graph If `if_node` (constant condition), or compute
    both branches and select with Where; else decline with the reason."""
    graph = model.graph
    index = next((i for i, n in enumerate(graph.node) if node_label(n) == if_node), None)
    if index is None or graph.node[index].op_type != "If":
        return RewriteResult(model, False, f"{if_node} is not an If of the main graph")
    node = graph.node[index]
    branches = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
    cond = node.input[0]
    value = constant_condition(model, cond)
    if value is not None:
        chosen = "then_branch" if value else "else_branch"
        new_nodes, inits, infos = _Splicer(model, index, if_node).taken(branches[chosen], node)
        return _finish(model, index, new_nodes, inits, infos, (
            f"condition {cond} is always {value}: {chosen} spliced into the main graph"))
    info = infer_tensors(model)
    why_not = _why_no_where(model, branches, max_branch_nodes, info)
    if why_not:
        return RewriteResult(model, False, f"condition {cond} is not constant and {why_not}")
    splicer = _Splicer(model, index, if_node)
    then_nodes, then_inits, then_infos, then_outs = splicer.both(branches["then_branch"], "then")
    else_nodes, else_inits, else_infos, else_outs = splicer.both(branches["else_branch"], "else")
    select, inits = [], [*then_inits, *else_inits]
    rank = len(info.dims[cond]) if cond in info.dims else None
    scalar = cond
    if rank is None or rank > min(len(info.shapes[o.name]) for o in branches["then_branch"].output):
        # If takes any single-element bool; Where broadcasts it, which must not add dims.
        # (Only then: rknn-toolkit2 cannot fold a Reshape to rank 0.)
        scalar, shape = splicer.name(f"{cond}__scalar"), splicer.name(f"{cond}__scalar_shape")
        select.append(helper.make_node("Reshape", [cond, shape], [scalar],
                                       name=splicer.node_name(f"{if_node}__cond")))
        inits.append(onnx.numpy_helper.from_array(np.zeros(0, np.int64), shape))
    for i, (out, a, b) in enumerate(zip(node.output, then_outs, else_outs, strict=True)):
        if out:
            name = if_node if i == 0 else splicer.node_name(f"{if_node}_{i}")
            select.append(helper.make_node("Where", [scalar, a, b], [out], name=name))
    return _finish(model, index, [*then_nodes, *else_nodes, *select], inits,
                   [*then_infos, *else_infos], (
                       f"condition {cond} is not constant: both branches computed, "
                       f"Where({cond}, then, else) selects {len(then_outs)} output(s)"))


def constant_condition(model: onnx.ModelProto, name: str) -> bool | None:
    """The value of main-graph tensor `name` when constants and static shapes alone decide
    it (evaluated with onnx's reference evaluator), else None."""
    graph = model.graph
    made_by = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    inputs = {i.name for i in graph.input}
    # An initialiser that is also a graph input is only a default: the caller may feed it.
    inits = {i.name: i for i in graph.initializer if i.name not in inputs}
    if name in inits:
        value = to_array(inits[name])
        return bool(value.reshape(-1)[0]) if value.size == 1 else None
    shapes = None
    cone: dict[int, onnx.NodeProto] = {}
    needed: dict[str, onnx.TensorProto] = {}
    seen: set[str] = set()
    stack = [name]
    while stack:
        tensor = stack.pop()
        if tensor in seen or not tensor:
            continue
        seen.add(tensor)
        if tensor in inits:
            needed[tensor] = inits[tensor]
            continue
        at = made_by.get(tensor)
        if at is None or len(cone) >= _MAX_CONE:
            return None
        node = graph.node[at]
        if node.domain not in ("", "ai.onnx") or node.op_type in _SIDE_EFFECTS \
                or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                       for a in node.attribute):
            return None
        if node.op_type in _SHAPE_OPS:
            shapes = shapes or infer_tensors(model).shapes
            static = shapes.get(node.input[0])
            if static is None:
                return None
            cone[at] = _shape_constant(node, static)
            continue
        cone[at] = node
        stack.extend(node.input)
    from onnx.reference import ReferenceEvaluator

    probe = helper.make_model(
        helper.make_graph([cone[i] for i in sorted(cone)], "condition", [],
                          [helper.make_value_info(name, onnx.TypeProto())], list(needed.values())),
        opset_imports=list(model.opset_import), ir_version=model.ir_version)
    try:
        value = np.asarray(ReferenceEvaluator(probe).run(None, {})[0])
    except Exception:  # noqa: BLE001 - an op the reference evaluator lacks: not decidable here
        return None
    return bool(value.reshape(-1)[0]) if value.size == 1 else None


def _shape_constant(node: onnx.NodeProto, static: tuple[int, ...]) -> onnx.NodeProto:
    """Shape/Size of a tensor whose shape is static, as a Constant with the same output."""
    if node.op_type == "Size":
        value = np.array(int(np.prod(static)), np.int64)
    else:
        attrs = {a.name: a.i for a in node.attribute}
        rank = len(static)
        start, end = attrs.get("start", 0), attrs.get("end", rank)
        value = np.array(static[slice(start, end)], np.int64)
    return helper.make_node("Constant", [], [node.output[0]],
                            value=onnx.numpy_helper.from_array(value))


def _why_no_where(model: onnx.ModelProto, branches: dict[str, onnx.GraphProto], max_nodes: int,
                  info: TensorInfo) -> str:
    """Why both branches cannot be computed and selected with Where ('' when they can)."""
    if model_opset(model) < 9:
        return f"opset {model_opset(model)} has no Where (9)"
    for key, body in branches.items():
        count = 0
        for sub in _all_nodes(body):
            count += 1
            if sub.op_type in ("Loop", "Scan"):
                return f"{key} holds a {sub.op_type} ({node_label(sub)})"
            if sub.op_type in _SIDE_EFFECTS:
                return f"{key} has side effects ({sub.op_type} {node_label(sub)})"
            if sub.domain not in ("", "ai.onnx"):
                return f"{key} holds an op of domain {sub.domain} ({node_label(sub)})"
        if count > max_nodes:
            return f"{key} has {count} nodes (more than {max_nodes} to compute when not taken)"
    outs = [[o.name for o in branches[k].output] for k in ("then_branch", "else_branch")]
    for a, b in zip(*outs, strict=True):
        ta, tb = info.types.get(a), info.types.get(b)
        if ta is None or ta != tb:
            return f"branch outputs {a} and {b} have different or unknown element types"
        sa, sb = info.shapes.get(a), info.shapes.get(b)
        if sa is None or sb is None:
            return f"the shape of branch output {a if sa is None else b} is not static"
        if sa != sb:
            return f"branch outputs of different shapes ({a} {list(sa)}, {b} {list(sb)})"
    return ""


def _all_nodes(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subs:
                yield from _all_nodes(sub)


class _Splicer:
    """Copies branch nodes into the main graph, renaming only names already taken."""

    def __init__(self, model: onnx.ModelProto, index: int, if_node: str) -> None:
        self.prefix = if_node
        graph = model.graph
        others = [n for i, n in enumerate(graph.node) if i != index]
        # Names anywhere else in the model (other bodies included) stay theirs.
        self.tensors: set[str] = {i.name for i in graph.input} | {o.name for o in graph.output}
        self.tensors |= {i.name for i in graph.initializer} | {v.name for v in graph.value_info}
        self.tensors |= set(graph.node[index].input) | set(graph.node[index].output)
        self.nodes: set[str] = {n.name for n in others if n.name}
        for n in others:
            for sub in _all_nodes_of(n):
                self.tensors |= set(sub.output) | set(sub.input)
                if sub.name:
                    self.nodes.add(sub.name)

    def name(self, base: str) -> str:
        return self._fresh(base, self.tensors)

    def node_name(self, base: str) -> str:
        return self._fresh(base, self.nodes)

    @staticmethod
    def _fresh(base: str, taken: set[str]) -> str:
        new, i = base, 2
        while new in taken:
            new, i = f"{base}_{i}", i + 1
        taken.add(new)
        return new

    def taken(self, body: onnx.GraphProto, node: onnx.NodeProto
              ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], list[onnx.ValueInfoProto]]:
        """The branch spliced so that it writes the If's outputs itself."""
        made = {o for n in body.node for o in n.output if o}
        outs = [o.name for o in body.output]
        direct = {b: out for b, out in zip(outs, node.output, strict=True)
                  if out and b in made and outs.count(b) == 1}
        rename = self._rename(body, "taken", fixed=direct)
        nodes, inits, infos = self._copy(body, rename)
        for b, out in zip(outs, node.output, strict=True):
            if out and b not in direct:
                nodes.append(helper.make_node("Identity", [rename.get(b, b)], [out],
                                              name=self.node_name(f"{self.prefix}__{out}")))
        return nodes, inits, infos

    def both(self, body: onnx.GraphProto, key: str) -> tuple[
            list[onnx.NodeProto], list[onnx.TensorProto], list[onnx.ValueInfoProto], list[str]]:
        """The branch spliced beside the other one; its outputs' new names."""
        rename = self._rename(body, key)
        nodes, inits, infos = self._copy(body, rename)
        return nodes, inits, infos, [rename.get(o.name, o.name) for o in body.output]

    def _rename(self, body: onnx.GraphProto, key: str,
                fixed: dict[str, str] | None = None) -> dict[str, str]:
        rename = dict(fixed or {})
        local = [i.name for i in body.initializer] + [o for n in body.node for o in n.output if o]
        for name in local:
            if name not in rename:
                rename[name] = self._fresh(name, self.tensors) if name not in self.tensors \
                    else self._fresh(f"{self.prefix}.{key}.{name}", self.tensors)
        return rename

    def _copy(self, body: onnx.GraphProto, rename: dict[str, str]) -> tuple[
            list[onnx.NodeProto], list[onnx.TensorProto], list[onnx.ValueInfoProto]]:
        nodes = []
        for n in body.node:
            copy = onnx.NodeProto()
            copy.CopyFrom(n)
            _rename_refs(copy, rename)
            del copy.output[:]
            copy.output.extend(rename.get(o, o) for o in n.output)
            label = node_label(n)
            copy.name = self.node_name(label if label not in self.nodes
                                       else f"{self.prefix}.{label}")
            nodes.append(copy)
        inits = []
        for init in body.initializer:
            copy = onnx.TensorProto()
            copy.CopyFrom(init)
            copy.name = rename[init.name]
            inits.append(copy)
        infos = []
        for info in body.value_info:
            if info.name in rename:
                copy = onnx.ValueInfoProto()
                copy.CopyFrom(info)
                copy.name = rename[info.name]
                infos.append(copy)
        return nodes, inits, infos


def _all_nodes_of(node: onnx.NodeProto) -> Iterable[onnx.NodeProto]:
    for attr in node.attribute:
        subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for sub in subs:
            yield from _all_nodes(sub)


def _rename_refs(node: onnx.NodeProto, rename: dict[str, str]) -> None:
    """Point `node`'s inputs, and the outer reads of its subgraphs, at renamed tensors."""
    for i, name in enumerate(node.input):
        if name in rename:
            node.input[i] = rename[name]
    for attr in node.attribute:
        subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for sub in subs:
            own = {i.name for i in sub.input} | {i.name for i in sub.initializer}
            own |= {o for n in sub.node for o in n.output}
            inner = {k: v for k, v in rename.items() if k not in own}
            for n in sub.node:
                _rename_refs(n, inner)
            for out in sub.output:
                if out.name in inner:
                    out.name = inner[out.name]


def _finish(model: onnx.ModelProto, index: int, nodes: list[onnx.NodeProto],
            inits: list[onnx.TensorProto], infos: list[onnx.ValueInfoProto],
            why: str) -> RewriteResult:
    """The model with node `index` replaced by `nodes` in place (the order stays topological:
    a body reads only tensors written before its If), checked."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    kept = list(graph.node)
    del graph.node[:]
    graph.node.extend([*kept[:index], *nodes, *kept[index + 1:]])
    graph.initializer.extend(inits)
    graph.value_info.extend(infos)
    go.check_model(out)
    return RewriteResult(out, True, why, {"nodes": [node_label(n) for n in nodes]})
