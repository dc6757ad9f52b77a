"""Charts as inline SVG text (matplotlib, optional extra `plots`): headroom and per-layer error.

Byte-identical for the same inputs: no pyplot state, a fixed `svg.hashsalt` per chart, no
date or creator metadata, text kept as text (`svg.fonttype: none`) so labels stay searchable.
"""

from __future__ import annotations

import html
import io
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from npuprep.formatting import number
from npuprep.report.series import ErrorSeries, Limit, RemedyMark, TensorPoint

INSTALL_HINT = "pip install npuprep[plots]"
LIMIT_STYLE = {"max": ("#c0392b", "-"), "fp8": ("#7b241c", "-."), "headroom": ("#e67e22", "--"),
               "min_normal": ("#7d3c98", ":")}
# Before a remedy: grey, dashed, open circles; after: blue, solid, filled (apart even in grey print).
BEFORE = {"color": "#7f8c8d", "linestyle": "--", "hollow": True}
AFTER = {"color": "#2471a3", "linestyle": "-", "hollow": False}
REMEDY_COLOR = {"rescale": "#27ae60", "clamp": "#f39c12", "pin_fp32": "#8e44ad",
                "softmax_shift": "#16a085"}
# Tensor names fit under the axis up to this many tensors; beyond, positions are numbered.
NAMED_TICKS = 40
# Beyond this many tensors, per-point markers only blur the line.
DOTTED_UP_TO = 200
# An intentional -inf mask: a grey diamond, apart from the red crosses of non-finite failures.
MASK = {"marker": "D", "s": 36, "color": "#7f8c8d", "zorder": 5, "label": "mask (-inf on purpose)"}
# Legends sit right of the plot, where they cannot hide data or the first-divergent mark.
LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.005, 1.0), "fontsize": 8, "frameon": False}


def available() -> bool:
    """Whether matplotlib can be imported (the `plots` extra is installed)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(height: float, rows: int = 1) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, height), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, axes


def _to_svg(fig: Any, name: str, titles: dict[str, str] | None = None) -> str:
    """The figure as an <svg> element to inline: no XML prolog, sized by its container, its
    ids prefixed with `name` so two charts on one page never share one. `titles` {gid: text}
    become the <title> (the browser's hover label) of the artist drawn with that gid."""
    import matplotlib as mpl

    buf = io.StringIO()
    with mpl.rc_context({"svg.hashsalt": f"npuprep-{name}", "svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None,
                                                 "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r'<svg ([^>]*?)width="[^"]*" height="[^"]*"', r'<svg class="chart" role="img" \1',
                 svg, count=1)
    svg = re.sub(r'\b(id="|href="#|url\(#)', rf"\g<1>{name}-", svg)
    for gid, title in (titles or {}).items():
        tag = f'<g id="{name}-{gid}">'
        svg = svg.replace(tag, f"{tag}<title>{html.escape(title)}</title>", 1)
    return svg.strip() + "\n"


def _runs(positions: Iterable[int]) -> list[tuple[int, int]]:
    """Consecutive positions as (first, last) runs, so a long island is one band."""
    runs: list[tuple[int, int]] = []
    for p in sorted(set(positions)):
        if runs and p == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], p)
        else:
            runs.append((p, p))
    return runs


def _finite_positive(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v) and v > 0]


def _y(v: float | None, floor: float, ceiling: float) -> float | None:
    """Where a magnitude sits on a log axis: zeros on the floor, non-finite on the ceiling."""
    return None if v is None else (ceiling if not math.isfinite(v) else max(v, floor))


def _plot_magnitudes(ax: Any, xs: Sequence[int], values: Sequence[float | None], floor: float,
                     ceiling: float, *, label: str, color: str, marker: str = "o",
                     linestyle: str = "-", hollow: bool = False,
                     masks: Sequence[bool] = ()) -> None:
    """A log-scale line of magnitudes; zeros sit on the floor, non-finite on the ceiling, and
    the points of `masks` (intentional -inf masks) as masks, out of the line."""
    masked = {x for x, m in zip(xs, masks, strict=False) if m}
    values = [None if x in masked else v for x, v in zip(xs, values, strict=True)]
    ys = [_y(v, floor, ceiling) for v in values]
    dense = len(xs) > DOTTED_UP_TO
    ax.plot(xs, [math.nan if y is None else y for y in ys], color=color, linestyle=linestyle,
            marker=None if dense else marker, markersize=4 if hollow else 3,
            markerfacecolor="none" if hollow else color, linewidth=0.7 if dense else 1, label=label)
    bad = [x for x, v in zip(xs, values, strict=True) if v is not None and not math.isfinite(v)]
    if bad:
        ax.scatter(bad, [ceiling] * len(bad), marker="X", s=50, color="#c0392b", zorder=5,
                   label=f"{label}: non-finite")


