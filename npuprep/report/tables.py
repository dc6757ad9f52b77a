"""The report's tables (findings, actions, declined remedies, tensors) and summary, from a result dict.

Format-neutral rows: the HTML renderer (and any other) decides how a cell looks. Missing keys
give empty cells or leave a table out; nothing here fails on a producer's newer fields.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from npuprep.analyse.finding import remedy_words
from npuprep.report.pin_count import pins_said
from npuprep.report.series import (
    action_where,
    compare_entry,
    compare_of,
    mask_names,
    number,
    plan_of,
    stats_entries,
)

SEVERITY_RANK = {"info": 0, "warning": 1, "error": 2}
MASK_REASON = "an intentional -inf mask (from a mask constant): the reference is -inf there, so no error"


@dataclass(frozen=True)
class Column:
    """A column: `kind` is `text`, `num` or `severity` (sorted by rank, shown as a word)."""

    name: str
    kind: str = "text"


@dataclass(frozen=True)
class Table:
    key: str
    title: str
    columns: tuple[Column, ...]
    rows: tuple[tuple[Any, ...], ...]


def compact(value: Any) -> str:
    """A dict or list as one short line (evidence, measured numbers)."""
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={compact(v)}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(compact(v) for v in value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _text(d: Mapping[str, Any], key: str) -> str:
    return compact(d.get(key))


def _dicts(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def findings_table(result: Mapping[str, Any]) -> Table | None:
    # Most severe first (stable: the producer's order within one severity).
    findings = sorted(_dicts(result.get("findings")),
                      key=lambda f: -SEVERITY_RANK.get(str(f.get("severity", "")).lower(), -1))
    if "findings" not in result:
        return None
    cols = (Column("severity", "severity"), Column("rule"), Column("node"), Column("op_type"),
            Column("tensor"), Column("message"), Column("evidence"), Column("remedy"),
            Column("remedy_text"))
    rows = tuple((str(f.get("severity", "")).lower(), _text(f, "rule"), _text(f, "node"),
                  _text(f, "op_type"), _text(f, "tensor"), _text(f, "message"),
                  _text(f, "evidence"), _text(f, "remedy"),
                  remedy_words(str(f.get("remedy", "")), str(f.get("suggested_remedy", f.get("remedy", ""))),
                               _text(f, "remedy_text")))
                 for f in findings)
    return Table("findings", f"Findings ({len(rows)})", cols, rows)


def _action_numbers(a: Mapping[str, Any]) -> str:
    keys = ("k", "absmax", "absmax_after", "limit", "lo", "hi", "measured")
    return compact({k: a[k] for k in keys if k in a and a[k] is not None})


def _finding_refs(a: Mapping[str, Any]) -> str:
    refs = []
    for ref in _dicts(a.get("findings")):
        where = ref.get("tensor") or ref.get("node") or ""
        refs.append(f"{ref.get('rule', '')} at {where}" if where else str(ref.get("rule", "")))
    return "; ".join(refs)


def actions_table(result: Mapping[str, Any]) -> Table | None:
    plan = plan_of(result)
    if "actions" not in plan:
        return None
    cols = (Column("#", "num"), Column("action"), Column("where"), Column("kind"),
            Column("numbers"), Column("findings"), Column("why"))
    rows = tuple((i, str(a.get("action") or a.get("kind") or ""), action_where(a),
                  _text(a, "kind") if a.get("action") else "", _action_numbers(a),
                  _finding_refs(a), _text(a, "why"))
                 for i, a in enumerate(_dicts(plan.get("actions"))))
    return Table("actions", f"Actions ({len(rows)})", cols, rows)


def declined_table(result: Mapping[str, Any]) -> Table | None:
    declined = _dicts(plan_of(result).get("declined"))
    if not declined:
        return None
    cols = (Column("remedy"), Column("target"), Column("reason"), Column("findings"))
    rows = tuple((_text(d, "remedy"), _text(d, "target") or action_where(d),
                  _text(d, "reason") or _text(d, "why"), _finding_refs(d)) for d in declined)
    return Table("declined", f"Declined remedies ({len(rows)})", cols, rows)


def _num(d: Mapping[str, Any], key: str) -> float | None:
    return number(d.get(key))


def _tensor_rows(entries: Sequence[Mapping[str, Any]], numeric: Sequence[str],
                 extra: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[tuple[Any, ...], ...]:
    rows = []
    for i, t in enumerate(entries):
        values = dict(t, **(extra or {}).get(str(t.get("tensor")), {}))
        rows.append((i, _text(values, "tensor"), _text(values, "node"), _text(values, "op_type"),
                     *(_num(values, k) for k in numeric)))
    return tuple(rows)


def compare_table(result: Mapping[str, Any]) -> Table | None:
    cmp = compare_of(result)
    entries = [compare_entry(t) for t in _dicts(cmp.get("tensors"))] if cmp else []
    if not entries:
        return None
    numeric = ["max_abs", "rel_l2", "cosine", "absmax", "ref_absmax", "limit", "headroom",
               "nonfinite", "saturated", "isolated_rel_l2", "isolated_max_abs"]
    # Cosine never stands alone: max_abs and headroom sit next to it whenever it is shown.
    numeric = [k for k in numeric if any(e[k] is not None for e in entries)]
    cols = (Column("#", "num"), Column("tensor"), Column("node"), Column("op_type"),
            *(Column(k, "num") for k in numeric), Column("passed"), Column("reason"))
    masks = mask_names(result) | mask_names(cmp or {})
    rows = tuple((i, e["tensor"], e["node"], e["op_type"], *(e[k] for k in numeric),
                  "" if e["passed"] is None else str(e["passed"]),
                  MASK_REASON if e["tensor"] in masks and e["passed"] else e["reason"])
                 for i, e in enumerate(entries))
    return Table("errors", f"Error per tensor ({len(entries)})", cols, rows)


def convert_tensor_table(result: Mapping[str, Any]) -> Table | None:
    entries = _dicts(result.get("tensors"))
    if result.get("kind") != "convert" or not entries:
        return None
    scales = result.get("tensor_scales") if isinstance(result.get("tensor_scales"), Mapping) else {}
    extra = {str(k): {"scale": v} for k, v in scales.items()}
    numeric = ["absmax_before", "absmax_after", "headroom_before", "headroom_after", "scale"]
    numeric = [k for k in numeric if k == "scale" and scales or any(k in t for t in entries)]
    cols = (Column("#", "num"), Column("tensor"), Column("node"), Column("op_type"),
            *(Column(k, "num") for k in numeric))
    return Table("tensors", f"Tensor ranges before and after ({len(entries)})", cols,
                 _tensor_rows(entries, numeric, extra))


def outputs_table(result: Mapping[str, Any]) -> Table | None:
    """Graph outputs of the converted model under emulation (convert's verdict), per check."""
    rows = []
    for check in ("verification", "holdout"):
        data = result.get(check)
        outputs = data.get("outputs") if isinstance(data, Mapping) else None
        if not isinstance(outputs, Mapping):
            continue
        for name, o in outputs.items():
            if isinstance(o, Mapping):
                rows.append((check, str(name), _num(o, "nonfinite"), _num(o, "max_abs_error"),
                             _num(o, "rel_l2"), _num(data, "rtol")))
    if not rows:
        return None
    cols = (Column("check"), Column("output"), Column("nonfinite", "num"),
            Column("max_abs_error", "num"), Column("rel_l2", "num"), Column("rtol", "num"))
    return Table("outputs", "Outputs under emulated target numerics", cols, tuple(rows))


def attribution_table(result: Mapping[str, Any]) -> Table | None:
    """convert's error attribution: per round, each layer's own error in the run's format, its share of the
    layers' summed squared error and of the FLOPs, and whether the round pinned it."""
    share = result.get("fp32_share")
    total = _num(share, "total_flops") if isinstance(share, Mapping) else None
    rows = []
    fmt = "FP16"
    for traced in _dicts(result.get("error_attribution")):
        fmt = str(traced.get("format") or "fp16").upper()
        pinned = set(traced.get("pinned") or ())
        kept = "dropped" if traced.get("dropped") else "yes"
        for layer in _dicts(traced.get("layers")):
            flops = _num(layer, "flops")
            rows.append((_num(traced, "round"), _text(layer, "node"), _text(layer, "op_type"),
                         _num(layer, "rel_l2"), _num(layer, "share"),
                         flops / total if flops is not None and total else None,
                         kept if layer.get("node") in pinned else ""))
    if not rows:
        return None
    cols = (Column("round", "num"), Column("node"), Column("op"), Column("own_rel_l2", "num"),
            Column("error_share", "num"), Column("flops_share", "num"), Column("pinned"))
    return Table("attribution", f"{fmt} error by node ({len(rows)} rows)", cols, tuple(rows))


def eight_bit_table(result: Mapping[str, Any]) -> Table | None:
    """An 8-bit plan: each node's precision and why, with what keeping it wider alone gains
    (the outputs' rel L2 falls by `gain`) where it was ranked."""
    plan = result.get("plan")
    layers = list(_dicts(plan.get("eight_bit"))) if isinstance(plan, Mapping) else []
    if not layers:
        return None
    ranked = {s.get("node"): s.get("gain") for s in _dicts((result.get("eight_bit") or {}).get("sensitivity"))}
    rows = tuple((_text(x, "node"), _text(x, "precision"), ranked.get(x.get("node")), _text(x, "why"))
                 for x in layers)
    share = (result.get("eight_bit") or {}).get("mac_share") or {}
    split = ", ".join(f"{100 * v:.0f}% {k}" for k, v in share.items())
    cols = (Column("node"), Column("precision"), Column("gain_if_wider", "num"), Column("why"))
    return Table("eight_bit", f"8-bit decision per node (multiply-adds: {split})" if split else
                 "8-bit decision per node", cols, rows)


def stage_table(result: Mapping[str, Any]) -> Table | None:
    """What each stage of the run took, wall and CPU seconds, in the order they ran (a
    convert's `resources.stage_seconds`)."""
    resources = result.get("resources")
    stages = resources.get("stage_seconds") if isinstance(resources, Mapping) else None
    if not isinstance(stages, Mapping) or not stages:
        return None
    wall = sum(float(t.get("wall_s", 0.0)) for t in _dicts(list(stages.values()))) or 1.0
    rows = tuple((str(name), t.get("wall_s"), t.get("cpu_s"),
                  100 * float(t.get("wall_s", 0.0)) / wall)
                 for name, t in stages.items() if isinstance(t, Mapping))
    cols = (Column("stage"), Column("wall_s", "num"), Column("cpu_s", "num"),
            Column("share_of_wall_pct", "num"))
    return Table("stages", f"Time by stage ({len(rows)})", cols, rows)


def forced_table(result: Mapping[str, Any]) -> Table | None:
    forced = result.get("forced_fp32")
    if not isinstance(forced, Mapping) or not forced:
        return None
    rows = tuple((str(node), compact(why)) for node, why in forced.items())
    return Table("forced", f"Kept FP32 by lowering ({len(rows)})",
                 (Column("node"), Column("reason")), rows)


def stats_table(result: Mapping[str, Any], order: Sequence[str] = ()) -> Table | None:
    stats = result if result.get("kind") == "stats" else result.get("stats")
    if not isinstance(stats, Mapping):
        return None
    # The same order as the headroom chart, so '#' points at the chart's x position.
    entries = stats_entries(stats, order)
    if not entries:
        return None
    numeric = ["min", "max", "absmax", "count", "nan_count", "inf_count", "zero_count"]
    numeric = [k for k in numeric if any(k in t for t in entries)]
    formats = sorted({str(f) for t in entries if isinstance(t.get("over"), Mapping) for f in t["over"]})
    extra = {str(t.get("tensor")): {f"over {f}": t["over"].get(f) for f in formats}
             for t in entries if isinstance(t.get("over"), Mapping)}
    numeric += [f"over {f}" for f in formats]
    cols = (Column("#", "num"), Column("tensor"), Column("node"), Column("op_type"),
            *(Column(k, "num") for k in numeric))
    return Table("tensors", f"Tensor ranges ({len(entries)})", cols,
                 _tensor_rows(entries, numeric, extra))


def unobserved_table(result: Mapping[str, Any]) -> Table | None:
    holders = (result, result.get("stats"), compare_of(result))
    unobserved = next((h["unobserved"] for h in holders
                       if isinstance(h, Mapping) and h.get("unobserved")), None)
    if not unobserved:
        return None
    items = unobserved.items() if isinstance(unobserved, Mapping) else ((str(u), "") for u in unobserved)
    rows = tuple((str(k), compact(v)) for k, v in items)
    return Table("unobserved", f"Tensors not observed ({len(rows)})",
                 (Column("tensor"), Column("reason")), rows)


# Crosscheck verdicts in reading order: failing first, then doubtful, then ok.
VERDICT_ORDER = ("mismatch", "pin-ignored", "unknown", "missing", "unmapped", "ok")


def crosscheck_table(result: Mapping[str, Any]) -> Table | None:
    verdicts = _dicts(result.get("verdicts"))
    if result.get("kind") != "crosscheck" or not verdicts:
        return None
    rank = {v: i for i, v in enumerate(VERDICT_ORDER)}
    verdicts = sorted(verdicts, key=lambda v: rank.get(str(v.get("verdict")), len(rank)))
    cols = (Column("verdict"), Column("node"), Column("op_type"), Column("runs_in"), Column("needs"),
            Column("layers"), Column("rules"), Column("reason"))
    rows = tuple((_text(v, "verdict"), _text(v, "node"), _text(v, "op_type"), _text(v, "runs_in"),
                  _text(v, "needs"), " / ".join(map(str, v.get("layers") or ())), _text(v, "rules"),
                  "; ".join([_text(v, "reason"), *map(str, v.get("flags") or ())]).strip("; "))
                 for v in verdicts)
    return Table("verdicts", f"Compiler report vs findings ({len(rows)} nodes)", cols, rows)


def probe_table(result: Mapping[str, Any]) -> Table | None:
    probes = _dicts(result.get("probes"))
    if result.get("kind") != "probe" or not probes:
        return None
    cols = (Column("probe"), Column("unit"), Column("verdict"), Column("over", "num"), Column("reference"),
            Column("observed"), Column("reason"))
    rows = []
    for p in probes:
        pairs = _dicts(p.get("pairs"))
        counts = p.get("counts") if isinstance(p.get("counts"), Mapping) else {}
        rows.append((_text(p, "name"), _text(p, "unit"), _text(p, "verdict") + (" (wider)" if p.get("wider") else ""),
                     _num(counts, "over"), _text(pairs[0], "reference") if pairs else "",
                     _text(pairs[0], "observed") if pairs else "", _text(p, "reason")))
    return Table("probes", f"Overflow probes ({len(rows)})", cols, tuple(rows))


def tables(result: Mapping[str, Any], order: Sequence[str] = ()) -> tuple[Table, ...]:
    """Every table the result supports, in reading order."""
    made = (crosscheck_table(result), probe_table(result),
            outputs_table(result), attribution_table(result), eight_bit_table(result),
            findings_table(result),
            actions_table(result), declined_table(result), forced_table(result),
            compare_table(result),
            convert_tensor_table(result), stats_table(result, order), unobserved_table(result),
            stage_table(result))
    return tuple(t for t in made if t is not None)


def verdict(result: Mapping[str, Any]) -> bool | None:
    """Passed or failed, as far as the result says: its own `passed`, else compare's verdict
    and no error-level finding."""
    if isinstance(result.get("passed"), bool):
        return result["passed"]
    cmp = compare_of(result)
    outcomes = []
    if cmp is not None and isinstance(cmp.get("passed"), bool):
        outcomes.append(cmp["passed"])
    if "findings" in result:
        outcomes.append(not any(str(f.get("severity", "")).lower() == "error"
                                for f in _dicts(result.get("findings"))))
    return all(outcomes) if outcomes else None


def failure_said(result: Mapping[str, Any]) -> str:
    """What a failed conversion's stored verdict says after "FAILED": its cause, then the gate
    that tripped, as the pipeline said it once in report.json ("" when it passed or has none)."""
    if result.get("passed") is not False:
        return ""
    stored = result.get("verdict")
    said = str(stored.get("said") or "") if isinstance(stored, Mapping) else ""
    return said.removeprefix("FAILED").lstrip(": ")


def summary(result: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Key facts for the page head: what, which model, which target, the verdict's numbers."""
    rows: list[tuple[str, str]] = []
    for key in ("kind", "model", "output", "reference", "candidate", "target", "target_path",
                "format", "precision", "opset", "samples", "synthetic", "thresholds", "fail_on",
                "rounds", "flops_fp32_share", "fp32_verdict", "cast_count", "report", "report_format",
                "counts", "backend", "basis", "overall"):
        if key in result and result[key] not in (None, ""):
            rows.append((key, compact(result[key])))
    if isinstance(result.get("pinned_nodes"), list):
        rows.append(("FP32 nodes", pins_said(result)))
    if "findings" in result:
        counts = {s: 0 for s in SEVERITY_RANK}
        for f in _dicts(result.get("findings")):
            sev = str(f.get("severity", "")).lower()
            counts[sev] = counts.get(sev, 0) + 1
        rows.append(("findings", ", ".join(f"{n} {s}" for s, n in sorted(
            counts.items(), key=lambda kv: -SEVERITY_RANK.get(kv[0], -1)))))
    cmp = compare_of(result)
    if cmp is not None:
        first = cmp.get("first_divergent")
        if isinstance(first, Mapping):
            rows.append(("first divergent", first_divergent_text(first)))
        elif "first_divergent" in cmp:
            rows.append(("first divergent", "none"))
    rows.append(("fingerprint", str(result.get("fingerprint", "")) or "(none)"))
    if result.get("output_fingerprint"):
        rows.append(("output fingerprint", str(result["output_fingerprint"])))
    rows.append(("schema_version", compact(result.get("schema_version"))))
    return rows


def first_divergent_text(first: Mapping[str, Any]) -> str:
    """`node (op) writes tensor: reason; max abs .., rel L2 .., |cand| max .., headroom ..`."""
    e = compare_entry(first)
    text = f"{e['node']} ({e['op_type']}) writes {e['tensor']}"
    if e["reason"]:
        text += f": {e['reason']}"
    numbers = {"max abs": e["max_abs"], "rel L2": e["rel_l2"], "|cand| max": e["absmax"],
               "headroom": e["headroom"]}
    shown = ", ".join(f"{k} {v:.4g}" for k, v in numbers.items() if v is not None)
    return f"{text}; {shown}" if shown else text


def profile_rows(profile: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """The profile flattened to dotted keys, one row per leaf."""
    rows: list[tuple[str, str]] = []
    for key, value in profile.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            rows.extend(profile_rows(value, f"{name}."))
        else:
            rows.append((name, compact(value) if not isinstance(value, Mapping) else json.dumps(value)))
    return rows


def notes(result: Mapping[str, Any]) -> list[str]:
    """The result's notes (what emulation cannot show, synthetic samples, ...), deduplicated."""
    out: list[str] = []
    for holder in (result, plan_of(result), compare_of(result) or {}):
        for note in holder.get("notes") or ():
            if str(note) not in out:
                out.append(str(note))
    return out
