"""Chart series from any result dict: abs-max per tensor, target limits, remedy marks, layer error.

Reads the JSON shapes of `check`, `stats`, `compare` and `convert` results tolerantly: a
missing key leaves its part of the chart out rather than failing the report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from npuprep.errors import NpuprepError
from npuprep.numerics import get_format

REMEDY_KINDS: tuple[str, ...] = ("softmax_shift", "rescale", "clamp", "pin_fp32")


@dataclass(frozen=True)
class TensorPoint:
    """One tensor's largest magnitude; `absmax_after` is set for convert results."""

    tensor: str
    node: str
    op_type: str
    absmax: float | None
    absmax_after: float | None = None
    # An intentional -inf mask: drawn as a mask, never as a non-finite failure.
    mask: bool = False


@dataclass(frozen=True)
class Limit:
    """A horizontal line on the headroom chart: `role` is `max`, `headroom`, `fp8` or `min_normal`."""

    label: str
    value: float
    role: str


@dataclass(frozen=True)
class RemedyMark:
    """Where an action acts: the tensor positions (in chart order) it touches."""

    kind: str
    label: str
    positions: tuple[int, ...]


@dataclass(frozen=True)
class ErrorPoint:
    """One tensor's error against the reference, accumulated and (when measured) isolated."""

    tensor: str
    node: str
    op_type: str
    rel_l2: float | None
    max_abs: float | None
    isolated_rel_l2: float | None
    isolated_max_abs: float | None
    passed: bool | None
    mask: bool = False


@dataclass(frozen=True)
class ErrorSeries:
    points: tuple[ErrorPoint, ...]
    first_divergent: int | None
    first_divergent_label: str
    # The thresholds a tensor fails beyond (both crossed), drawn on the chart when known.
    rtol: float | None = None
    atol: float | None = None


def number(value: Any) -> float | None:
    """A float from JSON (None, strings like "inf" and non-numbers give None or +-inf)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return value  # an int stays one, so a count shows and sorts as a count
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def profile_of(result: Mapping[str, Any]) -> dict[str, Any]:
    """The profile dict a result carries (top level, or inside an embedded compare)."""
    for holder in (result, result.get("compare") or {}):
        profile = holder.get("profile") if isinstance(holder, Mapping) else None
        if isinstance(profile, Mapping):
            return dict(profile)
    return {}


def precision_of(result: Mapping[str, Any]) -> str:
    """The format compute runs in: an explicit `precision`, else the profile's default."""
    for key in ("precision", "format"):
        value = result.get(key)
        if isinstance(value, str) and value:
            return value
    return str(profile_of(result).get("default_precision") or "fp16")


def limits(result: Mapping[str, Any]) -> tuple[Limit, ...]:
    """The stored format's max finite and min normal (BF16's for a BF16 run, else FP16's);
    headroom x max of the compute format (FP16 when that is wider, BF16 aside) when the profile
    gives a headroom; the FP8 max when FP8 is the compute format."""
    fp16 = get_format("fp16")
    try:
        fmt = get_format(precision_of(result))
    except NpuprepError:  # int8 or an unknown name: judged against FP16
        fmt = fp16
    if fmt.max > fp16.max and fmt.name != "bf16":  # fp32 compute: FP16 is the range that matters
        fmt = fp16
    stored = fmt if fmt.name == "bf16" else fp16
    out = [Limit(f"{stored.name} max {stored.max:g}", float(stored.max), "max"),
           Limit(f"{stored.name} min normal {stored.min_normal:.3g} (below: subnormal, then 0)",
                 float(stored.min_normal), "min_normal")]
    if fmt.name.startswith("fp8"):
        out.append(Limit(f"{fmt.name} max {fmt.max:g}", float(fmt.max), "fp8"))
    headroom = number(profile_of(result).get("headroom"))
    if headroom is not None and 0 < headroom < 1:
        value = headroom * float(fmt.max)
        out.append(Limit(f"headroom {headroom:g} x {fmt.name} max = {value:g}", value, "headroom"))
    return tuple(out)


