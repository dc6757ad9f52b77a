"""Plan: the reviewable list of actions, and its plan.yaml round trip (save, edit, load)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from npuprep import names
from npuprep.errors import NpuprepError
from npuprep.graph import node_label, walk_graphs
from npuprep.model_io import Model
from npuprep.numerics import eight_bit_format, formats
from npuprep.output_files import write_text_atomic
from npuprep.plan.actions import (
    CLAMP_KINDS,
    REMEDIES,
    Action,
    Clamp,
    Declined,
    FindingRef,
    Hazard,
    PinFp32,
    Rescale,
    SoftmaxShift,
    Unpinnable,
)
from npuprep.plan.layer_precision import RESIDUAL_OF, LayerPrecision
from npuprep.yaml_io import YamlReader, read_yaml, type_name

SCHEMA_VERSION = 1
# k of a rescale: 2^-24 is FP16's smallest subnormal, 2^15 the largest power of two below its max.
_K_RANGE = (-15, 24)
# Largest |e| of a domain exponent: 2**e stays a finite double for every allowed k.
_MAX_EXPONENT = 64


@dataclass(frozen=True)
class Plan:
    """What convert will do to one model for one target, in order, each step with its why.

    `forbid_pin` names nodes that must not be pinned to FP32: planner islands lose them
    (see `pinned_nodes`), and a forced pin naming one is rejected on load.
    """

    fingerprint: str
    target: str
    precision: str
    actions: tuple[Action, ...] = ()
    declined: tuple[Declined, ...] = ()
    forbid_pin: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # Hazards only an FP32 pin fixes, on a target that cannot pin: a failure's cause.
    unpinnable: tuple[Unpinnable, ...] = ()
    # 8-bit conversions: what each multiply-add and small op runs in, and why.
    eight_bit: tuple[LayerPrecision, ...] = ()
    schema_version: int = SCHEMA_VERSION
    kind: str = "plan"

    def pinned_nodes(self) -> set[str]:
        """Nodes to keep in FP32 (requests included), less the forbidden ones."""
        nodes = {n for a in self.actions if isinstance(a, PinFp32) for n in a.nodes}
        return nodes - set(self.forbid_pin)

    def rescales(self) -> list[Rescale]:
        return [a for a in self.actions if isinstance(a, Rescale)]

    def clamps(self) -> list[Clamp]:
        return [a for a in self.actions if isinstance(a, Clamp)]

    def shifts(self) -> list[SoftmaxShift]:
        return [a for a in self.actions if isinstance(a, SoftmaxShift)]

    def pins(self) -> list[PinFp32]:
        return [a for a in self.actions if isinstance(a, PinFp32)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "kind": self.kind,
            "fingerprint": self.fingerprint,
            "target": self.target,
            "precision": self.precision,
            "forbid_pin": list(self.forbid_pin),
            "actions": [a.to_dict() for a in self.actions],
            "declined": [d.to_dict() for d in self.declined],
            "notes": list(self.notes),
            "unpinnable": [u.to_dict() for u in self.unpinnable],
        } | ({"eight_bit": [x.to_dict() for x in self.eight_bit]} if self.eight_bit else {})

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan", model: Model | None = None) -> Plan:
        """Validate plan data; with `model`, also its node and tensor names and fingerprint.

        Every error is one line naming `source` and the key path (`actions[2].k`).
        """
        return _Parser(source, model).plan(data)


# ---------------------------------------------------------------- saving


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Write the plan as commented YAML, atomically; the same plan gives the same bytes."""
    return write_text_atomic(path, dump_plan(plan))


