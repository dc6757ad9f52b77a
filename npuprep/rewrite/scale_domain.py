"""The exponent's walk through a scale domain: tensor -> p (values 2^p times the reference), per-node edits.

`DomainSolver` is the fixed point npuprep.rewrite.rescale runs: from the entry, the exponent
travels forward through ops that commute with positive scaling or transform it exactly, and
returns to 0 at absorbers; a conflict restarts it (`Retry`) with more absorbers, and a domain
that cannot be closed exactly raises `Decline` with the user-facing reason. `apply` edits
the graph surgeon graph once the domain is known.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from npuprep.errors import NpuprepError
from npuprep.ops import (
    COMMUTES_WITH_SCALING,
    COMPARISONS,
    JOINS_SCALES,
    LAYOUT_OPS,
    MAC_OPS,
    MAC_WEIGHT_INPUTS,
    SCALE_FREE_OUTPUTS,
    SCALE_INVARIANT_NORMS,
    SCALE_POWERS,
    SCALED_ALL_OUTPUTS,
)
from npuprep.rewrite import graph_ops as go
from npuprep.rewrite.log_offset import add_log_offset

# Affine normalisations an entry can scale (gamma, beta); LpNormalization has none.
AFFINE_NORMS = {op: idx for op, idx in SCALE_INVARIANT_NORMS.items() if idx}


class Decline(Exception):
    """The domain cannot be closed exactly; the message is the user-facing reason."""


class Retry(Exception):
    """Analysis must restart with `nodes` absorbing the scale (Mul/Div by a constant) or,
    for a linear consumer, letting it pass (`propagate`: a concat or add needs it scaled)."""

    def __init__(self, node_ids: set[int], propagate: bool = False) -> None:
        super().__init__(sorted(node_ids))
        self.node_ids = frozenset(node_ids)
        self.propagate = propagate



@dataclass(frozen=True)
class Absorber:
    """Where the scale returns to 1: node, how (`weights`, `epsilon`, `batchnorm`, `constant`)."""

    node: str
    kind: str
    exponent: int


@dataclass(frozen=True)
class Entry:
    """Where the scale enters: a node (`weights`, `norm_affine`, `constant`), a `graph_input`,
    or a `tensor` whose producer has no weights (an exact Mul is inserted after it)."""

    name: str
    kind: str
    exponent: int



@dataclass(frozen=True)
class RescaleCheck:
    """Whether a rescale is exact, and the domain it would touch. Truthy when feasible.

    `exponents`: tensor -> p (its values become 2^p times the reference; 0 after absorbers
    whose outputs are unchanged). `exits`: graph outputs that get an FP32 `Mul(y, 2^-p)`.
    """

    feasible: bool
    reason: str
    entry: str
    k: int
    exponents: dict[str, int] = field(default_factory=dict)
    entries: tuple[Entry, ...] = ()
    absorbers: tuple[Absorber, ...] = ()
    exits: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.feasible


class DomainSolver:
    """Fixed point over the graph: exponents per tensor, edits per node."""

    def __init__(self, graph: gs.Graph, entry: str, k: int, absorb_at: set[int],
                 propagate_at: set[int]) -> None:
        self.graph = graph
        self.entry = entry
        self.k = k
        self.absorb_at = absorb_at
        self.propagate_at = propagate_at
        self.order = {id(n): i for i, n in enumerate(topological_nodes(graph))}
        self.nodes = {id(n): n for n in graph.nodes}
        self.exps: dict[str, int] = {}
        self.roles: dict[int, str] = {}
        self.const_edits: dict[tuple[int, int], int] = {}
        self.attr_edits: dict[tuple[int, str], float] = {}
        self.input_entries: dict[str, int] = {}
        self.entries: list[Entry] = []
        self.absorbers: dict[str, Absorber] = {}
        self.heap: list[tuple[int, int]] = []
        self.renamed: set[str] = set()
        self.input_nodes: dict[str, str] = {}
        self.scaled_constants: dict[str, dict[str, float]] = {}
        # A weight read by several nodes is scaled once for all of them: exponent, first editor.
        self.shared: dict[str, tuple[int, str]] = {}
        self.pending: list[tuple[gs.Node, gs.Tensor]] = []
        self.joined: list[str] = []
        self.log_offsets: dict[int, int] = {}
        self.check = RescaleCheck(False, "not analysed", entry, k)

    # -- analysis -------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._start()
            while True:
                while self.heap:
                    _, nid = heapq.heappop(self.heap)
                    self._visit(self.nodes[nid])
                if not self.pending:
                    break
                # Only once the domain has settled can an untouched reader of a shared weight
                # be told apart from one the scale still has to reach.
                self._close_shared(*self.pending.pop(0))
            # An entered input or tensor keeps its reference values; its readers get a copy.
            exits = tuple(t.name for t in self.graph.outputs
                          if self.exps.get(t.name, 0) != 0 and t.name not in self.input_entries)
        except Decline as exc:
            reason = str(exc)
            if self.joined:
                reason += f" (the scale spread there through shared weights: {'; '.join(self.joined)})"
            self.check = RescaleCheck(False, reason, self.entry, self.k,
                                      dict(sorted(self.exps.items())), tuple(self.entries),
                                      tuple(self.absorbers.values()))
            return
        s = f"2^{-self.k}"
        where = ", ".join(sorted(set(self.absorbers) | {f"output {e}" for e in exits}))
        reason = (f"scale s={s} enters at {', '.join(e.name for e in self.entries)} and is "
                  f"absorbed exactly at {where or 'nothing (no scaled tensor is read)'}")
        self.check = RescaleCheck(True, reason, self.entry, self.k, dict(sorted(self.exps.items())),
                                  tuple(self.entries), tuple(self.absorbers.values()), exits)

    def _start(self) -> None:
        p = -self.k
        inp = go.graph_input(self.graph, self.entry)
        if inp is not None:
            self._enter_input(inp, p)
            return
        node = go.find_node(self.graph, self.entry)
        if node is None:
            tensor = self.graph.tensors().get(self.entry)
            node = go.producer(tensor) if tensor is not None else None
            if node is not None and not self._has_entry_weights(node):
                # A block output whose producer carries no weights (a residual Add, an
                # activation): the scale enters through an exact Mul on the tensor itself.
                self._enter_input(tensor, p, kind="tensor")
                return
        if node is None:
            raise NpuprepError(f"rescale: '{self.entry}' is neither a node, a graph input nor a "
                               "tensor of the main graph")
        self._enter_node(node, p, f"entry {self.entry}")

    def _has_entry_weights(self, node: gs.Node) -> bool:
        if node.op in MAC_OPS:
            return self._weight_index(node) is not None
        if node.op in AFFINE_NORMS:
            return True
        return node.op in ("Mul", "Div") and self._const_index(node) is not None

    def _assign(self, tensor: gs.Tensor, p: int, why: str) -> None:
        name = tensor.name
        if name in self.exps:
            prod = go.producer(tensor)
            if (self.exps[name] == 0 and p != 0 and prod is not None
                    and self.roles.get(id(prod)) == "absorb" and prod.op in MAC_OPS
                    and id(prod) not in self.propagate_at):
                # The linear consumer absorbed the scale, but a residual needs it scaled.
                raise Retry({id(prod)}, propagate=True)
            if self.exps[name] != p:
                raise Decline(f"tensor '{name}' would need scale 2^{p} ({why}) but already carries "
                               f"2^{self.exps[name]}; the scale domain cannot be closed")
            return
        self.exps[name] = p
        if p == 0:
            return
        consumers, captured = go.main_consumers(self.graph, tensor)
        if captured:
            raise Decline(f"scaled tensor '{name}' is read inside an If/Loop/Scan body")
        for node in consumers:
            heapq.heappush(self.heap, (self.order[id(node)], id(node)))

    def _role(self, node: gs.Node, role: str) -> None:
        old = self.roles.get(id(node))
        if old is not None and old != role:
            raise Decline(f"node '{go.node_label(node)}' would be both {old} and {role} of the "
                           "scale domain")
        self.roles[id(node)] = role

    def _const_edit(self, node: gs.Node, index: int, e: int) -> None:
        key = (id(node), index)
        if self.const_edits.get(key, e) != e:
            raise Decline(f"constant input {index} of '{go.node_label(node)}' would need two scales")
        value = go.const_value(node.inputs[index])
        if not go.is_float_array(value):
            raise Decline(f"input {index} of '{go.node_label(node)}' is not a float constant")
        if go.exact_pow2_scale(value, e) is None:
            raise Decline(f"constant input {index} of '{go.node_label(node)}' cannot be scaled by "
                           f"2^{e} exactly in {value.dtype} (it would overflow or underflow)")
        self.const_edits[key] = e

    def _weight_edit(self, node: gs.Node, index: int, e: int, what: str) -> None:
        """Scale a weight by 2^e. A weight shared by several nodes is scaled for all of them
        (one copy, no growth); each other reader must then absorb or carry 2^e too."""
        tensor = node.inputs[index]
        label = go.node_label(node)
        consumers, captured = go.main_consumers(self.graph, tensor)
        if captured or go.is_graph_output(self.graph, tensor):
            raise Decline(f"{what} '{tensor.name}' of '{label}' is shared with other nodes; "
                           "scaling it would change them too")
        if len(consumers) > 1:
            prev = self.shared.get(tensor.name)
            if prev is not None and prev[0] != e:
                raise Decline(f"{what} '{tensor.name}' of '{label}' is shared with other nodes: "
                               f"'{label}' needs it scaled by 2^{e}, '{prev[1]}' by 2^{prev[0]}")
            if prev is None:
                self.shared[tensor.name] = (e, label)
                others = {id(c): c for c in consumers if c is not node}
                self.pending += [(c, tensor) for c in others.values()]
        self._const_edit(node, index, e)

    def _close_shared(self, node: gs.Node, tensor: gs.Tensor) -> None:
        """`node` reads the shared weight `tensor`, scaled by 2^e for another node: it must
        already take exactly that edit, or join the domain as an entry carrying 2^e."""
        e, first = self.shared[tensor.name]
        label = go.node_label(node)
        idxs = [i for i, t in enumerate(node.inputs) if t is tensor]
        if all(self.const_edits.get((id(node), i)) == e for i in idxs):
            return
        lead = (f"weight '{tensor.name}' is shared with other nodes; scaling it by 2^{e} for "
                f"'{first}' changes {node.op} '{label}' too")
        if id(node) in self.roles or any(self._p(t) != 0 for t in node.inputs):
            raise Decline(f"{lead}, which the scale domain already treats otherwise")
        self.joined.append(f"{node.op} '{label}' reads '{tensor.name}', scaled for '{first}'")
        if idxs == [0] and (node.op in COMMUTES_WITH_SCALING or (node.op == "Cast" and cast_is_float(node))):
            # A transposed or reshaped copy of the weight carries the scale on.
            self._role(node, "propagate")
            self._const_edit(node, 0, e)
            outs = node.outputs if node.op in SCALED_ALL_OUTPUTS else node.outputs[:1]
            for out in outs:
                self._assign(out, e, f"through {node.op} '{label}'")
            return
        try:
            self._enter_node(node, e, f"it shares '{tensor.name}' with '{first}'")
        except Decline as exc:
            raise Decline(f"{lead}, which cannot carry the scale: {exc}") from None
        if not all(self.const_edits.get((id(node), i)) == e for i in idxs):
            raise Decline(f"{lead}, where '{tensor.name}' is not the input that carries the scale")

    def _enter_input(self, inp: gs.Tensor, p: int, kind: str = "graph_input") -> None:
        try:
            is_float = inp.dtype is not None and go.is_float_dtype(go.np_dtype(inp.dtype))
        except TypeError:
            is_float = False
        if not is_float:
            where = "graph input" if kind == "graph_input" else "tensor"
            raise Decline(f"{where} '{inp.name}' is not a float tensor")
        self.input_entries[inp.name] = p
        self.entries.append(Entry(inp.name, kind, p))
        self._assign(inp, p, f"graph input {inp.name}")

    def _enter_node(self, node: gs.Node, p: int, why: str) -> None:
        label = go.node_label(node)
        op = node.op
        self._role(node, "entry")
        if op in MAC_OPS:
            w_idx = self._weight_index(node)
            if w_idx is None:
                raise Decline(f"{op} '{label}' has no constant weight to scale ({why})")
            self._weight_edit(node, w_idx, p, "weight")
            bias = 2 if 2 in MAC_WEIGHT_INPUTS[op] else None
            if bias is not None and len(node.inputs) > bias and node.inputs[bias].name:
                if not go.is_float_array(go.const_value(node.inputs[bias])):
                    raise Decline(f"{op} '{label}' has a bias that is not a constant ({why})")
                self._weight_edit(node, bias, p, "bias")
            kind = "weights"
        elif op in AFFINE_NORMS:
            for idx in AFFINE_NORMS[op]:
                if len(node.inputs) > idx and node.inputs[idx].name:
                    self._weight_edit(node, idx, p, "affine parameter")
            if op == "BatchNormalization" and len(node.outputs) > 1:
                raise Decline(f"BatchNormalization '{label}' is in training mode")
            kind = "norm_affine"
        elif op in ("Mul", "Div") and self._const_index(node) is not None:
            idx = self._const_index(node)
            assert idx is not None
            e = -p if op == "Div" and idx == 1 else p
            # A small constant shared with other nodes gets its own scaled copy.
            self._const_edit(node, idx, e)
            kind = "constant"
        else:
            raise Decline(f"{op} '{label}' has no constant weights, so the scale cannot enter "
                           f"there exactly ({why})")
        self.entries.append(Entry(label, kind, p))
        self._assign(node.outputs[0], p, why)

    @staticmethod
    def _weight_index(node: gs.Node) -> int | None:
        if node.op == "Gemm" or node.op == "MatMul":
            for idx in (1, 0):
                if go.is_float_array(go.const_value(node.inputs[idx])):
                    return idx
            return None
        return 1 if go.is_float_array(go.const_value(node.inputs[1])) else None

    @staticmethod
    def _const_index(node: gs.Node) -> int | None:
        for idx in (1, 0):
            if go.is_float_array(go.const_value(node.inputs[idx])):
                return idx
        return None

    def _request(self, tensor: gs.Tensor, p: int, by: gs.Node) -> None:
        """`tensor` must carry exponent p (a residual branch joining the domain)."""
        why = f"to match the other inputs of '{go.node_label(by)}'"
        if tensor.name in self.exps:
            self._assign(tensor, p, why)
            return
        inp = go.graph_input(self.graph, tensor.name)
        if inp is not None:
            self._enter_input(inp, p)
            return
        node = go.producer(tensor)
        if node is None:
            raise Decline(f"tensor '{tensor.name}' {why} has no producer that can be scaled")
        op = node.op
        if op in COMMUTES_WITH_SCALING or op == "Cast":
            self._request(node.inputs[0], p, node)
        elif op in JOINS_SCALES and op not in COMPARISONS:
            self._role(node, "propagate")
            for idx in self._data_inputs(node):
                if go.const_value(node.inputs[idx]) is None:
                    self._request(node.inputs[idx], p, node)
                else:
                    self._const_edit(node, idx, p)
            # A node fed only by constants is never visited forward: assign here.
            self._assign(tensor, p, why)
        elif _squared(node) is not None and p % 2 == 0:
            # x*x carries x's scale squared: x joins with half the exponent.
            self._role(node, "propagate")
            self._request(_squared(node), p // 2, node)
            self._assign(tensor, p, why)
        elif op in MAC_OPS or op in AFFINE_NORMS or op in ("Mul", "Div"):
            try:
                self._enter_node(node, p, why)
            except Decline as exc:
                raise Decline(f"tensor '{tensor.name}' must join the scale domain {why}, but: "
                               f"{exc}") from None
        else:
            raise Decline(f"tensor '{tensor.name}' must join the scale domain {why}, but its "
                           f"producer {op} '{go.node_label(node)}' cannot be scaled exactly")

    @staticmethod
    def _data_inputs(node: gs.Node) -> list[int]:
        fixed = JOINS_SCALES.get(node.op)
        idxs = list(fixed) if fixed is not None else list(range(len(node.inputs)))
        return [i for i in idxs if i < len(node.inputs) and node.inputs[i].name]

    def _p(self, tensor: gs.Tensor) -> int:
        return self.exps.get(tensor.name, 0)

    def _visit(self, node: gs.Node) -> None:
        label = go.node_label(node)
        op = node.op
        scaled = [i for i, t in enumerate(node.inputs) if self._p(t) != 0]
        if not scaled:
            return
        if self.roles.get(id(node)) == "entry":
            raise Decline(f"entry '{label}' reads a tensor of its own scale domain")
        if op in SCALE_FREE_OUTPUTS:
            return
        if op in COMMUTES_WITH_SCALING or (op == "Cast" and cast_is_float(node)):
            data = COMMUTES_WITH_SCALING.get(op, (0,))
            bad = [i for i in scaled if i not in data]
            if bad:
                raise Decline(f"scaled tensor '{node.inputs[bad[0]].name}' feeds input {bad[0]} "
                               f"of {op} '{label}', which is not scale-free")
            if op == "Pad" and len(node.inputs) > 2 and node.inputs[2].name:
                self._same_exp_const(node, 2, self._p(node.inputs[0]))
            self._role(node, "propagate")
            p = self._p(node.inputs[0])
            outs = node.outputs if op in SCALED_ALL_OUTPUTS else node.outputs[:1]
            for out in outs:
                self._assign(out, p, f"through {op} '{label}'")
            return
        if op in JOINS_SCALES:
            self._visit_same_exp(node, scaled)
            return
        if op in ("Mul", "Div"):
            self._visit_mul_div(node)
            return
        if op in MAC_OPS:
            self._visit_linear(node, scaled)
            return
        if op in SCALE_INVARIANT_NORMS:
            self._visit_norm(node, scaled)
            return
        if op == "Log":
            # log(2^p x) = log(x) + p ln 2: one added constant after the Log absorbs it.
            p = self._p(node.inputs[0])
            self._role(node, "absorb")
            self.log_offsets[id(node)] = p
            self.absorbers[label] = Absorber(label, "log_offset", p)
            self._assign(node.outputs[0], 0, f"absorbed by Log '{label}'")
            return
        p = self._p(node.inputs[scaled[0]])
        if op in SCALE_POWERS:
            self._visit_power(node, p)
            return
        self._needs_unscaled(node, scaled[0])

    def _same_exp_const(self, node: gs.Node, index: int, p: int) -> None:
        self._const_edit(node, index, p)

    def _visit_same_exp(self, node: gs.Node, scaled: list[int]) -> None:
        label = go.node_label(node)
        data = self._data_inputs(node)
        bad = [i for i in scaled if i not in data]
        if bad:
            raise Decline(f"scaled tensor '{node.inputs[bad[0]].name}' feeds input {bad[0]} of "
                           f"{node.op} '{label}', which is not scale-free")
        ps = {self._p(node.inputs[i]) for i in scaled}
        if len(ps) > 1:
            names = ", ".join(f"'{node.inputs[i].name}' (2^{self._p(node.inputs[i])})" for i in scaled)
            raise Decline(f"{node.op} '{label}' mixes scales {names}")
        p = ps.pop()
        self._role(node, "propagate")
        for idx in data:
            if idx in scaled:
                continue
            if go.const_value(node.inputs[idx]) is not None:
                self._same_exp_const(node, idx, p)
                continue
            try:
                self._request(node.inputs[idx], p, node)
            except Decline:
                # The other input cannot join the domain: unscale this one instead.
                found = self._absorbers_before([node.inputs[i] for i in scaled])
                if found:
                    raise Retry(found) from None
                raise
        if node.op in COMPARISONS:
            return
        self._assign(node.outputs[0], p, f"through {node.op} '{label}'")

    def _visit_mul_div(self, node: gs.Node) -> None:
        label = go.node_label(node)
        a, b = node.inputs[0], node.inputs[1]
        pa, pb = self._p(a), self._p(b)
        const_idx = self._const_index(node)
        if id(node) in self.absorb_at and const_idx is not None:
            other = 1 - const_idx
            po = self._p(node.inputs[other])
            # Mul(x*2^p, c*2^-p), Div(x*2^p, c*2^p), Div(c*2^-p, x*2^-p): the factor lands in c.
            e = po if node.op == "Div" else -po
            self._role(node, "absorb")
            self._const_edit(node, const_idx, e)
            self.absorbers[label] = Absorber(label, "constant", po)
            self._assign(node.outputs[0], 0, f"absorbed by {node.op} '{label}'")
            return
        self._role(node, "propagate")
        p = pa + pb if node.op == "Mul" else pa - pb
        if p == 0:
            # Div(x*2^p, y*2^p), e.g. a decomposed LayerNorm's (x - mean) / sqrt(var + eps).
            self.absorbers[label] = Absorber(label, "ratio", pa)
        self._assign(node.outputs[0], p, f"through {node.op} '{label}'")

    def _visit_linear(self, node: gs.Node, scaled: list[int]) -> None:
        label = go.node_label(node)
        op = node.op
        if id(node) in self.propagate_at:
            self._propagate_linear(node, scaled)
            return
        if op in ("Conv", "ConvTranspose"):
            if scaled != [0]:
                raise Decline(f"scaled tensor feeds the weight or bias of {op} '{label}'")
            if not go.is_float_array(go.const_value(node.inputs[1])):
                raise Decline(f"{op} '{label}' reads a scaled input but has no constant weight "
                               "to absorb it")
            p = self._p(node.inputs[0])
            self._absorb_weight(node, 1, p)
            return
        pa, pb = self._p(node.inputs[0]), self._p(node.inputs[1])
        const_idx = self._const_index(node)
        if const_idx is not None and const_idx not in scaled:
            if _feeds_log(node):
                # A Log ahead absorbs the scale with one constant; weights absorbing it here
                # would leave the reference's large values between them and the Log.
                self._propagate_linear(node, scaled)
                return
            p = pa + pb
            self._absorb_weight(node, const_idx, p)
            return
        if op == "Gemm" and len(node.inputs) > 2 and node.inputs[2].name:
            raise Decline(f"Gemm '{label}' multiplies scaled tensors and adds a bias; the bias "
                           "cannot follow the product's scale")
        self._role(node, "propagate")
        self._assign(node.outputs[0], pa + pb, f"through {op} '{label}'")

    def _propagate_linear(self, node: gs.Node, scaled: list[int]) -> None:
        """A linear node passes the scale on: its output carries the product's exponent and
        its bias (a sum with the product) is scaled to match."""
        label = go.node_label(node)
        op = node.op
        data = (0,) if op in ("Conv", "ConvTranspose") else (0, 1)
        if any(i not in data for i in scaled):
            raise Decline(f"scaled tensor feeds the bias of {op} '{label}'")
        p = sum(self._p(node.inputs[i]) for i in data)
        bias = 2 if 2 in MAC_WEIGHT_INPUTS[op] else None
        if bias is not None and len(node.inputs) > bias and node.inputs[bias].name:
            if go.const_value(node.inputs[bias]) is None:
                raise Decline(f"{op} '{label}' has a non-constant bias that cannot follow the scale")
            self._weight_edit(node, bias, p, "bias")
        self._role(node, "propagate")
        self._assign(node.outputs[0], p, f"through {op} '{label}'")

    def _absorb_weight(self, node: gs.Node, index: int, p: int) -> None:
        self._role(node, "absorb")
        self._weight_edit(node, index, -p, "weight")
        self.absorbers[go.node_label(node)] = Absorber(go.node_label(node), "weights", p)
        self._assign(node.outputs[0], 0, f"absorbed by {node.op} '{go.node_label(node)}'")

    def _visit_norm(self, node: gs.Node, scaled: list[int]) -> None:
        label = go.node_label(node)
        op = node.op
        if scaled != [0]:
            raise Decline(f"scaled tensor feeds a parameter of {op} '{label}'")
        p = self._p(node.inputs[0])
        used_extra = [t for t in node.outputs[1:] if t.name and (t.outputs or go.is_graph_output(self.graph, t))]
        if used_extra:
            raise Decline(f"{op} '{label}' exposes its statistics ('{used_extra[0].name}'), which "
                           "would carry the scale")
        self._role(node, "absorb")
        if op == "LpNormalization":
            if int(node.attrs.get("p", 2)) not in (1, 2):
                raise Decline(f"LpNormalization '{label}' with p={node.attrs.get('p')} is unsupported")
            kind = "scale_invariant"
        else:
            # ONNX stores epsilon as FP32; scale that value, not the decimal default.
            eps = float(np.float32(node.attrs.get("epsilon", 1e-5)))
            new_eps = eps * 4.0**p
            if float(np.float32(new_eps)) != new_eps or new_eps == 0.0:
                raise Decline(f"{op} '{label}': epsilon {eps} * 2^{2 * p} is not exact in FP32")
            self.attr_edits[(id(node), "epsilon")] = new_eps
            kind = "epsilon"
            if op == "BatchNormalization":
                if node.attrs.get("training_mode", 0):
                    raise Decline(f"BatchNormalization '{label}' is in training mode")
                self._weight_edit(node, 3, p, "running mean")
                self._weight_edit(node, 4, 2 * p, "running variance")
                kind = "batchnorm"
        self.absorbers[label] = Absorber(label, kind, p)
        self._assign(node.outputs[0], 0, f"absorbed by {op} '{label}'")

    def _visit_power(self, node: gs.Node, p: int) -> None:
        label = go.node_label(node)
        op = node.op
        if op == "Reciprocal":
            out = -p
        elif op == "ReduceSumSquare":
            out = 2 * p
        else:
            if op == "Pow":
                if self._p(node.inputs[1]) != 0:
                    raise Decline(f"scaled tensor is the exponent of Pow '{label}'")
                expo = go.const_value(node.inputs[1])
                if expo is None or expo.size != 1:
                    raise Decline(f"Pow '{label}' has a non-constant exponent")
                c = float(expo.reshape(()))
            else:
                c = 0.5
            out_f = c * p
            if out_f != int(out_f):
                raise Decline(f"{op} '{label}' turns scale 2^{p} into 2^{out_f:g}, not an integer "
                               "power of two; pick an even k")
            out = int(out_f)
        self._role(node, "propagate")
        self._assign(node.outputs[0], out, f"through {op} '{label}'")

    def _needs_unscaled(self, node: gs.Node, index: int) -> None:
        """`node` cannot take a scaled input: Mul/Div nodes by a constant upstream absorb it."""
        tensor = node.inputs[index]
        found = self._absorbers_before([tensor])
        if found:
            raise Retry(found)
        raise Decline(f"{node.op} '{go.node_label(node)}' reads scaled tensor '{tensor.name}' "
                       f"(2^{self._p(tensor)}) and is not scale-free; no linear consumer, "
                       "normalisation or constant factor before it can absorb the scale")

    def _absorbers_before(self, tensors: list[gs.Tensor]) -> set[int]:
        """The nearest Mul/Div by a constant on every scaled path back from `tensors`, which
        absorbing the scale would leave them unscaled; empty when some path has none.

        The walk passes any node that only carries the scale (an Add of a constant, a
        square, a product of scaled tensors), so the factor may sit well before the reader.
        """
        found: set[int] = set()
        seen: set[str] = set()
        stack = [t for t in tensors if self._p(t) != 0]
        while stack:
            tensor = stack.pop()
            if tensor.name in seen:
                continue
            seen.add(tensor.name)
            node = go.producer(tensor)
            if node is None or self.roles.get(id(node)) != "propagate":
                return set()
            if node.op in ("Mul", "Div") and self._const_index(node) is not None:
                found.add(id(node))
                continue
            scaled = [t for t in node.inputs if self._p(t) != 0]
            if not scaled:
                return set()
            stack += scaled
        return found

    # -- application ----------------------------------------------------------------------

    def _all_readers_take(self, tensor: gs.Tensor, e: int) -> bool:
        return all(self.const_edits.get((id(reader), i)) == e
                   for reader in tensor.outputs
                   for i, t in enumerate(reader.inputs) if t is tensor)

    def apply(self, graph: gs.Graph) -> list[str]:
        """Edit `graph` as analysed; returns the names of inserted FP32 boundary nodes."""
        cache: dict[str, gs.Constant] = {}
        for (nid, idx), e in sorted(self.const_edits.items(), key=lambda kv: (self.order[kv[0][0]], kv[0][1])):
            node = self.nodes[nid]
            tensor = node.inputs[idx]
            name = f"{tensor.name}__x2{'p' if e > 0 else 'm'}{abs(e)}"
            if name in cache:
                go.replace_input(node, idx, cache[name])
                continue
            value = go.const_value(tensor)
            assert value is not None
            scaled = go.exact_pow2_scale(value, e)
            assert scaled is not None
            if isinstance(tensor, gs.Constant) and self._all_readers_take(tensor, e):
                # Every reader takes the same factor: edit in place, no copy, name kept.
                go.set_values(tensor, scaled)
                cache[name] = tensor
            else:
                go.set_constant_input(node, idx, scaled, name, cache)
            nonzero = np.abs(scaled[scaled != 0])
            self.scaled_constants[node.inputs[idx].name] = {
                "exponent": e,
                "absmax": float(np.abs(scaled).max()) if scaled.size else 0.0,
                "min_nonzero": float(nonzero.min()) if nonzero.size else 0.0,
            }
        for (nid, attr), value in self.attr_edits.items():
            self.nodes[nid].attrs[attr] = float(value)
        for nid, p in sorted(self.log_offsets.items(), key=lambda kv: self.order[kv[0]]):
            add_log_offset(graph, self.nodes[nid], p)
        fp32_nodes: list[str] = []
        for name, p in sorted(self.input_entries.items()):
            inp = go.graph_input(graph, name) or graph.tensors()[name]
            consumers, _ = go.main_consumers(graph, inp)
            scaled = gs.Variable(go.unique_name(graph, f"{name}__scaled"), dtype=inp.dtype, shape=inp.shape)
            node_name = go.unique_name(graph, f"rescale_in_{name}")
            factor = go.scalar(f"{node_name}_s", 2.0**p, go.np_dtype(inp.dtype))
            for node in consumers:
                for i, t in enumerate(node.inputs):
                    if t is inp:
                        go.replace_input(node, i, scaled)
            graph.nodes.append(gs.Node("Mul", node_name, inputs=[inp, factor], outputs=[scaled]))
            fp32_nodes.append(node_name)
            self.input_nodes[node_name] = name
            self.renamed.add(name)
        for name in self.check.exits:
            out = next(t for t in graph.outputs if t.name == name)
            p = self.exps[name]
            inner = gs.Variable(go.unique_name(graph, f"{name}__scaled"), dtype=out.dtype, shape=out.shape)
            prod = go.producer(out)
            assert prod is not None
            consumers, _ = go.main_consumers(graph, out)
            prod.outputs[prod.outputs.index(out)] = inner
            for node in consumers:
                for i, t in enumerate(node.inputs):
                    if t is out:
                        go.replace_input(node, i, inner)
            node_name = go.unique_name(graph, f"rescale_out_{name}")
            factor = go.scalar(f"{node_name}_s", 2.0**-p, go.np_dtype(out.dtype))
            graph.nodes.append(gs.Node("Mul", node_name, inputs=[inner, factor], outputs=[out]))
            fp32_nodes.append(node_name)
            self.renamed.add(name)
        return fp32_nodes


# Ops between a linear node and the Log that can absorb its scale (a mel filterbank's
# transposes, the floor), and how far the Log may be.
_TO_LOG = LAYOUT_OPS | {"Max", "Add", "Clip", "Relu"}
_TO_LOG_STEPS = 4


def _feeds_log(node: gs.Node) -> bool:
    """Whether `node`'s output reaches a Log through _TO_LOG ops within _TO_LOG_STEPS."""
    frontier = [node]
    for _ in range(_TO_LOG_STEPS):
        readers = [r for n in frontier for out in n.outputs for r in out.outputs]
        if any(r.op == "Log" for r in readers):
            return True
        frontier = [r for r in readers if r.op in _TO_LOG]
        if not frontier:
            return False
    return False


