"""Markdown summary of a conversion: actions with their numbers, FP32 share, Casts, headroom, errors."""

from __future__ import annotations

from typing import Any

from npuprep.names import md_cell, md_code, md_text, shown
from npuprep.report.ledger_md import ledger_markdown
from npuprep.report.output_verdicts import (
    agreement_said,
    decision_said,
    judged_by_decisions,
    ties_said,
    where_errors_sit,
)
from npuprep.report.pin_count import pins_said
from npuprep.report.tables import failure_said, stage_table


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.4g}" if v == 0 or 1e-3 <= abs(v) < 1e5 else f"{v:.3e}"
    return shown(v)


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(md_cell(_num(c)) for c in cells) + " |"


def action_target(a: dict[str, Any]) -> str:
    if a["action"] == "rescale":
        return f"{a['entry']} (x2^{-a['k']})"
    if a["action"] == "softmax_shift":
        return f"{a['exp']} (x - max)"
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


def resources_line(resources: dict[str, Any]) -> str:
    """What the run cost: wall time and peak resident memory, and the stage at the peak."""
    stages = resources.get("stages_peak_rss_mb") or {}
    top = max(stages, key=lambda s: stages[s]) if stages else ""
    budget = resources.get("max_memory_mb")
    cpu = f" (CPU {resources['cpu_s']:g} s)" if resources.get("cpu_s") is not None else ""
    return (f"- run: {resources['wall_s']:g} s{cpu}, peak resident memory "
            f"{resources['peak_rss_mb']} MB"
            + (f" (highest while {md_text(top)})" if top else "")
            + (f", within --max-memory {budget} MB" if budget else ""))


def stage_time_lines(resources: dict[str, Any]) -> list[str]:
    """The run's wall and CPU seconds per stage, in the order the stages ran, as a table (the
    rows of the HTML page's, npuprep.report.tables.stage_table)."""
    table = stage_table({"resources": resources})
    return ["", "## Time by stage", "", "| stage | wall s | CPU s | share of the wall time |",
            "|---|---|---|---|",
            *(_row([md_text(name), f"{wall:.1f}", f"{cpu:.1f}", f"{share:.0f}%"])
              for name, wall, cpu, share in table.rows)] if table is not None else []


def longest_stages(resources: dict[str, Any], count: int = 3) -> str:
    """The `count` stages that took the most wall time: `name 22.9 s, ...`."""
    stages = resources.get("stage_seconds") or {}
    top = sorted(stages.items(), key=lambda kv: -kv[1]["wall_s"])[:count]
    return ", ".join(f"{name} {t['wall_s']:.1f} s" for name, t in top)


def _verdict(result: dict[str, Any]) -> str:
    """**PASSED**, or **FAILED**: the cause, then the gate it tripped (as the pipeline said it)."""
    if result["passed"]:
        return "**PASSED**"
    said = failure_said(result)
    return "**FAILED**" + (f": {md_text(said)}" if said else "")


