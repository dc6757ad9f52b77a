"""The HTML renderer on small result dicts: self-contained, sortable tables, limits and the first
divergent node drawn, remedies marked, byte-identical output, tables-only without matplotlib."""

from __future__ import annotations

import builtins
import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli

from npuprep.errors import NpuprepError
from npuprep.report.render_html import render, write_html
from npuprep.report.series import compare_entry, error_series, limits, remedy_marks, tensor_points

# Chain of five tensors: x -> Conv(c) -> Mul(c, c)(sq) -> ReduceSum(s) -> Exp(e) -> Div(y).
CHAIN = [("c", "conv", "Conv", 120.0, 120.0, 1e-6), ("sq", "square", "Mul", 1.4e4, 875.0, 2e-5),
         ("s", "sum", "ReduceSum", 9.0e5, 56250.0, 3e-4), ("e", "exp", "Exp", 3.0e4, 200.0, 0.15),
         ("y", "div", "Div", 0.8, 0.8, 0.015)]
PROFILE = {"name": "generic", "default_precision": "fp16", "headroom": 0.5,
           "dtypes": {"fast": ["fp16"], "unsupported": []}}


def compare_result(first: str | None = "e", fmt: str = "fp16") -> dict[str, Any]:
    """A compare result in the shape npuprep.verify.compare writes."""
    tensors = [{"tensor": t, "node": n, "op_type": o, "order": i, "max_abs_error": rel * 10,
                "rel_l2": rel, "cosine": 1 - rel, "cand_absmax": after, "ref_absmax": after,
                "limit": 65504.0, "headroom": 65504.0 / after, "inf_count": 0, "nan_count": 0,
                "saturated_count": 0, "passed": t != first,
                "isolated": {"max_abs_error": rel, "rel_l2": rel / 10}}
               for i, (t, n, o, _, after, rel) in enumerate(CHAIN)]
    first_entry = next((t for t in tensors if t["tensor"] == first), None)
    return {"schema_version": 1, "kind": "compare", "fingerprint": "f00d", "format": fmt,
            "passed": first is None, "first_divergent": first_entry, "worst": tensors[:2],
            "tensors": tensors, "notes": ["emulation cannot show FP16 accumulation inside one op"]}


def convert_result() -> dict[str, Any]:
    """A convert result in the shape npuprep.convert.ConversionResult.to_dict writes."""
    return {
        "schema_version": 1, "kind": "convert", "fingerprint": "f00d", "model": "m.onnx",
        "output_fingerprint": "beef", "output": "m16.onnx", "target": "generic",
        "profile": PROFILE, "precision": "fp16", "passed": False, "rounds": 2,
        "samples": {"description": "2 samples", "synthetic": False},
        "pinned_nodes": ["exp"], "forced_fp32": {"shape_of": "shape computation"},
        "verification": {"passed": False, "rtol": 0.01, "samples": 2,
                         "outputs": {"y": {"nonfinite": 0, "max_abs_error": 0.15, "rel_l2": 0.015}}},
        "holdout": None,
        "tensors": [{"tensor": t, "node": n, "op_type": o, "absmax_before": b, "absmax_after": a,
                     "headroom_before": 65504.0 / b, "headroom_after": 65504.0 / a, "scale": 1.0}
                    for t, n, o, b, a, _ in CHAIN],
        "actions": [{"action": "rescale", "entry": "square", "k": 4, "domain": {"sq": 1, "s": 1},
                     "absmax": 9.0e5, "limit": 32752.0, "absmax_after": 56250.0,
                     "findings": [{"rule": "range.overflow", "tensor": "s"}], "why": "s overflows"},
                    {"action": "pin_fp32", "nodes": ["exp"], "exit_tensors": ["e"], "why": "exp"},
                    {"action": "clamp", "tensor": "c", "lo": -100.0, "hi": 100.0, "kind": "user",
                     "why": "declared bound"}],
        "declined": [{"remedy": "rescale", "target": "exp", "reason": "Exp does not commute"}],
        "findings": [
            {"rule": "hazard.exp", "severity": "warning", "node": "exp", "op_type": "Exp",
             "tensor": "e", "message": "exp overflows above 11.09", "remedy": "pin_fp32"},
            {"rule": "range.overflow", "severity": "error", "node": "sum", "op_type": "ReduceSum",
             "tensor": "s", "message": "9e5 > 65504", "evidence": {"absmax": 9.0e5},
             "remedy": "rescale"},
        ],
        "compare": compare_result(), "flops_fp32_share": 0.01, "cast_count": 2,
        "tensor_scales": {"sq": 0.0625, "s": 0.0625},
    }


def svgs(page: str) -> list[str]:
    return re.findall(r"<svg.*?</svg>", page, flags=re.S)


