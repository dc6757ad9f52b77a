"""A rotation written as two Slices is one op: `Concat(Slice(x, h:), Slice(x, :h))` -> `Gather(x, [h..n-1, 0..h-1])`.

Exporters write a half swap this way (diffusers' `flip_sin_to_cos` timestep embedding:
`cat([emb[:, h:], emb[:, :h]])`), and rknn-toolkit2 2.5.0's build dies of SIGSEGV on it when
the Slices carry their `steps` input (measured on a diffusers UNet, BENCHMARKS.md). Where x is itself `Concat(a, b)` split at h
along the same axis the rotation is `Concat(b, a)`; otherwise a Gather with constant indices.
Both only move values: exact in any precision. The Concat's name and output are kept.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from npuprep.graph import infer_tensors
from npuprep.rewrite import graph_ops as go
from npuprep.rewrite.result import RewriteResult, sites_result


def rotations_as_one_op(model: onnx.ModelProto,
                        sizes: Mapping[str, tuple[int, ...]] | None = None) -> RewriteResult:
    """Replace every main-graph two-Slice rotation. details: "replaced", "declined" {Concat: why}.

    `sizes`: tensor shapes measured on a sample, for tensors whose shape inference leaves
    unknown (a target that fixes its input sizes, as rknn-toolkit2 does, keeps them).
    """
    if not any(n.op_type == "Concat" for n in model.graph.node):
        return RewriteResult(model, False, "no Concat", {"replaced": {}, "declined": {}})
    dims = {**infer_tensors(model).dims, **{k: tuple(v) for k, v in (sizes or {}).items()}}
    graph = go.import_graph(model)
    replaced: dict[str, str] = {}
    declined: dict[str, str] = {}
    for cat in [n for n in graph.nodes if n.op == "Concat" and len(n.inputs) == 2]:
        found = _rotation(cat, dims)
        if found is None:
            continue
        label = go.node_label(cat)
        if isinstance(found, str):
            declined[label] = found
            continue
        x, h, n, axis = found
        out = cat.outputs[0]
        cat.outputs.clear()
        halves = _split_at(x, h, axis, dims)
        if halves is not None:
            graph.nodes.append(gs.Node("Concat", label, attrs={"axis": axis},
                                       inputs=[halves[1], halves[0]], outputs=[out]))
            replaced[label] = f"rotation of {x.name} by {h}: Concat of its two parts swapped"
            continue
        index = gs.Constant(go.unique_name(graph, f"{label}.rotation"),
                            np.r_[np.arange(h, n), np.arange(h)].astype(np.int64))
        graph.nodes.append(gs.Node("Gather", label, attrs={"axis": axis}, inputs=[x, index],
                                   outputs=[out]))
        replaced[label] = f"rotation of {x.name} by {h} along axis {axis}: one Gather"
    return sites_result(model, lambda: go.finish(graph, model), replaced, declined,
                        nothing="no Concat of two Slices that rotates a tensor",
                        done=f"{len(replaced)} two-Slice rotation(s) as one op")


def _rotation(cat: gs.Node, dims: dict) -> tuple[gs.Tensor, int, int, int] | str | None:
    """(x, h, n, axis) when `cat` is `Concat(Slice(x, h:n), Slice(x, 0:h))`; a reason when it
    nearly is; None when it is not."""
    first, second = (go.producer(t) for t in cat.inputs)
    if first is None or second is None or first.op != "Slice" or second.op != "Slice":
        return None
    x = first.inputs[0]
    if second.inputs[0] is not x:
        return None
    shape = dims.get(x.name)
    if not shape:
        return f"the rank of {x.name} is unknown"
    rank = len(shape)
    axis = int(cat.attrs.get("axis", 0)) % rank
    a, b = _range(first, rank), _range(second, rank)
    if a is None or b is None or a[0] != axis or b[0] != axis:
        return None
    n = shape[axis]
    if n is None:
        return f"{x.name} has no static size along axis {axis}"
    (h, a_end), (b_start, b_end) = ((min(v + n if v < 0 else v, n) for v in r[1:]) for r in (a, b))
    if not 0 < h < n or a_end != n or b_start != 0 or b_end != h:
        return None
    return x, h, n, axis


def _range(node: gs.Node, rank: int) -> tuple[int, int, int] | None:
    """(axis, start, end) of a one-axis, step-1 Slice with constant bounds, else None."""
    if len(node.inputs) >= 3:  # opset 10+: bounds as inputs
        parts = [go.const_value(t) if t.name else None for t in node.inputs[1:]]
        starts, ends = parts[0], parts[1]
        axes = parts[2] if len(parts) > 2 and parts[2] is not None else np.arange(np.size(starts))
        steps = parts[3] if len(parts) > 3 and parts[3] is not None else np.ones(1)
    else:  # older: attributes
        starts, ends = node.attrs.get("starts"), node.attrs.get("ends")
        axes, steps = node.attrs.get("axes", range(len(starts or ()))), np.ones(1)
    if starts is None or ends is None or np.size(starts) != 1 or np.size(axes) != 1:
        return None
    if np.size(steps) != 1 or int(np.ravel(steps)[0]) != 1:
        return None
    return int(np.ravel(axes)[0]) % rank, int(np.ravel(starts)[0]), int(np.ravel(ends)[0])


def _split_at(x: gs.Tensor, h: int, axis: int, dims: dict) -> tuple[gs.Tensor, gs.Tensor] | None:
    """(a, b) when x = Concat(a, b) along `axis` with a of size h there, else None."""
    made = go.producer(x)
    if made is None or made.op != "Concat" or len(made.inputs) != 2:
        return None
    first = dims.get(made.inputs[0].name)
    if first is None or int(made.attrs.get("axis", 0)) % len(first) != axis:
        return None
    return (made.inputs[0], made.inputs[1]) if first[axis] == h else None
