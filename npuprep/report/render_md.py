"""Markdown summary of a conversion: actions with their numbers, FP32 share, Casts, headroom, errors."""

from __future__ import annotations

from typing import Any


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.4g}" if v == 0 or 1e-3 <= abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(_num(c).replace("|", "\\|") for c in cells) + " |"


def action_target(a: dict[str, Any]) -> str:
    if a["action"] == "rescale":
        return f"{a['entry']} (x2^{-a['k']})"
    if a["action"] == "clamp":
        return f"{a['tensor']} to [{_num(a['lo'])}, {_num(a['hi'])}]"
    return ", ".join(a["nodes"])


def fixed_tensors(result: dict[str, Any]) -> set[str]:
    """Tensors some finding or action is about: the ones whose headroom the report shows."""
    names = {f["tensor"] for f in result.get("findings", []) if f.get("tensor")}
    for a in result.get("actions", []):
        names |= {f.get("tensor", "") for f in a.get("findings", [])}
        names |= set(a.get("exit_tensors", []))
        if a["action"] == "clamp":
            names.add(a["tensor"])
    return names - {""}


def convert_markdown(result: dict[str, Any]) -> str:
    """The Markdown summary of a `convert` result dict (ConversionResult.to_dict())."""
    ver = result.get("verification") or {}
    lines = [
        f"# npuprep convert: {result['model']} -> {result['target']} ({result['precision']})",
        "",
        f"- verdict: **{'PASSED' if result['passed'] else 'FAILED'}**",
        f"- output: `{result.get('output') or '-'}`",
        f"- model fingerprint: `{result['fingerprint']}`; output fingerprint: `{result['output_fingerprint']}`",
        f"- samples: {result['samples']['description']}"
        + (" (synthetic: not real data)" if result["samples"]["synthetic"] else ""),
        f"- FLOPs left in FP32: {100 * result['flops_fp32_share']:.2f}%",
        f"- Cast nodes inserted: {result['cast_count']}",
        f"- FP32-pinned nodes: {len(result['pinned_nodes'])}",
        f"- verification rounds: {result['rounds']}",
        "",
        "## Actions",
        "",
    ]
    if result["actions"]:
        lines += ["| # | action | where | measured | limit | why |", "|---|---|---|---|---|---|"]
        for i, a in enumerate(result["actions"], 1):
            measured = a.get("absmax") if a["action"] == "rescale" else (a.get("measured") or {}).get("absmax")
            limit = a.get("limit") if a["action"] == "rescale" else (a.get("measured") or {}).get("limit")
            lines.append(_row([i, a["action"], action_target(a), measured, limit, a.get("why", "")]))
    else:
        lines.append("No action needed.")
    if result["declined"]:
        lines += ["", "## Declined remedies", "", "| remedy | target | reason |", "|---|---|---|"]
        lines += [_row([d["remedy"], d["target"], d["reason"]]) for d in result["declined"]]
    fixed = fixed_tensors(result)
    rows = [t for t in result.get("tensors", []) if t["tensor"] in fixed]
    if rows:
        lines += ["", "## Headroom of every fixed tensor",
                  "", f"Headroom = {result['precision']} max / abs-max (>1 fits); before: the "
                  "original model's calibration; after: what the converted model stores "
                  "(scaled where a rescale acts); a tensor stored in fp32 has no limit.", "",
                  "| tensor | node | abs-max before | headroom before | abs-max after | stored as | headroom after | scale |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [_row([t["tensor"], t["node"], t["absmax_before"], t["headroom_before"],
                        t["absmax_after"], t.get("stored_as", "-"), t["headroom_after"], t["scale"]])
                  for t in rows]
    lines += ["", "## Output error (lowered model, emulated target numerics)", ""]
    lines += ["| output | Inf/NaN | max abs error | rel L2 | limit |", "|---|---|---|---|---|"]
    for name, o in (ver.get("outputs") or {}).items():
        lines.append(_row([name, o["nonfinite"], o["max_abs_error"], o["rel_l2"], ver.get("rtol")]))
    if result.get("holdout"):
        lines += ["", "Holdout samples:", ""]
        for name, o in result["holdout"]["outputs"].items():
            lines.append(f"- `{name}`: Inf/NaN {o['nonfinite']}, max abs error {_num(o['max_abs_error'])}, "
                         f"rel L2 {_num(o['rel_l2'])}")
    first = result.get("first_divergent")
    if first:
        lines += ["", f"**First divergent node:** `{first.get('node')}` ({first.get('op_type')}), "
                  f"tensor `{first.get('tensor')}`"]
    if result.get("artefacts"):
        lines += ["", "## Artefacts", ""]
        lines += [f"- {k}: `{v}`" for k, v in sorted(result["artefacts"].items())]
    if result.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"