def dump_plan(plan: Plan) -> str:
    out = [
        "# npuprep plan: what `npuprep convert MODEL --plan THIS_FILE` will do, in order.",
        "# Edit freely: add a clamp (kind: user) for a physical bound, force a pin",
        "# (action: pin_fp32, forced: true), or name nodes under forbid_pin. Numbers under",
        "# absmax/limit/measured are what calibration saw; they explain, they do not steer.",
        f"schema_version: {plan.schema_version}",
        f"kind: {plan.kind}",
        "# The model this plan belongs to; another model is refused.",
        f"fingerprint: {_scalar(plan.fingerprint)}",
        f"target: {_scalar(plan.target)}",
        f"precision: {_scalar(plan.precision)}",
        "# Nodes never to pin to FP32.",
        *_emit_key("forbid_pin", list(plan.forbid_pin), 0),
    ]
    if plan.actions:
        out.append("actions:")
        for i, action in enumerate(plan.actions, 1):
            out.append(f"  # {i}. {names.comment(_headline(action))}")
            out.extend(_emit_item(action.to_dict(), 1, _comments(action)))
    else:
        out.append("actions: []")
    if plan.declined:
        out.append("# Remedies considered and not taken.")
        out.append("declined:")
        for d in plan.declined:
            out.extend(_emit_item(d.to_dict(), 1, {}))
    else:
        out.append("declined: []")
    out.extend(_emit_key("notes", list(plan.notes), 0))
    if plan.unpinnable:
        out.append("# Hazards only an FP32 pin fixes, which this target cannot make.")
        out.append("unpinnable:")
        for u in plan.unpinnable:
            out.extend(_emit_item(u.to_dict(), 1, {}))
    if plan.eight_bit:
        out.append("# What each multiply-add (and each small op kept wider) runs in: edit a")
        out.append("# precision to fp16 or fp32 to keep that layer wider, or to the 8-bit format.")
        out.append("eight_bit:")
        for x in plan.eight_bit:
            out.extend(_emit_item(x.to_dict(), 1, {}))
    return "\n".join(out) + "\n"


def _headline(action: Action) -> str:
    refs = [str(f) for f in action.findings]
    causes = ", ".join(refs[:3]) + (f" and {len(refs) - 3} more" if len(refs) > 3 else "") or "user"
    if isinstance(action, Rescale):
        return f"rescale {action.entry} by 2^{-action.k} ({causes})"
    if isinstance(action, SoftmaxShift):
        return f"subtract the row maximum before softmax Exp {action.exp} ({causes})"
    if isinstance(action, Clamp) and action.kind == "denominator":
        return f"guard denominator {action.tensor}: |x| >= {action.lo} ({causes})"
    if isinstance(action, Clamp):
        lo = "-inf" if action.lo is None else action.lo
        hi = "inf" if action.hi is None else action.hi
        return f"clamp {action.tensor} to [{lo}, {hi}] ({action.kind}; {causes})"
    word = "force FP32" if action.forced else "request FP32" if action.request else "pin FP32"
    return f"{word}: {len(action.nodes)} node(s) ({causes})"


def _comments(action: Action) -> dict[str, str]:
    if isinstance(action, Rescale):
        return {
            "k": f"scale = 2^{-action.k} = {action.scale!r}",
            "domain": "tensor: exponent e (the tensor is multiplied by 2**e)",
        }
    if isinstance(action, Clamp) and action.kind == "denominator":
        return {"lo": "smallest magnitude let through; the sign is kept"}
    if isinstance(action, Clamp) and not action.consumers:
        return {"consumers": "empty: every reader and the graph output"}
    return {}


def _scalar(value: Any) -> str:
    """One YAML scalar on one line (strings with line breaks are double-quoted with escapes)."""
    style = '"' if isinstance(value, str) and any(c in value for c in "\n\r") else None
    text = yaml.safe_dump(value, default_flow_style=True, default_style=style,
                          allow_unicode=True, width=2**30)
    return text.removesuffix("\n").removesuffix("\n...")


def _emit_key(key: str, value: Any, depth: int, comment: str = "") -> list[str]:
    pad = "  " * depth
    tail = f"  # {names.comment(comment)}" if comment else ""
    if isinstance(value, dict) and value:
        lines = [f"{pad}{_scalar(key)}:{tail}"]
        for k, v in value.items():
            lines.extend(_emit_key(str(k), v, depth + 1))
        return lines
    if isinstance(value, list) and value:
        lines = [f"{pad}{_scalar(key)}:{tail}"]
        for item in value:
            if isinstance(item, dict):
                lines.extend(_emit_item(item, depth + 1, {}))
            else:
                lines.append(f"{pad}  - {_scalar(item)}")
        return lines
    if isinstance(value, dict | list):
        return [f"{pad}{_scalar(key)}: {'{}' if isinstance(value, dict) else '[]'}{tail}"]
    return [f"{pad}{_scalar(key)}: {_scalar(value)}{tail}"]


