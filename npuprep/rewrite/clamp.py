"""Clamp: `Exp(x) -> Exp(Clip(x, max=10.4))`, `Div(a, d) -> Div(a, guard(d))`, declared bounds `t -> Clip(t, lo, hi)`.

A clamp changes numbers only where they were already wrong on the target (past its range,
or a denominator so close to 0 that the quotient overflows); saturating explicitly makes
every board behave the same. Declines, with the reason, when the tensor is already bounded
within the requested range (by a Clip, Sigmoid, Tanh, Softmax, Relu6 ...).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from npuprep.errors import NpuprepError
from npuprep.graph import node_label, tensor_types, walk_graphs
from npuprep.model_io import model_opset
from npuprep.numerics import NumberFormat
from npuprep.ops import BOUNDED_OUTPUTS, LAYOUT_OPS
from npuprep.rewrite import graph_ops as go
from npuprep.rewrite.result import RewriteResult

Bounds = tuple[float | None, float | None]


def exp_input_bound(fmt: NumberFormat, headroom: float) -> float:
    """Largest Exp input whose result stays within headroom * max: ln(headroom * max)."""
    return math.log(headroom * fmt.max)


def square_input_bound(fmt: NumberFormat, headroom: float) -> float:
    """Largest |x| whose square stays within headroom * max: sqrt(headroom * max)."""
    return math.sqrt(headroom * fmt.max)


def apply_clamp(
    model: onnx.ModelProto,
    tensor: str,
    lo: float | None,
    hi: float | None,
    *,
    consumers: list[str] | None = None,
) -> RewriteResult:
    """Clip `tensor` to [lo, hi] (None: unbounded on that side).

    Without `consumers` every reader sees the clipped tensor, which keeps its name (the
    producer then writes `<tensor>__unclamped`); with `consumers` only those nodes read a
    new `<tensor>__clamped`.
    """
    if lo is None and hi is None:
        raise NpuprepError(f"clamp '{tensor}': give at least one of lo and hi")
    if lo is not None and hi is not None and lo > hi:
        raise NpuprepError(f"clamp '{tensor}': lo {lo} is above hi {hi}")
    graph = go.import_graph(model)
    owner, target = _find_tensor(graph, tensor)
    dtype = _float_dtype(target, tensor_types(model))
    if dtype is None:
        return RewriteResult(model, False, f"clamp skipped: '{tensor}' is not a float tensor",
                             {"tensor": tensor})
    known = bounds(target)
    if _within(known, lo, hi):
        return RewriteResult(model, False, f"clamp skipped: {_describe(target, known)} already "
                             f"bounds '{tensor}' within [{_fmt(lo)}, {_fmt(hi, 'inf')}]",
                             {"tensor": tensor, "known_bounds": list(known)})
    # Readers in any graph: a body may read the tensor from the outer scope.
    everywhere = {id(n) for g in _all_graphs(graph) for n in g.nodes}
    readers = [n for n in target.outputs if id(n) in everywhere]
    if consumers is not None:
        wanted = set(consumers)
        readers = [n for n in readers if go.node_label(n) in wanted]
        missing = wanted - {go.node_label(n) for n in readers}
        if missing:
            raise NpuprepError(f"clamp '{tensor}': node '{sorted(missing)[0]}' does not read it")
    opset = model_opset(model)
    name = go.unique_name(graph, f"clamp_{tensor}")
    prod = go.producer(target)
    if consumers is None and prod is not None:
        raw = gs.Variable(go.unique_name(graph, f"{tensor}__unclamped"), dtype=target.dtype,
                          shape=target.shape)
        prod.outputs[prod.outputs.index(target)] = raw
        clip = _clip(name, raw, target, lo, hi, dtype, opset)
        clamped = target
    else:
        clamped = gs.Variable(go.unique_name(graph, f"{tensor}__clamped"), dtype=target.dtype,
                              shape=target.shape)
        clip = _clip(name, target, clamped, lo, hi, dtype, opset)
        for node in readers:
            for i, t in enumerate(node.inputs):
                if t is target:
                    go.replace_input(node, i, clamped)
    owner.nodes.append(clip)
    out = go.finish(graph, model)
    return RewriteResult(out, True, f"'{tensor}' clipped to [{_fmt(lo)}, {_fmt(hi, 'inf')}]",
                         {"tensor": tensor, "lo": lo, "hi": hi, "clip_node": name,
                          "clamped_tensor": clamped.name,
                          "consumers": sorted(go.node_label(n) for n in readers)})


def clamp_exp_input(model: onnx.ModelProto, exp_node: str, bound: float) -> RewriteResult:
    """`Exp(x) -> Exp(Clip(x, max=bound))` for this Exp only (see exp_input_bound)."""
    node = _op_node(model, exp_node, ("Exp",))
    return apply_clamp(model, node.input[0], None, bound, consumers=[exp_node])


def clamp_square_input(model: onnx.ModelProto, square_node: str, bound: float) -> RewriteResult:
    """`Mul(x, x)` or `Pow(x, 2)` -> the same on `Clip(x, -bound, bound)` (see square_input_bound)."""
    node = _op_node(model, square_node, ("Mul", "Pow"))
    if node.op_type == "Mul" and node.input[0] != node.input[1]:
        raise NpuprepError(f"clamp square: node '{square_node}' is a Mul of two different tensors")
    return apply_clamp(model, node.input[0], -bound, bound, consumers=[square_node])


def guard_denominator(model: onnx.ModelProto, div_node: str, eps: float) -> RewriteResult:
    """`Div(a, d) -> Div(a, Where(|d| < eps, sign(d) * eps, d))` (0 counts as positive).

    Also accepts a Reciprocal. Declines when the denominator is a constant or already
    bounded away from 0 by at least eps.
    """
    if not eps > 0:
        raise NpuprepError(f"guard '{div_node}': eps must be positive (got {eps})")
    graph = go.import_graph(model)
    node = _find_node_any(graph, div_node)
    if node is None:
        raise NpuprepError(f"guard: node '{div_node}' not found")
    if node.op not in ("Div", "Reciprocal"):
        raise NpuprepError(f"guard: node '{div_node}' is a {node.op}, not a Div or Reciprocal")
    index = 1 if node.op == "Div" else 0
    den = node.inputs[index]
    value = go.const_value(den)
    if value is not None:
        small = int(np.count_nonzero(np.abs(value) < eps))
        why = (f"it holds {small} value(s) with |d| < {eps:g}; fix the constant itself" if small
               else f"its smallest |d| is {float(np.abs(value).min()):g} >= {eps:g}")
        return RewriteResult(model, False, f"guard skipped: the denominator of '{div_node}' is a "
                             f"constant and {why}", {"node": div_node})
    dtype = _float_dtype(den, tensor_types(model))
    if dtype is None:
        return RewriteResult(model, False, f"guard skipped: the denominator of '{div_node}' is not "
                             "a float tensor", {"node": div_node})
    low = abs_lower_bound(den)
    if low is not None and low >= eps:
        return RewriteResult(model, False, f"guard skipped: the denominator '{den.name}' of "
                             f"'{div_node}' is already at least {low:g} >= {eps:g} in magnitude "
                             f"({_describe(den, (low, None))})", {"node": div_node})
    owner = _owner_graph(graph, node)
    base = go.unique_name(graph, f"guard_{go.node_label(node)}")
    t = lambda suffix, dt=dtype: gs.Variable(f"{base}_{suffix}", dtype=dt, shape=den.shape)  # noqa: E731
    absd, small, neg, sgn, safe = t("abs"), t("small", np.bool_), t("neg", np.bool_), t("eps"), t("den")
    eps_c = gs.Constant(f"{base}_eps_value", np.array(eps, dtype))
    neg_eps_c = gs.Constant(f"{base}_neg_eps_value", np.array(-eps, dtype))
    zero_c = gs.Constant(f"{base}_zero", np.array(0, dtype))
    owner.nodes.extend([
        gs.Node("Abs", f"{base}_abs", inputs=[den], outputs=[absd]),
        gs.Node("Less", f"{base}_small", inputs=[absd, eps_c], outputs=[small]),
        gs.Node("Less", f"{base}_neg", inputs=[den, zero_c], outputs=[neg]),
        gs.Node("Where", f"{base}_sign", inputs=[neg, neg_eps_c, eps_c], outputs=[sgn]),
        gs.Node("Where", f"{base}_den", inputs=[small, sgn, den], outputs=[safe]),
    ])
    go.replace_input(node, index, safe)
    out = go.finish(graph, model)
    return RewriteResult(out, True, f"denominator '{den.name}' of '{div_node}' kept at least "
                         f"{eps:g} away from 0 (sign kept)",
                         {"node": div_node, "eps": eps, "guarded_tensor": safe.name,
                          "guard_nodes": [f"{base}_{s}" for s in ("abs", "small", "neg", "sign", "den")]})


def bounds(tensor: gs.Tensor, depth: int = 8) -> Bounds:
    """Static [lo, hi] of a tensor from its producers (None: unknown on that side)."""
    value = go.const_value(tensor)
    if value is not None and value.size and value.dtype.kind == "f":
        return float(value.min()), float(value.max())
    node = go.producer(tensor)
    if node is None or depth == 0:
        return None, None
    op = node.op
    inner = (lambda i=0: bounds(node.inputs[i], depth - 1))  # noqa: E731
    if op in BOUNDED_OUTPUTS:
        return BOUNDED_OUTPUTS[op]
    if op in ("Exp", "Softplus"):
        return 0.0, None
    if op == "Abs" or op == "Mul" and node.inputs[0] is node.inputs[1]:
        return 0.0, None
    if op == "Relu":
        lo, hi = inner()
        return max(0.0, lo if lo is not None else 0.0), hi
    if op == "Clip":
        lo, hi = inner()
        cmin = go.scalar_operand(node, 1, "min")
        cmax = go.scalar_operand(node, 2, "max")
        return _tighter_lo(lo, cmin), _tighter_hi(hi, cmax)
    if op == "Sqrt":
        lo, hi = inner()
        return (math.sqrt(lo) if lo is not None and lo >= 0 else 0.0,
                math.sqrt(hi) if hi is not None and hi >= 0 else None)
    if op in ("Add",):
        (alo, ahi), (blo, bhi) = inner(0), inner(1)
        return (alo + blo if alo is not None and blo is not None else None,
                ahi + bhi if ahi is not None and bhi is not None else None)
    if op in LAYOUT_OPS or op in ("ReduceMean", "ReduceMax", "ReduceMin", "MaxPool", "AveragePool",
                                  "GlobalAveragePool"):
        return inner()
    if op == "Max":
        los = [bounds(t, depth - 1)[0] for t in node.inputs]
        known = [x for x in los if x is not None]
        return (max(known) if known else None), None
    return None, None


def abs_lower_bound(tensor: gs.Tensor) -> float | None:
    """A static lower bound on |tensor|, when its bounds exclude an interval around 0."""
    lo, hi = bounds(tensor)
    if lo is not None and lo > 0:
        return lo
    if hi is not None and hi < 0:
        return -hi
    return None


def _tighter_lo(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _tighter_hi(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _within(known: Bounds, lo: float | None, hi: float | None) -> bool:
    klo, khi = known
    lo_ok = lo is None or (klo is not None and klo >= lo)
    hi_ok = hi is None or (khi is not None and khi <= hi)
    return lo_ok and hi_ok


def _describe(tensor: gs.Tensor, known: Bounds) -> str:
    node = go.producer(tensor)
    what = f"{node.op} '{go.node_label(node)}'" if node is not None else "its constant value"
    return f"{what} (range [{_fmt(known[0])}, {_fmt(known[1], 'inf')}])"


def _fmt(x: float | None, unbounded: str = "-inf") -> str:
    return unbounded if x is None else f"{x:g}"


def _clip(name: str, src: gs.Tensor, dst: gs.Tensor, lo: float | None, hi: float | None,
          dtype: np.dtype, opset: int) -> gs.Node:
    if opset < 11:
        big = float(np.finfo(dtype).max)
        attrs = {"min": float(-big if lo is None else lo), "max": float(big if hi is None else hi)}
        return gs.Node("Clip", name, attrs=attrs, inputs=[src], outputs=[dst])
    empty = gs.Variable.empty()
    lo_t = gs.Constant(f"{name}_min", np.array(lo, dtype)) if lo is not None else empty
    hi_t = gs.Constant(f"{name}_max", np.array(hi, dtype)) if hi is not None else gs.Variable.empty()
    inputs = [src, lo_t, hi_t] if hi is not None else [src, lo_t]
    return gs.Node("Clip", name, inputs=inputs, outputs=[dst])


def _float_dtype(tensor: gs.Tensor, types: dict[str, int]) -> np.dtype | None:
    """The tensor's numpy float type from shape inference (FP32 when inference is silent)."""
    onnx_type = types.get(tensor.name)
    if onnx_type is None:
        return np.dtype(np.float32) if tensor.dtype is None else _np_float(tensor.dtype)
    if onnx_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE):
        return None
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(onnx_type))