def test_page_is_self_contained() -> None:
    page = render(convert_result())
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page)
    assert not re.search(r"<link\b|@import|url\(\s*['\"]?https?:", page)
    assert "<?xml" not in page and "<!DOCTYPE svg" not in page
    assert len(svgs(page)) == 2
    # Two inline charts share one id space: ids stay unique and every reference resolves.
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids))
    refs = set(re.findall(r'(?:href="|url\()#([^")]+)', page))
    assert refs and refs <= set(ids)


def test_tables_are_sortable() -> None:
    page = render(convert_result())
    for key in ("outputs", "findings", "actions", "declined", "forced", "errors", "tensors"):
        assert f'<table class="sortable" id="table-{key}">' in page
    assert '<th data-type="num" tabindex="0" scope="col">rel_l2</th>' in page
    # Severity sorts by rank, numbers by value (exact repr), not by their display text.
    assert '<td class="sev-error" data-v="2">error</td>' in page
    assert '<td class="num" data-v="900000.0">900000</td>' in page
    assert "addEventListener('click'" in page
    # Convert's verdict numbers and the scale each tensor carries after rescaling.
    assert ('<tr><td>verification</td><td>y</td><td class="num" data-v="0">0</td>'
            '<td class="num" data-v="0.15">0.15</td><td class="num" data-v="0.015">0.015</td>') in page
    assert page.count('<td class="num" data-v="0.0625">0.0625</td>') == 2


def test_limits_are_drawn() -> None:
    chart = svgs(render(convert_result()))[0]
    assert "fp16 max 65504" in chart
    assert "headroom 0.5 x fp16 max = 32752" in chart
    assert "448" not in chart
    assert "fp16 min normal 6.1e-05" in chart
    assert [(lim.role, lim.value) for lim in limits(convert_result())] == [
        ("max", 65504.0), ("min_normal", 2.0**-14), ("headroom", 32752.0)]


def test_fp8_limit_drawn_when_fp8_is_asked() -> None:
    fp8 = compare_result(fmt="fp8_e4m3")
    assert [(lim.role, lim.value) for lim in limits(fp8)] == [("max", 65504.0), ("min_normal", 2.0**-14),
                                                              ("fp8", 448.0)]
    assert "fp8_e4m3 max 448" in svgs(render(fp8))[0]


def test_first_divergent_node_is_marked() -> None:
    page = render(compare_result(first="e"))
    error_chart = svgs(page)[1]
    assert "first divergent: exp" in error_chart
    assert '<tr class="fail first-divergent"><td class="num" data-v="3">3</td><td>e</td>' in page
    series = error_series(compare_result(first="e"))
    assert series is not None and series.first_divergent == 3
    assert series.points[3].isolated_rel_l2 == pytest.approx(0.015)

    passing = render(compare_result(first=None))
    assert "first divergent:" not in svgs(passing)[1]
    assert "first-divergent" not in passing.split("<style>")[1].split("</style>")[1]
    assert 'id="verdict">PASSED' in passing


def test_remedies_marked_where_they_act() -> None:
    result = convert_result()
    points = tensor_points(result)
    assert [p.absmax_after for p in points] == [120.0, 875.0, 56250.0, 200.0, 0.8]
    marks = {m.kind: m.positions for m in remedy_marks(result, points)}
    # Rescale: the entry's output and its scale domain; pin: the island's tensors; clamp: its tensor.
    assert marks == {"rescale": (1, 2), "pin_fp32": (3,), "clamp": (0,)}
    chart = svgs(render(result))[0]
    for label in ("remedy: rescale", "remedy: pin_fp32", "remedy: clamp", "abs-max before",
                  "abs-max after"):
        assert label in chart


def test_nonfinite_tensors_sit_on_top() -> None:
    result = compare_result()
    result["tensors"][2]["inf_count"] = 3
    points = tensor_points(result)
    assert points[2].absmax == float("inf")
    assert "abs-max: non-finite" in svgs(render(result))[0]


def test_compare_entry_reads_both_spellings() -> None:
    flat = compare_entry({"tensor": "t", "max_abs": 1.0, "absmax": 5.0, "nonfinite": 2,
                          "isolated_rel_l2": 0.1, "isolated_max_abs": 0.5, "passed": False})
    nested = compare_entry({"tensor": "t", "max_abs_error": 1.0, "cand_absmax": 5.0,
                            "inf_count": 1, "nan_count": 1, "passed": False,
                            "isolated": {"rel_l2": 0.1, "max_abs_error": 0.5}})
    assert flat == nested
    assert compare_entry({"tensor": "t", "headroom": "inf"})["headroom"] == float("inf")


