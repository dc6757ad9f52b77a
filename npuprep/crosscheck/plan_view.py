"""What a conversion decided, for crosscheck: `plan.yaml` or `<out>.precision.yaml` -> pins with reasons, nodes made safe.

Either file is read (told apart by its `kind`: `plan` or `precision`). Pins are the nodes to
run in FP32, each with its reason (verification rounds included); `answered` are the
findings the plan's other remedies (rescale, softmax shift, clamp) make safe in the target
format, and `safe` the nodes those remedies cover. A static finding (a small-op rule, a
pattern) or a measured underflow (precision lost, which the conversion's verification
accepted) on a node the plan keeps in the target format is the plan's decision, not a
mismatch; a measured overflow or headroom the plan did not answer still is.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from npuprep.analyse.finding import Finding
from npuprep.crosscheck.names import NodeIndex
from npuprep.crosscheck.record import PRECISION_ORDER
from npuprep.errors import NpuprepError
from npuprep.model_io import Model
from npuprep.provenance import RECORD_KEY, ConversionRecord, find_source, read_source
from npuprep.yaml_io import read_yaml

# Findings from measured ranges; every other rule is static (an op or a pattern).
MEASURED_RULES = ("range.",)
EIGHT_BIT = ("int8", "fp8_e4m3")
# Reasons in a precision file for nodes the lowering alone kept wide (see pipeline/artefacts.py).
LOWERED = ("as lowered", "kept FP32 by lowering", "pinned FP32: kept FP32 by lowering")


@dataclass(frozen=True)
class PlanDecision:
    """Pins (node -> why) and what the plan made safe, from one plan or precision file."""

    path: str
    kind: str
    fingerprint: str
    precision: str
    pins: dict[str, str] = field(default_factory=dict)
    safe: dict[str, str] = field(default_factory=dict)
    answered: dict[tuple[str, str, str], str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    declined: dict[tuple[str, str, str], str] = field(default_factory=dict)
    # 8-bit plans: nodes kept wider than the 8-bit format -> (fp16 | fp32, why).
    wider: dict[str, tuple[str, str]] = field(default_factory=dict)
    # 8-bit plans: nodes the plan puts in the 8-bit format (a compiler running one wider is a note).
    eight_bit: frozenset[str] = frozenset()
    # Findings the plan answers by rewriting the graph (rescale, softmax shift, clamp) when the
    # model checked is the plan's source, which lacks those rewrites: key -> the remedy it lacks.
    absent: dict[tuple[str, str, str], str] = field(default_factory=dict)
    # A conversion's record that passed: what it kept in its format was verified there, so a
    # value short of headroom (still inside the format's range) is its accepted decision.
    verified: bool = False

    def settles(self, finding: Finding) -> str:
        """Why the plan needs no FP32 for `finding` ("" when it does not settle it)."""
        if (finding.rule, finding.node, finding.tensor) in self.absent:
            return ""  # the remedy that would settle it is not in this model
        why = self.answered.get((finding.rule, finding.node, finding.tensor)) or self.safe.get(finding.node)
        if why:
            return why
        if not finding.rule.startswith(MEASURED_RULES):
            return f"the plan keeps it in {self.precision}"
        if finding.rule == "range.headroom" and self.verified:
            return f"inside {self.precision}'s range, short of headroom: verified in {self.precision} by convert"
        if finding.rule == "range.underflow":
            key = (finding.rule, finding.node, finding.tensor)
            return f"underflow left as is in {self.precision}" + (
                f" ({self.declined[key]})" if key in self.declined else "")
        return ""


def read_decision(path: str | Path, model: Model, index: NodeIndex) -> PlanDecision:
    """Read `path` (plan.yaml or precision.yaml) for `model`; a bad file is one line naming
    the file and the key."""
    data = read_yaml(Path(path), "plan or precision")
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "precision":
        return _from_precision(data, str(path), model, index)
    if kind == "plan":
        return _from_plan(path, data, model, index)
    raise NpuprepError(f"{path}: kind: expected 'plan' (plan.yaml) or 'precision' "
                       f"(.precision.yaml), found {kind!r}")


def _from_plan(path: str | Path, data: dict[str, Any], model: Model, index: NodeIndex) -> PlanDecision:
    from npuprep.plan import Plan, load_plan

    note = ""
    source_model = data.get("fingerprint") == model.fingerprint
    if source_model:
        plan = load_plan(path, model)
    else:
        # The compiler is given the converted model, whose fingerprint differs from the model
        # the plan was made for; its pinned nodes keep their names, so the plan applies when
        # every one of them is in this model.
        plan = Plan.from_dict(data, str(path))
        source = find_source(model)
        if source is not None and source.fingerprint != plan.fingerprint:
            raise NpuprepError(f"{path}: plan was made for model {plan.fingerprint}, and {model.path} "
                               f"was converted from model {source.fingerprint}; give the plan of its "
                               "conversion")
        absent = sorted(plan.pinned_nodes() - set(index.op_types))
        if absent:
            raise NpuprepError(f"{path}: plan was made for model {plan.fingerprint}, and its pinned "
                               f"nodes {', '.join(absent[:5])} are not in {model.path}")
        if source is None and not _named_nodes(plan) & set(index.op_types):
            # Nothing ties a plan without pins to a model npuprep did not convert.
            raise NpuprepError(f"{path}: plan was made for model {plan.fingerprint}, not {model.path} "
                               f"({model.fingerprint}), and names none of its nodes")
        note = (f"plan {path} was made for model {plan.fingerprint} (before conversion?); "
                f"all {len(plan.pinned_nodes())} pinned nodes are in this model")
    # The plan's source lacks its rewrites: they cannot make a node safe in the compiler's run.
    decision = decision_of(plan, index, str(path), rewritten=not source_model)
    notes = [note] if note else []
    if read_source(model.proto) is not None:
        notes.append("plan.yaml holds the plan's pins; the FP32 nodes rewriting and lowering added "
                     "(a softmax shift's subtraction, a rescale's exit) are in the conversion's "
                     ".precision.yaml: give that to --plan to check them too")
    return replace(decision, notes=(*notes, *decision.notes))


def recorded_decision(record: ConversionRecord, model: Model, index: NodeIndex) -> PlanDecision:
    """The decision of the conversion `model` records about itself (npuprep.provenance): its
    applied plan, verification pins included, so crosscheck reaches convert's verdict. A
    recorded plan that does not read is one line naming the model and the key."""
    from npuprep.plan import Plan

    plan = Plan.from_dict(record.plan, f"{model.path}: metadata {RECORD_KEY}: plan")
    decided = decision_of(plan, index, f"the conversion's record in {model.path} (its applied "
                          f"plan, {record.target}, {record.precision})", kind="record")
    return replace(decided, verified=record.passed)


def decision_of(plan: Any, index: NodeIndex, path: str, kind: str = "plan", *,
                rewritten: bool = True) -> PlanDecision:
    """A plan's pins and what its other remedies make safe (crosscheck without --plan reads
    the planner's own plan, as check and convert do, or a conversion's recorded one).

    `rewritten`: the model checked carries the plan's rewrites (a conversion). Its source
    does not: the findings a rescale, softmax shift or clamp answers stay open (`absent`),
    and a note counts those remedies, which exist only in the converted model."""
    from npuprep.plan import Clamp, PinFp32, Rescale, SoftmaxShift

    pins: dict[str, str] = {}
    safe: dict[str, str] = {}
    answered: dict[tuple[str, str, str], str] = {}
    absent: dict[tuple[str, str, str], str] = {}
    missing: dict[str, int] = {}
    allowed = plan.pinned_nodes()
    for action in plan.actions:
        if isinstance(action, PinFp32):
            why = _pin_reason(action)
            pins.update({n: why for n in action.nodes if n in allowed and n not in pins})
            continue
        if isinstance(action, Rescale):
            why = f"rescaled by 2^-{action.k} from {action.entry}"
            nodes = [action.entry, *action.absorbers, *_producers(action.domain, index)]
        elif isinstance(action, SoftmaxShift):
            why = f"softmax shifted (max subtracted before {action.exp})"
            nodes = [action.exp, *_producers(action.covers, index)]
        elif isinstance(action, Clamp):
            bounds = f"[{_num(action.lo)}, {_num(action.hi)}]"
            why = f"{action.tensor} clamped to {bounds} ({action.kind})"
            nodes = list(action.consumers)
        else:
            continue
        if not rewritten:
            lacking = f"{why}: only in the converted model, not in this one"
            for ref in action.findings:
                absent.setdefault((ref.rule, ref.node, ref.tensor), lacking)
            missing[action.action] = missing.get(action.action, 0) + 1
            continue
        for ref in action.findings:
            answered.setdefault((ref.rule, ref.node, ref.tensor), why)
            nodes.append(ref.node)
        safe.update({n: why for n in nodes if n and n not in safe})
    declined = {(r.rule, r.node, r.tensor): f"{d.remedy} declined: {d.reason}"
                for d in plan.declined for r in d.findings}
    wider = {x.node: (x.precision, x.why) for x in plan.eight_bit if x.precision != plan.precision}
    eight = frozenset(x.node for x in plan.eight_bit if x.precision == plan.precision)
    notes = (f"the plan's {sum(missing.values())} rewrites ("
             + ", ".join(f"{n} {a}" for a, n in sorted(missing.items()))
             + ") exist only in the converted model, not in this one: the findings they answer "
             "count here as open; crosscheck the conversion's own compiler report",) if missing else ()
    return PlanDecision(path, kind, plan.fingerprint, plan.precision, pins, safe, answered,
                        notes, declined, wider, eight, absent)


def _named_nodes(plan: Any) -> set[str]:
    """Every node a plan's actions and the findings they answer name."""
    from npuprep.plan import Clamp, PinFp32, Rescale, SoftmaxShift

    named: set[str] = set()
    for action in plan.actions:
        if isinstance(action, PinFp32):
            named.update(action.nodes)
        elif isinstance(action, Rescale):
            named.update((action.entry, *action.absorbers))
        elif isinstance(action, SoftmaxShift):
            named.add(action.exp)
        elif isinstance(action, Clamp):
            named.update(action.consumers)
        named.update(ref.node for ref in getattr(action, "findings", ()) if ref.node)
    return named


