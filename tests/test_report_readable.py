"""The HTML report for people: hover labels, thresholds drawn, before/after apart, every row shown,
findings by severity; `npuprep report` reads every command's --json."""

from __future__ import annotations

import json
import re

from conftest import run_cli
from test_crosscheck_readers import FIXTURES, norm_model
from test_report_render import compare_result, convert_result, svgs

from npuprep.report.render_html import render


def _titles(svg: str) -> list[str]:
    return re.findall(r"<title>(.*?)</title>", svg)


def test_points_have_hover_labels_with_tensor_and_value():
    headroom, error = svgs(render(convert_result()))
    # "s" (ReduceSum) had abs-max 9e5 before its rescale and 56250 after.
    assert "#2 s (ReduceSum): abs-max 900000 before, 56250 after" in _titles(headroom)
    assert any(t.startswith("#3 e (Exp): relative L2 0.15") and t.endswith("FAILED") for t in _titles(error))
    # One label per plotted point: before and after on the headroom chart, two panels on the error
    # chart; and one per remedy marker, one marker per action.
    points = [t for t in _titles(headroom) if t.startswith("#")]
    assert len(points) == 10 and len(_titles(error)) == 10
    assert [t for t in _titles(headroom) if not t.startswith("#")] == [
        "rescale: square (2 tensors)", "pin_fp32: exp (1 tensors)", "clamp: c (1 tensors)"]


def test_thresholds_and_min_normal_are_drawn_and_before_after_differ():
    page = render(dict(convert_result(), compare=dict(compare_result(), thresholds={"rtol": 0.01, "atol": 0.001})))
    headroom, error = svgs(page)
    assert "rtol 0.01 (fails above both)" in error and "atol 0.001" in error
    assert "fp16 min normal 6.1e-05" in headroom
    # Before: dashed with open markers; after: solid. The two line paths carry different dash styles.
    lines = re.findall(r'<g id="headroom-line2d_\d+">\s*<path d="[^"]*" clip-path="[^"]*" style="([^"]*)"', headroom)
    styles = {("dasharray" in st, "#7f8c8d" in st, "#2471a3" in st) for st in lines}
    assert (True, True, False) in styles and (False, False, True) in styles


def test_tables_show_every_row_and_findings_read_by_severity():
    result = convert_result()
    result["findings"] = result["findings"] + [
        {"rule": "init.underflow", "severity": "info", "node": "conv", "tensor": "c", "message": "tiny"}]
    result["findings"].insert(0, result["findings"].pop())
    page = render(result)
    assert "max-height" not in page
    body = page[page.index('id="table-findings"'):]
    order = [m for m in re.findall(r'class="sev-(\w+)"', body)[:3]]
    assert order == ["error", "warning", "info"]


def test_report_accepts_crosscheck_and_probe_json(tmp_path, save):
    model = save(norm_model())
    cc = run_cli("crosscheck", model, "--report", FIXTURES / "generic.csv", "--target", "orin", "--json")
    (tmp_path / "cc.json").write_text(cc.stdout)
    r = run_cli("report", tmp_path / "cc.json", "-o", tmp_path / "cc.html")
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "cc.html").read_text()
    assert 'id="table-verdicts"' in page and "/norm/Sqrt" in page and "FAILED" in page
    # Failing verdicts come first.
    assert page.index("<td>mismatch</td>") < page.index("<td>ok</td>")
    pr = run_cli("probe", "--target", "generic", "--probes", "exp,add", "--json")
    (tmp_path / "p.json").write_text(pr.stdout)
    r = run_cli("report", tmp_path / "p.json", "-o", tmp_path / "p.html")
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "p.html").read_text()
    assert 'id="table-probes"' in page and "<td>exp</td>" in page and "declared (emulated)" in page
    assert json.loads(pr.stdout)["basis"] == "declared (emulated)"


def test_report_of_check_with_data_has_the_chart(tmp_path):
    from npuprep.examples import example_data_dir, example_model_path

    r = run_cli("check", example_model_path(), "-t", "a2000", "--data", example_data_dir(), "--json")
    (tmp_path / "c.json").write_text(r.stdout)
    assert "stats" in json.loads(r.stdout)
    done = run_cli("report", tmp_path / "c.json", "-o", tmp_path / "c.html")
    assert done.returncode == 0, done.stderr
    assert 'id="headroom-chart"' in (tmp_path / "c.html").read_text()