def _plot_masks(ax: Any, xs: Sequence[int], values: Sequence[float | None], masks: Sequence[bool],
                floor: float, ceiling: float) -> None:
    """The mask points: at their value where it is finite, else on the ceiling."""
    at = [(x, _y(v, floor, ceiling) or ceiling) for x, v, m in zip(xs, values, masks, strict=True) if m]
    if at:
        ax.scatter([x for x, _ in at], [y for _, y in at], **MASK)


def _hover(ax: Any, key: str, xs: Sequence[int], values: Sequence[float | None], floor: float,
           ceiling: float, titles: Sequence[str]) -> dict[str, str]:
    """A near-invisible marker on every plotted point, with an id whose <title> names the
    tensor and its value (the browser shows it on hover); {gid: title} for _to_svg."""
    out = {}
    for x, v, title in zip(xs, values, titles, strict=True):
        y = _y(v, floor, ceiling)
        if y is None:
            continue
        (dot,) = ax.plot([x], [y], linestyle="none", marker="o", markersize=8, markerfacecolor="#ffffff",
                         markeredgecolor="none", alpha=0.01, zorder=8)
        gid = f"hover-{key}-{x}"
        dot.set_gid(gid)
        out[gid] = title
    return out


def _tensor_axis(ax: Any, names: Sequence[str], ordered: bool = True) -> None:
    order = "topological order" if ordered else "by name"
    if 0 < len(names) <= NAMED_TICKS:
        ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
        ax.set_xlabel(f"tensor ({order})")
    else:
        ax.set_xlabel(f"tensor # {'in ' if ordered else ''}{order} (see the tensor table)")
    ax.set_xlim(-0.5, max(len(names), 1) - 0.5)