def stats_entries(stats: Mapping[str, Any], order: Sequence[str] = ()) -> list[dict[str, Any]]:
    """A stats object's tensors in topological order: by `order` (tensor names, e.g. from the
    model) when given, else by a recorded position, else as stored (stats files sort by name)."""
    tensors = stats.get("tensors")
    if isinstance(tensors, Mapping):
        items = [dict(v, tensor=v.get("tensor", k)) for k, v in tensors.items() if isinstance(v, Mapping)]
    elif isinstance(tensors, list):
        items = [dict(v) for v in tensors if isinstance(v, Mapping)]
    else:
        return []
    if order:
        rank = {name: i for i, name in enumerate(order)}
        return sorted(items, key=lambda v: rank.get(str(v.get("tensor")), len(rank)))
    for key in ("index", "order", "position"):
        if items and all(isinstance(v.get(key), int) for v in items):
            return sorted(items, key=lambda v, k=key: v[k])
    return items


def in_order(result: Mapping[str, Any], order: Sequence[str] = ()) -> bool:
    """Whether the result's tensors are charted in topological order: a stats object (keyed by
    name) only is with `order` (from the model) or a recorded position."""
    stats = result if result.get("kind") == "stats" else result.get("stats")
    if not isinstance(stats, Mapping) or order:
        return True
    tensors = stats.get("tensors")
    items = list(tensors.values()) if isinstance(tensors, Mapping) else tensors if isinstance(tensors, list) else []
    return any(items) and any(
        all(isinstance(v, Mapping) and isinstance(v.get(k), int) for v in items)
        for k in ("index", "order", "position"))


def mask_names(result: Mapping[str, Any]) -> frozenset[str]:
    """Tensors the result says hold an intentional -inf mask (check's range.mask finding,
    calibrate's summary rows marked `mask`, compare's `masks`): charted as masks, never as
    non-finite."""
    listed = result.get("masks")
    names: set[str] = {str(t) for t in listed} if isinstance(listed, list) else set()
    found = result.get("findings")
    found = found.get("findings", []) if isinstance(found, Mapping) else found
    for f in found if isinstance(found, list) else []:
        if isinstance(f, Mapping) and f.get("rule") == "range.mask":
            evidence = f.get("evidence") if isinstance(f.get("evidence"), Mapping) else {}
            names.update(str(t) for t in evidence.get("tensors", [f.get("tensor")]) if t)
    for row in result.get("summary", []) if isinstance(result.get("summary"), list) else []:
        if isinstance(row, Mapping) and row.get("mask"):
            names.add(str(row.get("tensor")))
    return frozenset(names)


def _stats_tensors(stats: Mapping[str, Any], order: Sequence[str],
                   masks: frozenset[str] = frozenset()) -> list[TensorPoint]:
    items = stats_entries(stats, order)
    return [TensorPoint(str(v.get("tensor", "")), str(v.get("node", "")), str(v.get("op_type", "")),
                        _absmax(v, str(v.get("tensor", "")) in masks), mask=str(v.get("tensor", "")) in masks)
            for v in items]


def _first(entry: Mapping[str, Any], *keys: str) -> Any:
    return next((entry[k] for k in keys if entry.get(k) is not None), None)


