"""Crosscheck as Markdown: counts, then every failing or doubtful node, then the rest."""

from __future__ import annotations

from npuprep.crosscheck.check import DISPLAY_ORDER, Crosscheck, Verdict
from npuprep.names import md_cell, md_code, shown

COLUMNS = ("verdict", "node", "op", "runs in", "needs", "layers", "why")
# The terminal's default: the rules as short codes, the sentence stays in --json and the Markdown.
SHORT_COLUMNS = ("verdict", "node", "op", "runs in", "needs", "rules")


def row(v: Verdict) -> tuple[str, ...]:
    why = v.reason + "".join(f"; {flag}" for flag in v.flags)
    runs_in = v.runs_in + (" (assumed)" if v.evidence.get("runs_in_assumed") else "")
    return (v.verdict, v.node, v.op_type, runs_in or "-", v.needs or "-",
            " / ".join(v.layers) or "-", why)


def short_row(v: Verdict) -> tuple[str, ...]:
    runs_in = v.runs_in + ("?" if v.evidence.get("runs_in_assumed") else "")
    return (v.verdict, v.node, v.op_type, runs_in or "-", v.needs or "-", ",".join(v.rules) or "-")


def to_markdown(result: Crosscheck) -> str:
    status = "PASSED" if result else "FAILED"
    counts = ", ".join(f"{k}: {n}" for k, n in result.counts.items() if n)
    lines = [
        f"# Crosscheck: {result.report_format} report vs npuprep findings ({status})",
        "",
        f"- report: {md_code(result.report)}",
        f"- target: {md_code(result.target)}; model fingerprint {md_code(result.fingerprint)}",
        f"- verdicts: {counts or 'none'}",
    ]
    lines += [f"- note: {shown(n)}" for n in result.notes]
    for verdict in DISPLAY_ORDER:
        chosen = result.of(verdict)
        if not chosen:
            continue
        lines += ["", f"## {verdict} ({len(chosen)})", "",
                  "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(_cell(c) for c in row(v)) + " |" for v in chosen]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return md_cell(text)