def headroom_svg(points: Sequence[TensorPoint], limits: Sequence[Limit],
                 marks: Sequence[RemedyMark], ordered: bool = True) -> str:
    """Abs-max of every tensor on a log scale with the target limits and the remedies."""
    from matplotlib.patches import Patch

    xs = list(range(len(points)))
    before = [p.absmax for p in points]
    after = [p.absmax_after for p in points]
    has_after = any(v is not None for v in after)
    observed = _finite_positive(before + after) or [1.0]
    top = max(max(observed), max(lim.value for lim in limits))
    # Room below the smallest magnitude (or limit) for the remedy marks, above the largest for non-finite.
    floor = min(min(observed), min(lim.value for lim in limits)) / 100
    ceiling = top * 10
    fig, (ax,) = _figure(4.6)
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, ceiling * 3)
    for start, end in _runs(p for m in marks for p in m.positions if m.kind == "pin_fp32"):
        ax.axvspan(start - 0.5, end + 0.5, color=REMEDY_COLOR["pin_fp32"], alpha=0.12, linewidth=0)
    for lim in limits:
        color, style = LIMIT_STYLE.get(lim.role, ("#555555", ":"))
        ax.axhline(lim.value, color=color, linestyle=style, linewidth=1.2)
        # Headroom sits just under max on a log axis: its label goes below its line.
        ax.text(0.005, lim.value, lim.label, transform=ax.get_yaxis_transform(), color=color,
                fontsize=8, va="top" if lim.role in ("headroom", "min_normal") else "bottom", ha="left",
                zorder=7,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
    # A stats object names the node, not its op: say which, never "(input)" for a computed tensor.
    titles = [f"#{i} {p.tensor} ({p.op_type or (f'node {p.node}' if p.node else 'graph input')}): "
              + ("mask (-inf on purpose); " if p.mask else "")
              + f"abs-max {number(p.absmax) or '-'}"
              + (f" before, {number(p.absmax_after) or '-'} after" if has_after else "")
              for i, p in enumerate(points)]
    masks = [p.mask for p in points]
    if has_after:
        _plot_magnitudes(ax, xs, before, floor, ceiling, label="abs-max before", masks=masks, **BEFORE)
        _plot_magnitudes(ax, xs, after, floor, ceiling, label="abs-max after", masks=masks, **AFTER)
        hover = _hover(ax, "after", xs, after, floor, ceiling, titles)
    else:
        _plot_magnitudes(ax, xs, before, floor, ceiling, label="abs-max", color=AFTER["color"],
                         masks=masks)
        hover = {}
    _plot_masks(ax, xs, after if has_after else before, masks, floor, ceiling)
    hover |= _hover(ax, "before", xs, before, floor, ceiling, titles)
    kinds = sorted({m.kind for m in marks})
    rug = ax.get_xaxis_transform()
    # A label needs about 1/40 of the axis: a mark nearer the last labelled one keeps its hover only.
    gap, last, labelled = max(len(points) / 40, 1.0), -math.inf, set()
    for i in sorted(range(len(marks)), key=lambda k: marks[k].positions[0]):
        if marks[i].positions[0] - last >= gap:
            labelled.add(i)
            last = marks[i].positions[0]
    for i, m in enumerate(marks):
        color = REMEDY_COLOR.get(m.kind, "#555555")
        # One row per remedy kind along the bottom, so marks at one tensor stay apart. One
        # triangle per action, where it starts; a line spans the other tensors it touches.
        height = 0.03 + 0.05 * (kinds.index(m.kind))
        if len(m.positions) > 1:
            ax.plot([m.positions[0], m.positions[-1]], [height, height], color=color, linewidth=2,
                    alpha=0.6, zorder=5, transform=rug, solid_capstyle="butt")
        triangle = ax.scatter([m.positions[0]], [height], marker="^", s=60, color=color, zorder=6,
                              transform=rug)
        gid = f"remedy-{i}"
        triangle.set_gid(gid)
        hover[gid] = f"{m.kind}: {m.label} ({len(m.positions)} tensors)"
        if len(marks) <= 12 and i in labelled:
            ax.annotate(f"{m.kind}: {m.label}", (m.positions[0], height), xycoords=rug,
                        xytext=(5, 4), textcoords="offset points", rotation=90, fontsize=7,
                        color=color, va="bottom")
    handles, labels = ax.get_legend_handles_labels()
    for kind in kinds:
        handles.append(Patch(color=REMEDY_COLOR.get(kind, "#555555"), label=f"remedy: {kind}"))
        labels.append(f"remedy: {kind}")
    ax.legend(handles, labels, **LEGEND)
    ax.set_ylabel("abs-max (log)")
    ax.grid(True, which="major", axis="y", alpha=0.3)
    _tensor_axis(ax, [p.tensor for p in points], ordered)
    return _to_svg(fig, "headroom", hover)


def error_svg(series: ErrorSeries) -> str:
    """Relative L2 and max abs error per tensor, accumulated and isolated, first divergence marked."""
    pts = series.points
    xs = list(range(len(pts)))
    fig, (ax_rel, ax_abs) = _figure(5.6, rows=2)
    panels = (
        (ax_rel, "relative L2", [p.rel_l2 for p in pts], [p.isolated_rel_l2 for p in pts]),
        (ax_abs, "max abs error", [p.max_abs for p in pts], [p.isolated_max_abs for p in pts]),
    )
    thresholds = {"relative L2": ("rtol", series.rtol), "max abs error": ("atol", series.atol)}
    hover: dict[str, str] = {}
    for ax, name, accumulated, isolated in panels:
        word, threshold = thresholds[name]
        observed = _finite_positive(accumulated + isolated + [threshold]) or [1.0]
        floor, ceiling = min(observed) / 10, max(observed) * 10
        ax.set_yscale("log")
        ax.set_ylim(floor / 2, ceiling * 3)
        masks = [p.mask for p in pts]
        _plot_magnitudes(ax, xs, accumulated, floor, ceiling, label=f"{name} (accumulated)",
                         color="#2471a3", masks=masks)
        if any(v is not None for v in isolated):
            _plot_magnitudes(ax, xs, isolated, floor, ceiling, label=f"{name} (isolated)",
                             color="#e67e22", marker="s", linestyle="--", hollow=True, masks=masks)
        # A mask has no error to show (its reference is -inf): it sits on the ceiling as a mask.
        _plot_masks(ax, xs, [None] * len(pts), masks, floor, ceiling)
        if threshold is not None and threshold > 0:
            # A tensor fails only above both lines (rel L2 > rtol and max abs > atol).
            ax.axhline(threshold, color="#c0392b", linestyle=":", linewidth=1.2,
                       label=f"{word} {threshold:g} (fails above both)")
        titles = [f"#{i} {p.tensor} ({p.op_type}): {name} {number(a) or '-'}"
                  + (f", isolated {number(b)}" if b is not None else "")
                  + ("" if p.passed is None else ", mask (-inf on purpose), ok" if p.mask
                     else ", ok" if p.passed else ", FAILED")
                  for i, (p, a, b) in enumerate(zip(pts, accumulated, isolated, strict=True))]
        hover |= _hover(ax, name.split()[0], xs, accumulated, floor, ceiling, titles)
        failed = [x for x, p in zip(xs, pts, strict=True) if p.passed is False]
        if failed:
            ys = [max(min(v, ceiling), floor) if v is not None else floor
                  for v in (accumulated[x] for x in failed)]
            ax.scatter(failed, ys, facecolors="none", edgecolors="#c0392b", s=60, zorder=5,
                       label="failed")
        if series.first_divergent is not None:
            ax.axvline(series.first_divergent, color="#c0392b", linestyle="--", linewidth=1.2)
        ax.set_ylabel(name)
        ax.grid(True, which="major", axis="y", alpha=0.3)
        ax.legend(**LEGEND)
    if series.first_divergent is not None:
        ax_rel.annotate(f"first divergent: {series.first_divergent_label}",
                        (series.first_divergent, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(4, -12), textcoords="offset points", color="#c0392b", fontsize=8,
                        zorder=7, bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8,
                                        "pad": 1})
    _tensor_axis(ax_abs, [p.tensor for p in pts])
    return _to_svg(fig, "error", hover)


def _speedup_svg(formats: Sequence[dict[str, Any]]) -> str:
    rows = [r for r in formats if r.get("speedup_vs_fp32") or r.get("speedup_range")]
    fig, (ax,) = _figure(0.5 + 0.45 * max(len(rows), 1))
    ends = [(r["speedup_vs_fp32"],) * 2 if r.get("speedup_vs_fp32") else tuple(r["speedup_range"])
            for r in rows]
    # A known speed-up is a thin bar at its value; a range spans its two ends.
    ax.barh([r["format"] for r in rows], [max(hi - lo, 0.02 * hi) for lo, hi in ends],
            left=[lo for lo, _ in ends], color="#2471a3")
    for y, (lo, hi) in enumerate(ends):
        ax.annotate(f" {lo:.2g}x" if lo == hi else f" {lo:.2g}x to {hi:.2g}x", (hi, y), va="center",
                    fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up over FP32 (a range where the target publishes no peak or bandwidth)")
    ax.set_xlim(0, max([hi for _, hi in ends] or [1.0]) * 1.35)
    return _to_svg(fig, "ledger")


def ledger_svg(formats: Sequence[dict[str, Any]]) -> str:
    """Estimated time per format (the ledger's `formats` rows): compute- and memory-bound parts;
    where a row's time is unknown, every row's speed-up over FP32 (its range, where that is all
    the known figures give)."""
    if any(r.get("estimated_ms") is None for r in formats):
        return _speedup_svg(formats)
    rows = [r for r in formats if r.get("estimated_ms") is not None]
    fig, (ax,) = _figure(0.5 + 0.45 * max(len(rows), 1))
    labels = [r["format"] for r in rows]
    totals = [r["estimated_ms"] for r in rows]
    memory = [t * (r.get("memory_bound_share") or 0.0) for t, r in zip(totals, rows, strict=True)]
    compute = [t - m for t, m in zip(totals, memory, strict=True)]
    ax.barh(labels, memory, color="#2471a3", label="memory-bound")
    ax.barh(labels, compute, left=memory, color="#e67e22", label="compute-bound")
    for y, (t, r) in enumerate(zip(totals, rows, strict=True)):
        speed = r.get("speedup_vs_fp32")
        ax.annotate(f" {number(t)} ms" + (f" ({speed:.2g}x vs FP32)" if speed else ""), (t, y),
                    va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("estimated ms (roofline from published peaks)")
    ax.set_xlim(0, max(totals or [1.0]) * 1.35)
    ax.legend(**LEGEND)
    return _to_svg(fig, "ledger")
