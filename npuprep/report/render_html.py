"""A result dict (check, stats, compare, convert, crosscheck, probe) -> one self-contained HTML page.

No network and no external assets: CSS and the small table-sorting script are inline, the
charts are inline SVG from matplotlib (optional extra `plots`; without it the page keeps its
tables and says how to get the charts). Same result, same bytes.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from npuprep import __version__
from npuprep.errors import NpuprepError
from npuprep.profiles import load_profile
from npuprep.report import plots as charts
from npuprep.report.series import (
    compare_of,
    error_series,
    in_order,
    limits,
    profile_of,
    remedy_marks,
    tensor_points,
)
from npuprep.report.tables import (
    SEVERITY_RANK,
    Table,
    failure_said,
    notes,
    profile_rows,
    summary,
    tables,
    verdict,
)

KINDS: tuple[str, ...] = ("check", "stats", "compare", "convert", "crosscheck", "probe")

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;
max-width:1200px;padding:0 1.2em 3em;color:#1c2833;background:#fff}
h1{font-size:1.5em;margin:.8em 0 .2em}h2{font-size:1.15em;margin:1.6em 0 .4em;
border-bottom:1px solid #d5d8dc;padding-bottom:.2em}
.verdict{display:inline-block;padding:.1em .6em;border-radius:3px;font-weight:600;color:#fff}
.verdict.pass{background:#1e8449}.verdict.fail{background:#c0392b}.verdict.none{background:#7f8c8d}
.verdict-said{margin:.4em 0 0;color:#922b21;font-weight:600}
table{border-collapse:collapse;margin:.4em 0;font-size:12.5px}
td,th{border:1px solid #d5d8dc;padding:.25em .5em;vertical-align:top;text-align:left}
th{background:#f4f6f7;white-space:nowrap}
table.sortable th{cursor:pointer;user-select:none}
table.sortable th:hover{background:#e5e8e8}
th[aria-sort=ascending]::after{content:" \\25B2"}th[aria-sort=descending]::after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.kv th{text-align:left;font-weight:600}
.sev-error{color:#c0392b;font-weight:600}.sev-warning{color:#b9770e;font-weight:600}
.sev-info{color:#566573}
tr.fail td{background:#fdedec}tr.first-divergent td{background:#f5b7b1}
.scroll{overflow-x:auto}
svg.chart{width:100%;height:auto;display:block}
figure{margin:.4em 0}figcaption{color:#566573;font-size:12.5px}
.note{background:#fef9e7;border-left:4px solid #f1c40f;padding:.4em .8em}
code{background:#f4f6f7;padding:0 .25em}nav{margin:.6em 0;font-size:13px}
a{color:#1f618d}footer{margin-top:2em;color:#7f8c8d;font-size:12px}
"""