def compare_entry(t: Mapping[str, Any]) -> dict[str, Any]:
    """One compared tensor under canonical keys, whichever spelling the producer used
    (`max_abs` or `max_abs_error`, `absmax` or `cand_absmax`, isolated errors flat or nested)."""
    isolated = t.get("isolated") if isinstance(t.get("isolated"), Mapping) else {}
    nonfinite = _first(t, "nonfinite")
    if nonfinite is None and ("inf_count" in t or "nan_count" in t):
        nonfinite = (number(t.get("inf_count")) or 0) + (number(t.get("nan_count")) or 0)
    return {
        "tensor": str(t.get("tensor", "")), "node": str(t.get("node", "")),
        "op_type": str(t.get("op_type", "")),
        "max_abs": number(_first(t, "max_abs", "max_abs_error")),
        "rel_l2": number(t.get("rel_l2")), "cosine": number(t.get("cosine")),
        "absmax": number(_first(t, "absmax", "cand_absmax")),
        "ref_absmax": number(t.get("ref_absmax")),
        "limit": number(t.get("limit")), "headroom": number(t.get("headroom")),
        "nonfinite": number(nonfinite),
        "saturated": number(_first(t, "saturated", "saturated_count")),
        "isolated_rel_l2": number(_first(isolated, "rel_l2") if isolated
                                  else t.get("isolated_rel_l2")),
        "isolated_max_abs": number(_first(isolated, "max_abs_error", "max_abs") if isolated
                                   else _first(t, "isolated_max_abs", "isolated_max_abs_error")),
        "passed": t.get("passed") if isinstance(t.get("passed"), bool) else None,
        "reason": str(t.get("reason", "")),
    }


def _absmax(entry: Mapping[str, Any], mask: bool = False) -> float | None:
    if mask:
        # The mask's -inf is intended: its finite side is the tensor's range.
        top = number(entry.get("max"))
        return None if top is None else abs(top)
    value = number(entry.get("absmax"))
    if value is None:
        lo, hi = number(entry.get("min")), number(entry.get("max"))
        if lo is not None and hi is not None:
            value = max(abs(lo), abs(hi))
    if value is not None and (entry.get("nan_count") or entry.get("inf_count") or entry.get("nonfinite")):
        return math.inf
    return value


def tensor_points(result: Mapping[str, Any], order: Sequence[str] = ()) -> tuple[TensorPoint, ...]:
    """Every tensor's abs-max in topological order, as far as the result records it; `order`
    (tensor names in topological order) sorts a stats object, which is keyed by name."""
    kind = result.get("kind")
    tensors = result.get("tensors")
    masks = mask_names(result)
    if kind == "convert" and isinstance(tensors, list):
        return tuple(
            TensorPoint(str(t.get("tensor", "")), str(t.get("node", "")), str(t.get("op_type", "")),
                        number(t.get("absmax_before")), number(t.get("absmax_after")),
                        mask=str(t.get("tensor", "")) in masks)
            for t in tensors if isinstance(t, Mapping))
    if kind == "compare" and isinstance(tensors, list):
        entries = [compare_entry(t) for t in tensors if isinstance(t, Mapping)]
        return tuple(
            TensorPoint(e["tensor"], e["node"], e["op_type"],
                        math.inf if e["nonfinite"] else e["absmax"], mask=e["tensor"] in masks)
            for e in entries)
    if kind == "stats":
        return tuple(_stats_tensors(result, order, masks))
    stats = result.get("stats")
    if isinstance(stats, Mapping):
        return tuple(_stats_tensors(stats, order, masks))
    return ()


def _action_kind(action: Mapping[str, Any]) -> str:
    return str(action.get("action") or action.get("kind") or action.get("remedy") or "")


def _action_tensors(action: Mapping[str, Any], produced_by: Mapping[str, list[int]],
                    position: Mapping[str, int]) -> set[int]:
    """Chart positions an action touches: its tensors, its scale domain, its nodes' outputs."""
    hits: set[int] = set()
    names: list[str] = []
    for key in ("tensor", "target", "entry", "exp"):
        if isinstance(action.get(key), str):
            names.append(action[key])
    for key in ("tensors", "exit_tensors", "domain", "nodes", "absorbers", "covers"):
        value = action.get(key)
        if isinstance(value, Mapping):
            names.extend(str(k) for k in value)
        elif isinstance(value, list | tuple):
            names.extend(str(v) for v in value)
    for name in names:
        if name in position:
            hits.add(position[name])
        hits.update(produced_by.get(name, ()))
    return hits