def _require_strings(data: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    """One line naming the file and key when a key is not a string."""
    for key in keys:
        if not isinstance(data.get(key), str):
            raise NpuprepError(f"{where}{key}: expected a string, found {data.get(key)!r}")


def _from_precision(data: dict[str, Any], path: str, model: Model, index: NodeIndex) -> PlanDecision:
    _require_strings(data, ("fingerprint", "default"), f"{path}: ")
    default = data["default"]
    if default not in PRECISION_ORDER:
        raise NpuprepError(f"{path}: default: unknown precision {default!r}")
    nodes = data.get("nodes")
    if not isinstance(nodes, list):
        raise NpuprepError(f"{path}: nodes: expected a list, found {type(nodes).__name__}")
    pins: dict[str, str] = {}
    wider: dict[str, tuple[str, str]] = {}
    for i, entry in enumerate(nodes):
        where = f"{path}: nodes[{i}]"
        if not isinstance(entry, dict):
            raise NpuprepError(f"{where}: expected a mapping with node and precision")
        _require_strings(entry, ("node", "precision"), f"{where}.")
        precision = entry["precision"]
        if precision not in PRECISION_ORDER:
            raise NpuprepError(f"{where}.precision: unknown precision {precision!r}")
        reason = str(entry.get("reason", ""))
        # A node lowering left wide on its own ("as lowered": a Cast back to FP32 at an
        # output; "kept FP32 by lowering": a shape computation, an integer lookup) is no
        # request to the compiler: nothing measured needs it wide.
        if PRECISION_ORDER.index(precision) < PRECISION_ORDER.index("bf16") and not reason.startswith(LOWERED):
            pins[entry["node"]] = reason or "fp32 in the precision file"
        elif precision != default and default in EIGHT_BIT and not reason.startswith(LOWERED):
            wider[entry["node"]] = (precision, reason or f"{precision} in the precision file")
    absent = sorted(set(pins) - set(index.op_types))
    if absent:
        raise NpuprepError(f"{path}: nodes: {', '.join(absent[:5])} are not in {model.path} "
                           f"(the precision file belongs to model {data['fingerprint']})")
    notes = () if data["fingerprint"] == model.fingerprint else (
        f"precision file {path} belongs to model {data['fingerprint']}; all {len(pins)} "
        "pinned nodes are in this model",)
    return PlanDecision(path, "precision", data["fingerprint"], default, pins, {}, {}, notes,
                        wider=wider)


def _producers(tensors: Any, index: NodeIndex) -> list[str]:
    """The nodes writing `tensors` in this model: a Cast lowering put at an output carries the
    tensor's name, and the node behind it computes it; both are covered."""
    found = []
    for t in tensors:
        node = index.producer.get(t, "")
        proto = index.node(node) if index.op_types.get(node) in ("Cast", "Identity") else None
        if proto is not None and proto.input and proto.input[0] in index.producer:
            found.append(index.producer[proto.input[0]])
        if node:
            found.append(node)
    return found


def _pin_reason(action: Any) -> str:
    word = "forced" if action.forced else "requested" if action.request else "pinned"
    causes = ", ".join(str(f) for f in action.findings) or action.why or "user"
    return f"{word} FP32: {causes}"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"
