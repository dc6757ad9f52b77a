"""Rescale a scale domain: `Conv(x, W, B) -> ... -> Conv(y, V)` becomes `Conv(x, W*s, B*s) -> ... -> Conv(y, V/s)`.

The scale s = 2^-k is a power of two, so multiplying by it adds no rounding: the rewritten
FP32 graph computes the same function. Each tensor of the domain carries an integer
exponent p (its values are 2^p times the reference). The exponent enters at an *entry* (a
producer with constant weights, an affine normalisation, a Mul/Div by a constant, or a graph
input or block output that gets `Mul(x, 2^-k)`), travels forward through ops that commute
with positive scaling or transform it exactly (`Mul(x, x)` doubles it, `Sqrt` halves it, a Div of two
scaled tensors subtracts), and is *absorbed* where it returns to 0: a linear consumer with
constant weights, a scale-invariant normalisation (epsilon * s^2), BatchNormalization (mean
and variance folded), a Mul/Div by a constant that takes the factor, a Log (one added
constant, npuprep.rewrite.log_offset; a linear node on the way to it passes the scale on), or
a graph output
(an FP32 exit `Mul(y, 1/s)`, to be kept FP32 at lowering). A Mul/Div by a constant passes
the exponent on unless a reader further down is not scale-free (Exp, Sigmoid, an Add of a
tensor that cannot join): then the nearest such factor on every scaled path absorbs it,
while its input keeps the scale for its other readers. Residual adds and concats force
every branch into the same exponent: the other branch's producer becomes an entry too when
it can. A weight read by several nodes is scaled once for all of them, so each other reader
absorbs the same factor or joins the domain as an entry (classifier-free guidance's two
branches). Otherwise the rescale is declined with a reason.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from npuprep.errors import NpuprepError
from npuprep.graph import tensor_types
from npuprep.rewrite import graph_ops as go
from npuprep.rewrite.result import RewriteResult
from npuprep.rewrite.scale_domain import DomainSolver, RescaleCheck, Retry


def check_rescale(model: onnx.ModelProto, entry: str, k: int) -> RescaleCheck:
    """Can scaling `entry` by s = 2^-k be compensated exactly? (Reads only.)

    `entry` is a node name (a producer), a graph input name, or a tensor name (its
    producer is used). A negative k scales up (the underflow remedy).
    """
    graph = go.import_graph(model)
    _type_entry(graph, model, entry)
    solver = _solve(graph, entry, k)
    return solver.check


def apply_rescale(model: onnx.ModelProto, entry: str, k: int,
                  run_checker: bool = True) -> RewriteResult:
    """Scale `entry` by s = 2^-k and compensate; the FP32 function is unchanged.

    details: "tensor_scales" {tensor: s_total} for every tensor whose values changed
    (candidate = s_total * reference), "fp32_nodes" (inserted boundary Muls, to keep FP32
    at lowering), "input_nodes" {Mul on an entry graph input or tensor: that tensor} (FP32
    only needed while the tensor exceeds the target), "entries", "absorbers", "exits", "k", and "scaled_constants" {constant:
    exponent, absmax, min_nonzero} so a caller can see weights pushed towards the target's
    subnormals (an epsilon scaled by s^2, say). `run_checker=False` skips onnx.checker on the
    result: its full check re-infers every shape of the model (seconds on a transformer), so
    a series of rescales checks once at its end and a planner reading only the details not
    at all.
    """
    graph = go.import_graph(model)
    _type_entry(graph, model, entry)
    solver = _solve(graph, entry, k)
    check = solver.check
    if not check:
        return RewriteResult(model, False, check.reason, {"k": k, "entry": entry})
    fp32_nodes = solver.apply(graph)
    out = go.finish(graph, model, run_checker)
    scales = {t: float(2.0**p) for t, p in sorted(check.exponents.items())
              if p != 0 and t not in solver.renamed}
    details = {
        "k": k,
        "entry": entry,
        "tensor_scales": scales,
        "fp32_nodes": fp32_nodes,
        "input_nodes": solver.input_nodes,
        "entries": [e.__dict__ for e in check.entries],
        "absorbers": [a.__dict__ for a in check.absorbers],
        "exits": list(check.exits),
        "scaled_constants": dict(sorted(solver.scaled_constants.items())),
    }
    return RewriteResult(out, True, check.reason, details)


def _type_entry(graph: gs.Graph, model: onnx.ModelProto, entry: str) -> None:
    """An entry naming an intermediate tensor gets its element type from shape inference
    (graph surgeon knows only the types the file declares)."""
    tensor = graph.tensors().get(entry)
    if tensor is None or tensor.dtype is not None or go.find_node(graph, entry) is not None:
        return
    elem = tensor_types(model).get(entry)
    if elem is not None:
        tensor.dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)


def _solve(graph: gs.Graph, entry: str, k: int) -> DomainSolver:
    if not isinstance(k, int | np.integer) or k == 0:
        raise NpuprepError(f"rescale '{entry}': k must be a non-zero integer (got {k!r})")
    best = _fixpoint(graph, entry, int(k), set())
    if not best.check or not best.check.exits:
        return best
    # Absorbing at a constant factor is free, an FP32 exit at a graph output is not: let
    # each Mul/Div by a constant that passed the scale on absorb it instead, where that
    # leaves fewer exits and the analysis still succeeds.
    candidates = [nid for nid, role in sorted(best.roles.items(), key=lambda r: best.order[r[0]])
                  if role == "propagate" and best.nodes[nid].op in ("Mul", "Div")
                  and best._const_index(best.nodes[nid]) is not None]
    for nid in candidates:
        try:
            trial = _fixpoint(graph, entry, int(k), best.absorb_at | {nid})
        except AssertionError:
            continue
        if trial.check and len(trial.check.exits) < len(best.check.exits):
            best = trial
    return best


def _fixpoint(graph: gs.Graph, entry: str, k: int, absorb_at: set[int]) -> DomainSolver:
    propagate_at: set[int] = set()
    for _ in range(2 * len(graph.nodes) + 1):
        solver = DomainSolver(graph, entry, k, absorb_at, propagate_at)
        try:
            solver.run()
        except Retry as retry:
            if retry.propagate:
                propagate_at = propagate_at | retry.node_ids
            else:
                absorb_at = absorb_at | retry.node_ids
            continue
        return solver
    raise AssertionError("rescale analysis did not converge")