def _emit_item(item: dict[str, Any], depth: int, comments: dict[str, str]) -> list[str]:
    """One list element that is a mapping: `- first: ...` then the other keys aligned."""
    lines: list[str] = []
    for i, (k, v) in enumerate(item.items()):
        sub = _emit_key(k, v, depth + 1, comments.get(k, ""))
        if i == 0:
            sub[0] = "  " * depth + "- " + sub[0][2 * (depth + 1):]
        lines.extend(sub)
    return lines


# ---------------------------------------------------------------- loading


def load_plan(path: str | Path, model: Model) -> Plan:
    """Read a plan.yaml for `model`; any mistake is one line naming the file and key path."""
    path = Path(path)
    data = read_yaml(path, "plan")
    return Plan.from_dict(data, str(path), model)


_TOP = ("schema_version", "kind", "fingerprint", "target", "precision", "forbid_pin",
        "actions", "declined", "notes", "unpinnable", "eight_bit")
_REQUIRED_TOP = ("schema_version", "kind", "fingerprint", "target", "precision")
_KEYS = {
    "softmax_shift": ("action", "exp", "covers", "fp32_shift", "findings", "measured", "why"),
    "rescale": ("action", "entry", "k", "domain", "absorbers", "findings", "absmax", "limit",
                "absmax_after", "why"),
    "clamp": ("action", "tensor", "lo", "hi", "kind", "consumers", "findings", "measured", "why"),
    "pin_fp32": ("action", "nodes", "exit_tensors", "findings", "measured", "forced", "request",
                 "why"),
}
_RENAMED = {"shift_max": "softmax_shift"}
_REQUIRED = {"softmax_shift": ("exp",), "rescale": ("entry", "k"), "clamp": ("tensor", "kind"), "pin_fp32": ("nodes",)}


@dataclass
class _Names:
    """What a plan may name in one model: node labels, tensors, main-graph inputs."""

    nodes: set[str] = field(default_factory=set)
    tensors: set[str] = field(default_factory=set)
    inputs: set[str] = field(default_factory=set)
    readers: dict[str, set[str]] = field(default_factory=dict)
    outputs_of: dict[str, list[str]] = field(default_factory=dict)
    graph_outputs: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, model: Model) -> _Names:
        names = cls()
        inits = {i.name for i in model.graph.initializer}
        names.inputs = {i.name for i in model.graph.input if i.name not in inits}
        for scope in walk_graphs(model.graph):
            g = scope.graph
            names.tensors |= {v.name for v in list(g.input) + list(g.output) + list(g.value_info)}
            names.tensors |= {i.name for i in g.initializer}
            names.graph_outputs |= {o.name for o in g.output}
            for node in g.node:
                label = node_label(node)
                names.nodes.add(label)
                names.outputs_of[label] = [o for o in node.output if o]
                names.tensors.update(o for o in node.output if o)
                for t in node.input:
                    if t:
                        names.readers.setdefault(t, set()).add(label)
        return names

    def exits(self, island: tuple[str, ...]) -> tuple[str, ...]:
        """Outputs of the island read outside it or leaving the graph."""
        members = set(island)
        out: list[str] = []
        for label in island:
            for t in self.outputs_of.get(label, []):
                if t in self.graph_outputs or self.readers.get(t, set()) - members:
                    out.append(t)
        return tuple(dict.fromkeys(out))