# Click (or Enter on) a header to sort by that column; again to reverse. Empty cells sort last.
JS = """
(function () {
  function key(cell, numeric) {
    var v = cell.hasAttribute('data-v') ? cell.getAttribute('data-v') : cell.textContent;
    if (!numeric) { return v.toLowerCase(); }
    return v === '' ? null : parseFloat(v);
  }
  function sortBy(table, col, th) {
    var numeric = th.getAttribute('data-type') !== 'text';
    var ascending = th.getAttribute('aria-sort') !== 'ascending';
    var heads = table.tHead.rows[0].cells;
    for (var i = 0; i < heads.length; i++) { heads[i].removeAttribute('aria-sort'); }
    th.setAttribute('aria-sort', ascending ? 'ascending' : 'descending');
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = key(a.cells[col], numeric), y = key(b.cells[col], numeric);
      if (x === null || (numeric && isNaN(x))) { return (y === null || isNaN(y)) ? 0 : 1; }
      if (y === null || (numeric && isNaN(y))) { return -1; }
      var c = x < y ? -1 : (x > y ? 1 : 0);
      return ascending ? c : -c;
    });
    rows.forEach(function (r) { body.appendChild(r); });
  }
  var tables = document.querySelectorAll('table.sortable');
  Array.prototype.forEach.call(tables, function (table) {
    var heads = table.tHead.rows[0].cells;
    Array.prototype.forEach.call(heads, function (th, col) {
      th.addEventListener('click', function () { sortBy(table, col, th); });
      th.addEventListener('keydown', function (e) {
        if (e.key === 'Enter' || e.key === ' ') { e.preventDefault(); sortBy(table, col, th); }
      });
    });
  });
})();
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    text = f"{value:.4g}" if 1e-3 <= abs(value) < 1e5 else f"{value:.3e}"
    # A cosine of 0.99999999 must not read as 1.
    return f"{value:.10g}" if abs(float(text)) == 1 and value != float(text) else text


def _cell(value: Any, kind: str) -> str:
    if kind == "severity":
        rank = SEVERITY_RANK.get(str(value), -1)
        return f'<td class="sev-{_e(value)}" data-v="{rank}">{_e(value)}</td>'
    if kind == "num":
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            return '<td class="num" data-v=""></td>'
        v = float(value)
        sort_key = "" if math.isnan(v) else ("Infinity" if v == math.inf else
                                              "-Infinity" if v == -math.inf else repr(value))
        return f'<td class="num" data-v="{sort_key}">{_e(_fmt(v))}</td>'
    return f"<td>{_e(value)}</td>"


def _row_class(table: Table, row: tuple[Any, ...], first_tensor: str) -> str:
    names = [c.name for c in table.columns]
    classes = []
    if "passed" in names and row[names.index("passed")] == "False":
        classes.append("fail")
    if first_tensor and table.key == "errors" and row[names.index("tensor")] == first_tensor:
        classes.append("first-divergent")
    return f' class="{" ".join(classes)}"' if classes else ""


def _table_html(table: Table, first_tensor: str) -> str:
    out = [f'<section id="{_e(table.key)}"><h2>{_e(table.title)}</h2>']
    if not table.rows:
        out.append("<p>None.</p></section>")
        return "\n".join(out)
    head = "".join(
        f'<th data-type="{"text" if c.kind == "text" else "num"}" tabindex="0" scope="col">'
        f"{_e(c.name)}</th>" for c in table.columns)
    out.append(f'<div class="scroll"><table class="sortable" id="table-{_e(table.key)}">'
               f"<thead><tr>{head}</tr></thead><tbody>")
    for row in table.rows:
        cells = "".join(_cell(v, c.kind) for v, c in zip(row, table.columns, strict=True))
        out.append(f"<tr{_row_class(table, row, first_tensor)}>{cells}</tr>")
    out.append("</tbody></table></div></section>")
    return "\n".join(out)


def _kv_table(rows: list[tuple[str, str]], table_id: str) -> str:
    body = "".join(f"<tr><th scope=\"row\">{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    return f'<table class="kv" id="{_e(table_id)}"><tbody>{body}</tbody></table>'


def _nav_html(made: tuple[Table, ...], has_profile: bool, has_charts: bool = True) -> str:
    links = [("summary", "Summary"), *([("charts", "Charts")] if has_charts else [])]
    links += [(t.key, t.title) for t in made]
    if has_profile:
        links.append(("profile", "Target profile"))
    return "<nav>" + " &middot; ".join(f'<a href="#{_e(k)}">{_e(v)}</a>' for k, v in links) + "</nav>"


def _said_html(said: str) -> str:
    """A failure's sentence beside its badge (report.md's, from report.json's verdict): the
    cause first, then the gate that tripped."""
    return f'<p class="verdict-said" id="verdict-said">{_e(said)}</p>' if said else ""


def _notes_html(items: list[str]) -> str:
    """The notes, folded (a <details> a reader opens): dozens of them must not push the chart down."""
    if not items:
        return ""
    return (f'<section id="notes"><details><summary><h2>Notes ({len(items)})</h2></summary><ul>'
            + "".join(f"<li>{_e(n)}</li>" for n in items) + "</ul></details></section>")


def _charts_html(result: Mapping[str, Any], plots: bool, order: Sequence[str]) -> str:
    points = tensor_points(result, order)
    errors = error_series(result)
    if not points and errors is None:
        if result.get("kind") in ("crosscheck", "probe"):
            return ""
        return ('<section id="charts"><p class="note">This result records no per-tensor ranges '
                "or errors to chart (check with --data, calibrate, compare or convert do).</p>"
                "</section>")
    if not plots:
        return '<section id="charts"><p class="note">Charts were not asked for.</p></section>'
    if not charts.available():
        return ('<section id="charts"><p class="note" id="plots-missing">The charts need '
                f"matplotlib: <code>{_e(charts.INSTALL_HINT)}</code>. The tables below hold "
                "the same numbers.</p></section>")
    out = ['<section id="charts">']
    if points:
        lims = limits(result)
        marks = remedy_marks(result, points)
        ordered = "in topological order" if in_order(result, order) else \
            "by name (give the model for topological order: npuprep report --model)"
        caption = (f"Largest magnitude of every tensor {ordered} (log scale) against "
                   "the target limits: " + "; ".join(lim.label for lim in lims) + ".")
        if any(p.mask for p in points):
            caption += (" Grey diamonds: tensors holding an intentional -inf mask, at their finite "
                        "maximum where the result records it, else on the top edge.")
        if any(p.absmax_after is not None for p in points):
            caption += " Grey dashed, open circles: before the remedies; blue solid: after."
        if marks:
            caption += " Triangles and bands mark where remedies act."
        caption += " Hover a point for its tensor and value."
        out.append(f'<h2>Headroom</h2><figure id="headroom-chart">'
                   f"{charts.headroom_svg(points, lims, marks, in_order(result, order))}"
                   f"<figcaption>{_e(caption)}</figcaption></figure>")
    if errors is not None and errors.points:
        caption = ("Error of each tensor against the reference, in topological order (log scale); "
                   "dotted red: the thresholds (a tensor fails above both). Hover a point for its "
                   "tensor and values.")
        if any(p.mask for p in errors.points):
            caption += (" Grey diamonds: intentional -inf masks, whose error is undefined "
                        "(the reference is -inf there); they pass.")
        if errors.first_divergent is not None:
            caption += f" First divergent node: {errors.first_divergent_label}."
        else:
            caption += " No tensor crossed the threshold."
        out.append(f'<h2>Error per layer</h2><figure id="error-chart">{charts.error_svg(errors)}'
                   f"<figcaption>{_e(caption)}</figcaption></figure>")
    out += _ledger_chart(result)
    out.append("</section>")
    return "\n".join(out)


def _ledger_chart(result: Mapping[str, Any]) -> list[str]:
    """Convert's ledger: estimated time per format, where the profile has the figures."""
    ledger = result.get("ledger")
    formats = ledger.get("formats") if isinstance(ledger, Mapping) else None
    if not formats or not any(r.get("estimated_ms") is not None for r in formats):
        return []
    caption = ("Estimated time per format on the target (roofline per node from the profile's "
               "published peaks and bandwidth; an estimate, measure it with the ledger's kit): "
               "memory-bound part in blue, compute-bound in orange.")
    return [f'<h2>What each format buys (estimate)</h2><figure id="ledger-chart">'
            f"{charts.ledger_svg(formats)}<figcaption>{_e(caption)}</figcaption></figure>"]