def convert_markdown(result: dict[str, Any]) -> str:
    """The Markdown summary of a `convert` result dict (ConversionResult.to_dict())."""
    ver = result.get("verification") or {}
    lines = [
        f"# npuprep convert: {md_text(result['model'])} -> {md_text(result['target'])} ({result['precision']})",
        "",
        f"- verdict: {_verdict(result)}",
        f"- output: {md_code(result.get('output') or '-')}",
        f"- model fingerprint: `{result['fingerprint']}`; output fingerprint: `{result['output_fingerprint']}`",
        f"- samples: {md_text(result['samples']['description'])}"
        + (" (synthetic: not real data)" if result["samples"]["synthetic"] else ""),
        f"- FLOPs left in FP32: {100 * result['flops_fp32_share']:.2f}%",
        *([f"- {md_text(result['fp32_verdict'])}"] if result.get("fp32_verdict") else []),
        f"- Cast nodes inserted: {result['cast_count']}",
        f"- FP32 nodes: {pins_said(result)}",
        f"- verification rounds: {result['rounds']}",
        *([resources_line(result["resources"])] if result.get("resources") else []),
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
    islands = (result.get("fp32_share") or {}).get("islands") or []
    if islands:
        total = max(result["fp32_share"]["total_flops"], 1)
        lines += ["", "## FP32 islands, costliest first", "",
                  "| nodes | FLOPs | share | multiply-add FLOPs | why | declined |",
                  "|---|---|---|---|---|---|"]
        lines += [_row([", ".join(i["nodes"]), i["flops"], f"{100 * i['flops'] / total:.1f}%",
                        i["mac_flops"], i["why"], i["declined"] or "-"]) for i in islands]
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
    lines += ["| output | Inf/NaN | max abs error | rel L2 | limit | decisions | judged by |",
              "|---|---|---|---|---|---|---|"]
    rules = result.get("judged_by") or {}
    for name, o in (ver.get("outputs") or {}).items():
        lines.append(_row([name, o["nonfinite"], o["max_abs_error"], o["rel_l2"], ver.get("rtol"),
                           _decisions(o) or "-", rules.get(name, "rel L2")]))
    if ver.get("samples_emulated_in_compare"):
        lines += ["", f"{ver['samples_emulated_in_compare']} of {ver.get('samples')} calibration samples' "
                  "emulated outputs are the layer-by-layer compare's: the same emulation where the "
                  "target cannot pin, else one that gave the lowered model's emulated outputs bit "
                  "for bit on the first sample."]
    if any("top_k" in o for o in (ver.get("outputs") or {}).values()):
        lines += ["", "An output judged by its top-K classes passes when they agree at every position "
                  "where FP32 decides, whatever its rel L2 (`--top-k`, or `--metric auto` for an "
                  "output a consumer decides by argmax); a position whose FP32 values lie within "
                  "the limit of each other is a tie, not a decision."]
    if any("detect" in o for o in (ver.get("outputs") or {}).values()):
        lines += ["", "A detector's score output (`--detect`) passes when every (position, class) "
                  "whose FP32 score lies further than the limit x max(1, threshold) from it stays on "
                  "its side; a box output by its rel L2 at the positions FP32 detects. "
                  "Detections per sample, calibration: " + "; ".join(
                      f"{md_code(n)} {', '.join(map(str, o['detections']))}"
                      for n, o in ver["outputs"].items() if "detect" in o) + "."]
    if result.get("holdout"):
        lines += ["", "Holdout samples:", ""]
        for name, o in result["holdout"]["outputs"].items():
            agree = f", {_decisions(o)}" if judged_by_decisions(o) else ""
            agree += (f" (detections per sample {', '.join(map(str, o['detections']))})"
                      if "detect" in o else "")
            lines.append(f"- {md_code(name)}: Inf/NaN {o['nonfinite']}, max abs error {_num(o['max_abs_error'])}, "
                         f"rel L2 {_num(o['rel_l2'])}{agree}")
    lines += _second_draw_lines(result)
    where = where_errors_sit(result)
    if where:
        lines += ["", "Where the error sits (an error at a few positions where the FP32 model is "
                  "undecided is its conditioning there, not the conversion):", ""]
        lines += [f"- {md_code(name)} on the {which}: {md_text(w)}" for which, name, _, w in where]
    lines += _attribution_lines(result)
    if result.get("ledger"):
        lines += ledger_markdown(result["ledger"])
    first = result.get("first_divergent")
    if first:
        lines += ["", f"**First divergent node:** {md_code(first.get('node'))} ({md_text(first.get('op_type'))}), "
                  f"tensor {md_code(first.get('tensor'))}"]
    lines += stage_time_lines(result.get("resources") or {})
    if result.get("artefacts"):
        lines += ["", "## Artefacts", ""]
        lines += [f"- {k}: {md_code(v)}" for k, v in sorted(result["artefacts"].items())]
    if result.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {shown(n)}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


# Layers listed per attribution round; the JSON report has them all.
ATTRIBUTED_SHOWN = 10


def _second_draw_lines(result: dict[str, Any]) -> list[str]:
    """An 8-bit conversion's written model as onnxruntime runs it (npuprep.verify.second_draw),
    output by output, beside the verified run's numbers above."""
    drawn = (result.get("eight_bit") or {}).get("as_written")
    if not drawn:
        return []
    lines = ["", "The written model as onnxruntime runs it (its wider layers in FP32: another draw "
             "of the 8-bit rounding than the verified FP16 run; the gate reads the verified one):",
             ""]
    for which, key in (("calibration", "calibration"), ("held-out", "holdout")):
        for name, o in ((drawn.get(key) or {}).get("outputs") or {}).items():
            agree = f", {_decisions(o)}" if judged_by_decisions(o) else ""
            lines.append(f"- {md_code(name)} on the {which} samples: Inf/NaN {o['nonfinite']}, "
                         f"max abs error {_num(o['max_abs_error'])}, rel L2 {_num(o['rel_l2'])}"
                         f"{agree}")
    return lines


def _attribution_lines(result: dict[str, Any]) -> list[str]:
    """Per round that traced a precision failure: the layers by their own error in the format."""
    total = max((result.get("fp32_share") or {}).get("total_flops") or 0, 1)
    lines: list[str] = []
    for traced in result.get("error_attribution") or []:
        layers = traced["layers"]
        fmt = str(traced.get("format") or "fp16").upper()
        lines += ["", f"## Where the {fmt} error comes from (round {traced['round']})", "",
                  f"Each of {len(layers)} nodes rounded alone, the rest FP32, on "
                  f"{traced['samples']} sample(s); a share is of the layers' summed squared "
                  "error (independent roundings add up in it). Pinned after this round: "
                  f"{', '.join(md_code(n) for n in traced['pinned']) or 'none'}"
                  f"{' (dropped again: the next round was not 10% better)' if traced.get('dropped') else ''}.",
                  "",
                  "| node | op | own rel L2 | share of the error | share of FLOPs | pinned |",
                  "|---|---|---|---|---|---|"]
        lines += [_row([x["node"], x["op_type"], x["rel_l2"], f"{100 * x['share']:.1f}%",
                        f"{100 * x['flops'] / total:.3g}%",
                        ("dropped" if traced.get("dropped") else "yes")
                        if x["node"] in traced["pinned"] else ""])
                  for x in layers[:ATTRIBUTED_SHOWN]]
        if len(layers) > ATTRIBUTED_SHOWN:
            lines.append(f"\n... and {len(layers) - ATTRIBUTED_SHOWN} more layers in the JSON report.")
    return lines


def _decisions(errors: dict[str, Any]) -> str:
    """`top-1 agreement 100%` for an output judged by its top-K, a detector's cell for one
    judged by --detect, else ''."""
    if "top_k" not in errors:
        return agreement_said(errors)
    return (f"{decision_said(errors)} agreement {100 * errors['top_k_agreement']:.4g}%"
            f"{ties_said(errors)}")