def test_stats_in_recorded_order_with_unobserved() -> None:
    stats = {"schema_version": 1, "kind": "stats", "fingerprint": "f00d", "samples": 4,
             "synthetic": True,
             "tensors": {"b": {"tensor": "b", "node": "n2", "index": 1, "min": -3.0, "max": 7e4,
                               "absmax": 7e4, "count": 10, "nan_count": 0, "inf_count": 0},
                         "a": {"tensor": "a", "node": "n1", "index": 0, "min": 0.0, "max": 2.0,
                               "absmax": 2.0, "count": 10, "nan_count": 0, "inf_count": 0}},
             "unobserved": {"loop_body_t": "inside a Loop body"}}
    assert [p.tensor for p in tensor_points(stats)] == ["a", "b"]
    page = render(stats)
    assert "fp16 max 65504" in svgs(page)[0]
    assert "fp16 max =" not in svgs(page)[0]  # no profile, no headroom line
    assert 'id="table-unobserved"' in page and "inside a Loop body" in page
    rows = re.findall(r'<tr><td class="num" data-v="(\d)">\d</td><td>(\w+)</td>', page)
    assert rows == [("0", "a"), ("1", "b")]


def test_output_is_deterministic(tmp_path: Path) -> None:
    result = convert_result()
    page = render(result)
    assert render(copy.deepcopy(result)) == page
    # Another process (fresh hash seed, fresh matplotlib) writes the same bytes.
    src = tmp_path / "convert.json"
    src.write_text(json.dumps(result), encoding="utf-8")
    out = tmp_path / "report.html"
    proc = run_cli("report", src, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text(encoding="utf-8") == page


def test_without_matplotlib_tables_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named '{name}'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    page = render(convert_result())
    assert "<svg" not in page
    assert "pip install npuprep[plots]" in page
    assert '<table class="sortable" id="table-findings">' in page


def test_plots_off_and_nothing_to_chart() -> None:
    page = render(convert_result(), plots=False)
    assert "<svg" not in page and "Charts were not asked for" in page
    check = {"schema_version": 1, "kind": "check", "fingerprint": "f00d", "model": "m.onnx",
             "target": "generic", "passed": True, "findings": []}
    page = render(check)
    assert "<svg" not in page and "no per-tensor ranges" in page
    assert "No findings" not in page and "<p>None.</p>" in page
    # The check result names its target without embedding the profile: loaded and said so.
    assert 'id="profile-table"' in page and "does not embed its profile" in page


def test_names_are_escaped() -> None:
    result = convert_result()
    result["findings"][0]["node"] = "<script>alert(1)</script>"
    page = render(result)
    assert "<script>alert(1)" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_unknown_kind_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(NpuprepError, match="kind 'plan' has no HTML report"):
        render({"kind": "plan"})
    with pytest.raises(NpuprepError):
        write_html({"kind": "nope"}, tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


def test_cli_errors_exit_2_and_write_nothing(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"schema_version": 1, "kind": "plan"}), encoding="utf-8")
    for src, message in ((bad, "not a valid result file (JSON line"), (plan, "kind 'plan' has no HTML report"),
                         (tmp_path / "missing.json", "result file not found")):
        proc = run_cli("report", src, "-o", out)
        assert proc.returncode == 2
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert not out.exists()
    good = tmp_path / "compare.json"
    good.write_text(json.dumps(compare_result()), encoding="utf-8")
    proc = run_cli("report", good, "-o", good)
    assert proc.returncode == 2 and "refusing to overwrite" in proc.stderr
    assert json.loads(good.read_text(encoding="utf-8"))["kind"] == "compare"