def plan_of(result: Mapping[str, Any]) -> Mapping[str, Any]:
    """Where a result keeps its actions: at the top level, or in an embedded `plan`."""
    if "actions" in result or "declined" in result:
        return result
    plan = result.get("plan")
    return plan if isinstance(plan, Mapping) else {}


def remedy_marks(result: Mapping[str, Any], points: tuple[TensorPoint, ...]) -> tuple[RemedyMark, ...]:
    """One mark per action, at the tensors it acts on; a result without a plan (an old check
    JSON) gets one per remedied finding."""
    position = {p.tensor: i for i, p in enumerate(points)}
    produced_by: dict[str, list[int]] = {}
    for i, p in enumerate(points):
        produced_by.setdefault(p.node, []).append(i)
    marks: list[RemedyMark] = []
    actions = plan_of(result).get("actions")
    if isinstance(actions, list):
        for a in actions:
            if not isinstance(a, Mapping) or _action_kind(a) not in REMEDY_KINDS:
                continue
            hits = _action_tensors(a, produced_by, position)
            if hits:
                marks.append(RemedyMark(_action_kind(a), action_where(a), tuple(sorted(hits))))
        return tuple(marks)
    for f in result.get("findings") or ():
        if isinstance(f, Mapping) and f.get("remedy") in REMEDY_KINDS:
            hits = _action_tensors({"tensor": f.get("tensor"), "nodes": [f.get("node")]},
                                   produced_by, position)
            if hits:
                marks.append(RemedyMark(str(f["remedy"]), str(f.get("node", "")), tuple(sorted(hits))))
    return tuple(marks)


def action_where(action: Mapping[str, Any]) -> str:
    """A short 'where' for an action: its tensor, entry, target or first nodes."""
    for key in ("tensor", "entry", "target", "exp"):
        if isinstance(action.get(key), str) and action[key]:
            return action[key]
    nodes = action.get("nodes")
    if isinstance(nodes, list) and nodes:
        return ", ".join(map(str, nodes[:3])) + (f" (+{len(nodes) - 3})" if len(nodes) > 3 else "")
    return ""


def compare_of(result: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The compare object of a result: itself, or the one a convert result embeds."""
    if result.get("kind") == "compare":
        return result
    embedded = result.get("compare")
    return embedded if isinstance(embedded, Mapping) else None


def error_series(result: Mapping[str, Any]) -> ErrorSeries | None:
    """Per-layer error in topological order with the first divergent node's position."""
    cmp = compare_of(result)
    if cmp is None or not isinstance(cmp.get("tensors"), list):
        return None
    entries = [compare_entry(t) for t in cmp["tensors"] if isinstance(t, Mapping)]
    masks = mask_names(result) | mask_names(cmp)
    points = tuple(
        ErrorPoint(e["tensor"], e["node"], e["op_type"], e["rel_l2"], e["max_abs"],
                   e["isolated_rel_l2"], e["isolated_max_abs"], e["passed"], mask=e["tensor"] in masks)
        for e in entries)
    first = cmp.get("first_divergent")
    index, label = None, ""
    if isinstance(first, Mapping):
        label = str(first.get("node") or first.get("tensor") or "")
        for i, p in enumerate(points):
            if (first.get("tensor") and p.tensor == first["tensor"]) or (
                    not first.get("tensor") and p.node == first.get("node")):
                index = i
                break
    thresholds = cmp.get("thresholds") if isinstance(cmp.get("thresholds"), Mapping) else {}
    rtol, atol = number(thresholds.get("rtol")), number(thresholds.get("atol"))
    if rtol is None and isinstance(result.get("verification"), Mapping):
        rtol = number(result["verification"].get("rtol"))
    return ErrorSeries(points, index, label, rtol, atol)