def _with_profile(result: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The result with its target profile; one that names its target without embedding the
    profile gets it loaded now, and the page says so."""
    if profile_of(result):
        return dict(result), ""
    for key in ("target_path", "target"):
        source = result.get(key)
        if isinstance(source, str) and source:
            try:
                profile = load_profile(source).to_dict()
            except NpuprepError:
                continue
            return dict(result, profile=profile), (
                f"The result names target '{source}' but does not embed its profile: shown as "
                "loaded when this page was made.")
    return dict(result), ""


def render(result: Mapping[str, Any] | Any, *, plots: bool = True, order: Sequence[str] = ()) -> str:
    """The whole page for a check, stats, compare, convert, crosscheck or probe result.

    `result` is the dict a command prints with --json (or an object with `to_dict()`); it is
    taken through the same JSON as the file, so `--html` and `npuprep report` on the saved
    JSON give the same bytes. `order` lists tensor names in topological order (from the
    model) for a stats object, which is keyed by name; compare and convert results are
    already in order.
    """
    from npuprep.json_io import dump_json

    if not isinstance(result, Mapping) and not hasattr(result, "to_dict"):
        raise NpuprepError("result is not a JSON object")
    result = json.loads(dump_json(result))
    if not isinstance(result, Mapping):
        raise NpuprepError("result is not a JSON object")
    kind = result.get("kind")
    if kind not in KINDS:
        raise NpuprepError(f"result kind '{kind}' has no HTML report (known: {', '.join(KINDS)})")
    result, profile_source = _with_profile(result)
    passed = verdict(result)
    badge = {True: ("pass", "PASSED"), False: ("fail", "FAILED"), None: ("none", "NO VERDICT")}[passed]
    title = f"npuprep {kind}: {result.get('model') or result.get('candidate') or ''}".strip(": ")
    cmp = compare_of(result)
    first = cmp.get("first_divergent") if cmp else None
    first_tensor = str(first.get("tensor", "")) if isinstance(first, Mapping) else ""
    profile = profile_of(result)
    made = tables(result, order)
    charts_part = _charts_html(result, plots, order)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>",
        f'<header><h1>{_e(title)}</h1><span class="verdict {badge[0]}" id="verdict">{badge[1]}'
        "</span>" + _said_html(failure_said(result)) + "</header>",
        _nav_html(made, bool(profile), bool(charts_part)),
        f'<section id="summary"><h2>Summary</h2>{_kv_table(summary(result), "summary-table")}</section>',
        charts_part,
        _notes_html(notes(result)),
        *(_table_html(t, first_tensor) for t in made),
    ]
    if profile:
        source = f'<p class="note">{_e(profile_source)}</p>' if profile_source else ""
        parts.append(f'<section id="profile"><h2>Target profile</h2>{source}'
                     f"{_kv_table(profile_rows(profile), 'profile-table')}</section>")
    parts.append(f"<footer>npuprep {_e(__version__)} &middot; model fingerprint "
                 f"<code>{_e(result.get('fingerprint') or '(none)')}</code></footer>")
    parts.append(f"<script>{JS}</script></body></html>\n")
    return "\n".join(parts)


def write_html(result: Mapping[str, Any] | Any, path: str | Path, *, plots: bool = True,
               order: Sequence[str] = ()) -> Path:
    """Render `result` and write it atomically to `path` (nothing is written on error)."""
    from npuprep.output_files import write_text_atomic

    return write_text_atomic(path, render(result, plots=plots, order=order))