class _Parser(YamlReader):
    allow_empty = False

    def __init__(self, source: str, model: Model | None) -> None:
        super().__init__(source)
        self.model = model
        self.names = _Names.of(model) if model is not None else None

    # name checks (only with a model)
    def node(self, name: str, key: str) -> str:
        if self.names is not None and name not in self.names.nodes:
            raise self.fail(key, f"node '{name}' is not in the model")
        return name

    def tensor(self, name: str, key: str) -> str:
        if self.names is not None and name not in self.names.tensors:
            raise self.fail(key, f"tensor '{name}' is not in the model")
        return name

    def nodes(self, value: Any, key: str) -> tuple[str, ...]:
        return tuple(self.node(n, f"{key}[{i}]") for i, n in enumerate(self.strings(value, key)))

    def tensors(self, value: Any, key: str) -> tuple[str, ...]:
        return tuple(self.tensor(t, f"{key}[{i}]") for i, t in enumerate(self.strings(value, key)))

    # the plan
    def plan(self, data: Any) -> Plan:
        if data is None:
            raise NpuprepError(f"{self.source}: empty plan")
        top = self.mapping(data, "", _TOP)
        for key in _REQUIRED_TOP:
            if key not in top:
                raise self.fail(key, "required key is missing")
        version = self.integer(top["schema_version"], "schema_version")
        if version != SCHEMA_VERSION:
            raise self.fail("schema_version", f"{version} is not supported (this npuprep reads {SCHEMA_VERSION})")
        if top["kind"] != "plan":
            raise self.fail("kind", f"expected 'plan', got {top['kind']!r}")
        fingerprint = self.string(top["fingerprint"], "fingerprint")
        if self.model is not None and fingerprint != self.model.fingerprint:
            raise self.fail(
                "fingerprint",
                f"plan was made for model {fingerprint}, not {self.model.path} ({self.model.fingerprint})",
            )
        precision = self.string(top["precision"], "precision")
        if (precision not in formats() or precision == "fp32") and precision != "int8":
            known = ", ".join([*(n for n in formats() if n != "fp32"), "int8"])
            raise self.fail("precision", f"'{precision}' is not one of {known}")
        actions = tuple(
            self.action(a, f"actions[{i}]") for i, a in enumerate(self.items(top.get("actions"), "actions"))
        )
        declined = tuple(
            self.declined(d, f"declined[{i}]")
            for i, d in enumerate(self.items(top.get("declined"), "declined"))
        )
        forbid = self.nodes(top.get("forbid_pin"), "forbid_pin")
        forced = {n for a in actions if isinstance(a, PinFp32) and a.forced for n in a.nodes}
        for i, name in enumerate(forbid):
            if name in forced:
                raise self.fail(f"forbid_pin[{i}]", f"node '{name}' is also force-pinned by an action")
        notes = tuple(self.text(n, f"notes[{i}]") for i, n in enumerate(self.items(top.get("notes"), "notes")))
        unpinnable = tuple(self.unpinnable(u, f"unpinnable[{i}]")
                           for i, u in enumerate(self.items(top.get("unpinnable"), "unpinnable")))
        eight = tuple(self.layer(x, f"eight_bit[{i}]", precision)
                      for i, x in enumerate(self.items(top.get("eight_bit"), "eight_bit")))
        return Plan(
            fingerprint=fingerprint,
            target=self.string(top["target"], "target"),
            precision=precision,
            actions=actions,
            declined=declined,
            forbid_pin=forbid,
            notes=notes,
            unpinnable=unpinnable,
            eight_bit=eight,
            schema_version=version,
        )

    def layer(self, data: Any, key: str, precision: str) -> LayerPrecision:
        d = self.mapping(data, key, ("node", "precision", "why"))
        if "node" not in d or "precision" not in d:
            raise self.fail(key, "needs node and precision")
        # An 8-bit plan may run a layer in the other 8-bit format (a target with both).
        allowed = ("fp16", "fp32", *((precision, *(f for f in ("int8", "fp8_e4m3") if f != precision))
                                     if eight_bit_format(precision) else ()))
        chosen = self.string(d["precision"], f"{key}.precision")
        if chosen not in allowed:
            raise self.fail(f"{key}.precision", f"'{chosen}' is not one of {', '.join(allowed)}")
        why = self.text(d.get("why", ""), f"{key}.why") if d.get("why") else ""
        node = self.string(d["node"], f"{key}.node")
        # A residual pass is made by the conversion: the layer it splits must be in the model.
        made = why.startswith(RESIDUAL_OF)
        self.node(why[len(RESIDUAL_OF):] if made else node, f"{key}.why" if made else f"{key}.node")
        return LayerPrecision(node, chosen, why)

    def action(self, data: Any, key: str) -> Action:
        if not isinstance(data, dict):
            raise self.fail(key, f"expected a mapping, got {type_name(data)}")
        if "action" not in data:
            raise self.fail(f"{key}.action", f"required key is missing (one of {', '.join(_KEYS)})")
        # Plans written before the remedy had one name across plan/ and rewrite/.
        name = _RENAMED.get(data["action"], data["action"])
        if name not in _KEYS:
            raise self.fail(f"{key}.action", f"{name!r} is not one of {', '.join(_KEYS)}")
        self.mapping(data, key, _KEYS[name])
        for req in _REQUIRED[name]:
            if req not in data:
                raise self.fail(f"{key}.{req}", "required key is missing")
        findings = self.finding_refs(data.get("findings"), f"{key}.findings")
        why = self.text(data.get("why"), f"{key}.why")
        if name == "rescale":
            return self.rescale(data, key, findings, why)
        if name == "clamp":
            return self.clamp(data, key, findings, why)
        if name == "softmax_shift":
            return SoftmaxShift(exp=self.node(self.string(data["exp"], f"{key}.exp"), f"{key}.exp"),
                                covers=self.tensors(data.get("covers"), f"{key}.covers"),
                                fp32_shift=self.boolean(data.get("fp32_shift", False),
                                                        f"{key}.fp32_shift"),
                                findings=findings,
                                measured=self.measured(data.get("measured"), f"{key}.measured"),
                                why=why)
        return self.pin(data, key, findings, why)

    def rescale(self, d: dict[str, Any], key: str, findings: tuple[FindingRef, ...], why: str) -> Rescale:
        entry = self.string(d["entry"], f"{key}.entry")
        if self.names is not None and entry not in self.names.nodes | self.names.inputs | self.names.tensors:
            raise self.fail(f"{key}.entry", f"'{entry}' is neither a node nor a tensor of the model")
        k = self.integer(d["k"], f"{key}.k")
        if k == 0:
            raise self.fail(f"{key}.k", "k = 0 scales by 1; remove the action instead")
        if not _K_RANGE[0] <= k <= _K_RANGE[1]:
            raise self.fail(f"{key}.k", f"{k} is out of range: the scale 2^-k must be an FP16 number, "
                            f"so {_K_RANGE[0]} <= k <= {_K_RANGE[1]}")
        domain_raw = d.get("domain") or {}
        if not isinstance(domain_raw, dict):
            raise self.fail(f"{key}.domain", f"expected a mapping tensor: exponent, got {type_name(domain_raw)}")
        domain = {
            self.tensor(str(t), f"{key}.domain.{t}"): self.integer(e, f"{key}.domain.{t}")
            for t, e in domain_raw.items()
        }
        for t, e in domain.items():
            if abs(e) > _MAX_EXPONENT:
                raise self.fail(f"{key}.domain.{t}", f"exponent {e} is out of range (|e| <= {_MAX_EXPONENT})")
        absorbers = self.strings(d.get("absorbers"), f"{key}.absorbers")
        if self.names is not None:
            for i, a in enumerate(absorbers):
                if a not in self.names.nodes | self.names.tensors:
                    raise self.fail(f"{key}.absorbers[{i}]", f"'{a}' is neither a node nor a tensor of the model")
        return Rescale(
            entry=entry, k=k, domain=domain, absorbers=absorbers, findings=findings,
            absmax=self.number(d.get("absmax", 0.0), f"{key}.absmax") or 0.0,
            limit=self.number(d.get("limit", 0.0), f"{key}.limit") or 0.0,
            absmax_after=self.number(d.get("absmax_after", 0.0), f"{key}.absmax_after") or 0.0,
            why=why,
        )

    def clamp(self, d: dict[str, Any], key: str, findings: tuple[FindingRef, ...], why: str) -> Clamp:
        tensor = self.tensor(self.string(d["tensor"], f"{key}.tensor"), f"{key}.tensor")
        kind = d["kind"]
        if kind not in CLAMP_KINDS:
            raise self.fail(f"{key}.kind", f"{kind!r} is not one of {', '.join(CLAMP_KINDS)}")
        lo = self.number(d.get("lo"), f"{key}.lo", optional=True)
        hi = self.number(d.get("hi"), f"{key}.hi", optional=True)
        if kind == "denominator":
            if lo is None or lo <= 0:
                raise self.fail(f"{key}.lo", "a denominator guard needs lo > 0 (smallest magnitude let through)")
            if hi is not None:
                raise self.fail(f"{key}.hi", "a denominator guard takes no hi")
        elif lo is None and hi is None:
            raise self.fail(key, "a clamp needs lo, hi or both")
        elif lo is not None and hi is not None and lo >= hi:
            raise self.fail(f"{key}.lo", f"lo {lo} is not below hi {hi}")
        consumers = self.nodes(d.get("consumers"), f"{key}.consumers")
        if self.names is not None:
            readers = self.names.readers.get(tensor, set())
            for i, c in enumerate(consumers):
                if c not in readers:
                    raise self.fail(f"{key}.consumers[{i}]", f"node '{c}' does not read tensor '{tensor}'")
        return Clamp(
            tensor=tensor, lo=lo, hi=hi, kind=kind, consumers=consumers, findings=findings,
            measured=self.measured(d.get("measured"), f"{key}.measured"), why=why,
        )

    def pin(self, d: dict[str, Any], key: str, findings: tuple[FindingRef, ...], why: str) -> PinFp32:
        nodes = self.nodes(d["nodes"], f"{key}.nodes")
        if not nodes:
            raise self.fail(f"{key}.nodes", "an FP32 pin needs at least one node")
        exits = self.tensors(d.get("exit_tensors"), f"{key}.exit_tensors")
        if not exits and self.names is not None:
            exits = self.names.exits(nodes)
        return PinFp32(
            nodes=nodes, exit_tensors=exits, findings=findings,
            measured=self.measured(d.get("measured"), f"{key}.measured"),
            forced=self.boolean(d.get("forced", False), f"{key}.forced"),
            request=self.boolean(d.get("request", False), f"{key}.request"),
            why=why,
        )

    def declined(self, data: Any, key: str) -> Declined:
        d = self.mapping(data, key, ("remedy", "target", "reason", "findings"))
        for req in ("remedy", "target", "reason"):
            if req not in d:
                raise self.fail(f"{key}.{req}", "required key is missing")
        remedy = d["remedy"]
        if remedy not in REMEDIES:
            raise self.fail(f"{key}.remedy", f"{remedy!r} is not one of {', '.join(REMEDIES)}")
        return Declined(
            remedy=remedy, target=self.string(d["target"], f"{key}.target"),
            reason=self.string(d["reason"], f"{key}.reason"),
            findings=self.finding_refs(d.get("findings"), f"{key}.findings"),
        )

    def unpinnable(self, data: object, key: str) -> Unpinnable:
        d = self.mapping(data, key, ("hazard", "tensor", "nodes", "why"))
        for req in ("hazard", "tensor", "why"):
            if req not in d:
                raise self.fail(f"{key}.{req}", "required key is missing")
        hazard = self.string(d["hazard"], f"{key}.hazard")
        if hazard not in set(Hazard):
            raise self.fail(f"{key}.hazard", f"{hazard!r} is not one of {', '.join(Hazard)}")
        return Unpinnable(hazard=Hazard(hazard), tensor=self.tensor(self.string(d["tensor"], f"{key}.tensor"), f"{key}.tensor"),
                          nodes=self.nodes(d.get("nodes"), f"{key}.nodes"),
                          why=self.string(d["why"], f"{key}.why"))

    def finding_refs(self, value: Any, key: str) -> tuple[FindingRef, ...]:
        refs = []
        for i, item in enumerate(self.items(value, key)):
            k = f"{key}[{i}]"
            d = self.mapping(item, k, ("rule", "node", "tensor"))
            if "rule" not in d:
                raise self.fail(f"{k}.rule", "required key is missing")
            refs.append(FindingRef(
                rule=self.string(d["rule"], f"{k}.rule"),
                node=self.text(d.get("node"), f"{k}.node"),
                tensor=self.text(d.get("tensor"), f"{k}.tensor"),
            ))
        return tuple(refs)

    def measured(self, value: Any, key: str) -> dict[str, float]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(key, f"expected a mapping name: number, got {type_name(value)}")
        return {str(k): self.number(v, f"{key}.{k}") or 0.0 for k, v in value.items()}