def _np_float(dtype: object) -> np.dtype | None:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None
    return dt if dt.kind == "f" else None


def _all_graphs(graph: gs.Graph) -> list[gs.Graph]:
    return [graph, *graph.subgraphs(recursive=True)]


def _find_tensor(graph: gs.Graph, name: str) -> tuple[gs.Graph, gs.Tensor]:
    """The graph that produces (or takes as input) `name`, and the tensor."""
    for g in _all_graphs(graph):
        for t in g.inputs:
            if t.name == name:
                return g, t
        for node in g.nodes:
            for t in node.outputs:
                if t.name == name:
                    return g, t
    raise NpuprepError(f"clamp: tensor '{name}' not found (not a graph input or node output)")


def _find_node_any(graph: gs.Graph, label: str) -> gs.Node | None:
    for g in _all_graphs(graph):
        found = go.find_node(g, label)
        if found is not None:
            return found
    return None


def _owner_graph(graph: gs.Graph, node: gs.Node) -> gs.Graph:
    return next(g for g in _all_graphs(graph) if any(n is node for n in g.nodes))


def _op_node(model: onnx.ModelProto, label: str, ops: tuple[str, ...]) -> onnx.NodeProto:
    for scope in walk_graphs(model.graph):
        for node in scope.graph.node:
            if node_label(node) == label:
                if node.op_type not in ops:
                    raise NpuprepError(f"clamp: node '{label}' is a {node.op_type}, not {'/'.join(ops)}")
                return node
    raise NpuprepError(f"clamp: node '{label}' not found")