def _squared(node: gs.Node) -> gs.Tensor | None:
    """x for `Mul(x, x)` or `Pow(x, 2)`, else None."""
    if node.op == "Mul" and len(node.inputs) == 2 and node.inputs[0] is node.inputs[1]:
        return node.inputs[0]
    if node.op == "Pow" and len(node.inputs) == 2:
        e = go.const_value(node.inputs[1])
        if e is not None and e.size == 1 and float(e.reshape(())) == 2.0:
            return node.inputs[0]
    return None


def cast_is_float(node: gs.Node) -> bool:
    return int(node.attrs.get("to", 0)) in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                            onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16)


def topological_nodes(graph: gs.Graph) -> list[gs.Node]:
    """Main-graph nodes in a topological order, stable with respect to the file's order."""
    index = {id(n): i for i, n in enumerate(graph.nodes)}
    deps: dict[int, set[int]] = {}
    users: dict[int, list[gs.Node]] = {}
    for node in graph.nodes:
        found = {id(p) for t in node.inputs for p in t.inputs if id(p) in index}
        deps[id(node)] = found
        for d in found:
            users.setdefault(d, []).append(node)
    ready = [(index[id(n)], id(n)) for n in graph.nodes if not deps[id(n)]]
    heapq.heapify(ready)
    order: list[gs.Node] = []
    while ready:
        _, nid = heapq.heappop(ready)
        node = graph.nodes[index[nid]]
        order.append(node)
        for user in users.get(nid, []):
            deps[id(user)].discard(nid)
            if not deps[id(user)]:
                heapq.heappush(ready, (index[id(user)], id(user)))
    return order