def test_report_cli_orders_stats_by_the_model(tmp_path: Path, save) -> None:
    # x -> Mul(x, x) -> sq -> Add(sq, x) -> y; the stats file is keyed by name: sq, x, y.
    path = save("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y) {
            sq = Mul(x, x)
            y = Add(sq, x)
        }
    """)
    from npuprep.model_io import load_model

    model = load_model(path)
    stats = {"schema_version": 1, "kind": "stats", "fingerprint": model.fingerprint,
             "tensors": {name: {"tensor": name, "node": node, "absmax": value}
                         for name, node, value in (("sq", "sq", 9e4), ("x", "", 300.0),
                                                   ("y", "y", 9.03e4))}}
    src = tmp_path / "stats.json"
    src.write_text(json.dumps(stats), encoding="utf-8")
    out = tmp_path / "stats.html"
    proc = run_cli("report", src, "-o", out, "--model", path, "--no-plots")
    assert proc.returncode == 0, proc.stderr
    page = out.read_text(encoding="utf-8")
    assert re.findall(r'<tr><td class="num" data-v="\d">\d</td><td>(\w+)</td>', page) == ["x", "sq", "y"]

    stats["fingerprint"] = "another"
    src.write_text(json.dumps(stats), encoding="utf-8")
    proc = run_cli("report", src, "-o", tmp_path / "other.html", "--model", path)
    assert proc.returncode == 2 and "fingerprint another" in proc.stderr
    assert not (tmp_path / "other.html").exists()


def test_number_cells_keep_their_digits() -> None:
    result = compare_result()
    result["tensors"][0]["cosine"] = 0.99999999
    result["tensors"][1]["cand_absmax"] = 39.99979019
    page = render(result, plots=False)
    assert '<td class="num" data-v="0.99999999">0.99999999</td>' in page
    assert '<td class="num" data-v="39.99979019">40</td>' in page


def test_wide_formats_are_judged_against_fp16() -> None:
    result = dict(compare_result(fmt="fp32"), profile=PROFILE)
    assert [(lim.role, lim.value) for lim in limits(result)] == [("max", 65504.0), ("min_normal", 2.0**-14),
                                                                 ("headroom", 32752.0)]


def test_actions_read_from_an_embedded_plan() -> None:
    result = convert_result()
    result["plan"] = {"actions": result.pop("actions"), "declined": result.pop("declined"),
                      "notes": ["headroom warning on s kept as a note"]}
    assert {m.kind for m in remedy_marks(result, tensor_points(result))} == {"rescale", "pin_fp32", "clamp"}
    page = render(result, plots=False)
    assert 'id="table-actions"' in page and 'id="table-declined"' in page
    assert "headroom warning on s kept as a note" in page


def test_objects_and_numpy_values_render_like_their_json() -> None:
    import numpy as np

    from npuprep.analyse.finding import Finding, Findings
    from npuprep.cli.common import dump_json
    from npuprep.profiles import Severity

    finding = Finding("range.overflow", Severity.ERROR, "sum", "ReduceSum", "9e5 > 65504",
                      tensor="s", evidence={"limit": 32752.0, "absmax": np.float32(9e5)})
    result = {"kind": "check", "schema_version": 1, "fingerprint": "f00d", "profile": PROFILE,
              "findings": Findings((finding,)),
              "stats": {"tensors": {"s": {"tensor": "s", "absmax": np.float32(9e5),
                                          "min": float("nan"), "count": np.int64(4)}}}}
    page = render(result, plots=False)
    assert page == render(json.loads(dump_json(result)), plots=False)
    assert "absmax=9e+05, limit=3.275e+04" in page  # evidence keys in JSON (sorted) order
    assert '<td class="num" data-v="900000.0">900000</td>' in page
    assert '<td class="sev-error" data-v="2">error</td>' in page


def test_a_failed_conversion_shows_its_verdict_sentence_and_a_pass_only_its_badge() -> None:
    # report.json's verdict -> the sentence under the FAILED badge (escaped); PASSED: none
    failed = convert_result()
    failed["verdict"] = {"passed": False, "gate": "outputs", "reason": "first divergent node 'e'",
                         "cause": "underflow: output <y> lives at |x| <= 1e-9",
                         "said": "FAILED: underflow: output <y> lives at |x| <= 1e-9; "
                                 "then first divergent node 'e'"}
    page = render(failed, plots=False)
    (said,) = re.findall(r'<p class="verdict-said" id="verdict-said">(.*?)</p>', page)
    assert said == ("underflow: output &lt;y&gt; lives at |x| &lt;= 1e-9; then first divergent "
                    "node &#x27;e&#x27;")
    # a failure with no cause known: the gate's reason alone
    failed["verdict"] |= {"cause": "", "said": "FAILED: first divergent node 'e'"}
    assert "node &#x27;e&#x27;</p>" in render(failed, plots=False)
    passed = convert_result() | {"passed": True, "verdict": {"passed": True, "said": "PASSED"}}
    assert 'id="verdict-said"' not in render(passed, plots=False)


def test_a_convert_page_tables_its_time_by_stage_and_a_result_without_it_has_none() -> None:
    result = convert_result()
    assert 'id="stages"' not in render(result, plots=False)
    result["resources"] = {"wall_s": 4.0, "cpu_s": 6.5, "peak_rss_mb": 200,
                           "stage_seconds": {"calibrating": {"wall_s": 1.0, "cpu_s": 1.5},
                                             "balancing": {"wall_s": 3.0, "cpu_s": 5.0}}}
    page = render(result, plots=False)
    assert "Time by stage (2)" in page
    rows = re.findall(r"<tr[^>]*><td[^>]*>(calibrating|balancing)</td>(.*?)</tr>", page, flags=re.S)
    cells = {name: re.findall(r'data-v="([^"]+)"', rest) for name, rest in rows}
    assert cells == {"calibrating": ["1.0", "1.5", "25.0"], "balancing": ["3.0", "5.0", "75.0"]}
