"""The ledger section of convert's Markdown report: time per format, what the pins and casts cost.

Reads the `ledger` dict of a convert result (npuprep.ledger.ledger.Ledger.to_dict()).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from npuprep.formatting import number, percent, ratio
from npuprep.names import md_cell, md_text


def _ms(value: float | None) -> str:
    return "unknown" if value is None else number(value)


def _speedup(row: Mapping[str, Any]) -> str:
    """`9.7x`, or `1.3x to 12x` where only a range is known."""
    span = row.get("speedup_range")
    if row["speedup_vs_fp32"] is None and span:
        return f"{ratio(span[0])} to {ratio(span[1])}"
    return ratio(row["speedup_vs_fp32"]) or "-"


def ledger_markdown(ledger: Mapping[str, Any]) -> list[str]:
    """Lines of the section (an estimate, and it says so)."""
    unit = ledger["throughput"].get("unit") or "the target"
    lines = ["", "## What the pins cost (estimate)", "",
             f"Roofline per node on {md_text(unit)}: max(FLOPs / dense peak, bytes / bandwidth), from "
             "the profile's published figures, its sustained efficiency, launch cost per op class, "
             "per-run cost and fusion. "
             "An estimate: time it on the board with `npuprep ledger --export-kit`.", "",
             "| format | estimated ms | vs FP32 | memory-bound time | casts |", "|---|---|---|---|---|"]
    for r in ledger["formats"]:
        lines.append(f"| {md_cell(r['format'])} | {_ms(r['estimated_ms'])} | "
                     f"{_speedup(r)} | {percent(r['memory_bound_share']) or '-'} "
                     f"| {r['casts']} |")
    pins = ledger.get("pins")
    if pins:
        lines.append("")
        if pins["extra_ms"] is None:
            lines.append(f"Pins and casts: {pins['fp32_nodes']} FP32 node(s), {pins['casts']} cast(s); "
                         f"their cost is unknown: {md_text(pins['unknown'])}.")
        else:
            lines.append(f"Pins and casts cost **{number(pins['extra_ms'])} ms** over the same graph "
                         f"all in {ledger['precision']} ({percent(pins['extra_share'])} of the converted "
                         f"{number(pins['converted_ms'])} ms): {pins['fp32_nodes']} FP32 node(s) take "
                         f"{number(pins['fp32_nodes_ms'])} ms, {pins['casts']} cast(s) "
                         f"{number(pins['casts_ms'])} ms.")
    lines += ["", *(f"- {md_cell(r['format'])}: {md_text(r['why'])}" for r in ledger["formats"][1:]
                    if r.get("why"))]
    unknown = [r for r in ledger["formats"] if r["unknown"]]
    lines += [f"- {md_cell(r['format'])}: unknown: {md_text(r['unknown'])}" for r in unknown[:1]]
    costly = ledger.get("costliest") or []
    if costly:
        lines += ["", f"Ten costliest nodes ({md_text(ledger['costliest_of'])}):", "",
                  "| node | op | format | FLOPs | bytes | estimated ms | bound |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {md_cell(n['node'])} | {n['op_type']} | {n['format']} | {number(n['flops'])} | "
                  f"{number(n['bytes'])} | {_ms(n['estimated_ms'])} | {n['bound']} |" for n in costly]
    return lines


def pins_line(ledger: Mapping[str, Any]) -> str:
    """One line for the terminal: the converted model's estimate and what its pins cost."""
    pins = ledger.get("pins") or {}
    converted = next((r for r in ledger["formats"] if r["format"] == "converted"), None)
    if converted is not None and converted.get("speedup_range"):
        return (f"Estimated on {ledger['target']}: converted {_speedup(converted)} vs FP32 (the "
                "range its known and assumed figures allow; `npuprep ledger` names them)")
    if converted is None or pins.get("extra_ms") is None:
        return (f"Estimated time on {ledger['target']}: unknown ({pins.get('unknown') or 'no converted row'}); "
                "`npuprep ledger` with --peak/--bandwidth sets the figures")
    return (f"Estimated (roofline, published peaks): converted {number(converted['estimated_ms'])} ms, "
            f"{ratio(converted['speedup_vs_fp32'])} vs FP32; pins and casts cost "
            f"{number(pins['extra_ms'])} ms ({percent(pins['extra_share'])})")
