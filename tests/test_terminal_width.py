"""Every command's default terminal output fits 100 columns, long names included; --wide does not cut."""

from __future__ import annotations

import math

import onnx
import pytest
from conftest import run_cli
from test_crosscheck_readers import FIXTURES, norm_model

from npuprep.examples import example_data_dir, example_model_path
from npuprep.formatting import number, percent, ratio, shorten, table_lines

PREFIX = "/encoder/layer.11/attention/self/a_module_name_as_long_as_exporters_make_them/"


def _long_names(tmp_path):
    """The bundled example with every node and inner tensor renamed to a 100+ character name."""
    model = onnx.load(str(example_model_path()))
    keep = {v.name for v in [*model.graph.input, *model.graph.output]}
    inner = {o for n in model.graph.node for o in n.output if o not in keep}
    rename = {t: PREFIX + t for t in inner}
    for n in model.graph.node:
        n.name = PREFIX + (n.name or n.op_type)
        n.input[:] = [rename.get(i, i) for i in n.input]
        n.output[:] = [rename.get(o, o) for o in n.output]
    for vi in model.graph.value_info:
        vi.name = rename.get(vi.name, vi.name)
    path = tmp_path / "long.onnx"
    onnx.save(model, str(path))
    return path


def _widest(stdout: str) -> int:
    return max((len(line) for line in stdout.splitlines()), default=0)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return _long_names(tmp_path_factory.mktemp("long"))


@pytest.mark.parametrize("command", ["check", "calibrate", "convert", "compare", "probe", "checklist"])
def test_default_output_fits_100_columns(command, long_model, tmp_path):
    data = ("--data", example_data_dir())
    args = {
        "check": ("check", long_model, "-t", "a2000", *data),
        "calibrate": ("calibrate", long_model, *data),
        "convert": ("convert", long_model, "-t", "a2000", *data, "-o", tmp_path / "out.onnx"),
        "compare": ("compare", long_model, "--emulate", "-t", "a2000", *data, "--isolate"),
        "probe": ("probe", long_model, "-t", "a2000", "--micro"),
        "checklist": ("checklist", long_model, "-t", "a2000"),
    }[command]
    r = run_cli(*args)
    assert r.returncode in (0, 1), r.stderr
    assert "…" in r.stdout or command in ("checklist", "probe")  # long names were shortened
    assert _widest(r.stdout) <= 100, max(r.stdout.splitlines(), key=len)


def test_targets_fit_100_columns():
    for args in (("targets",), ("targets", "a2000"), ("targets", "orin")):
        r = run_cli(*args)
        assert r.returncode == 0 and _widest(r.stdout) <= 100, max(r.stdout.splitlines(), key=len)


def test_crosscheck_counts_missing_rows_and_fits(tmp_path, save):
    model = save(norm_model())
    r = run_cli("crosscheck", model, "--report", FIXTURES / "generic.csv", "--target", "orin")
    assert r.returncode == 1 and _widest(r.stdout) <= 100
    assert "1 unmapped" in r.stdout and "vendor_inserted_cast" not in r.stdout
    everything = run_cli("crosscheck", model, "--report", FIXTURES / "generic.csv", "--target", "orin",
                         "--show-all")
    assert "vendor_inserted_cast" in everything.stdout


def test_wide_keeps_whole_names_and_quiet_keeps_the_verdict(long_model):
    r = run_cli("check", long_model, "-t", "a2000", "--wide")
    assert _widest(r.stdout) > 100 and PREFIX + "offset_sq" in r.stdout
    q = run_cli("check", long_model, "-t", "a2000", "-q")
    assert q.stdout.strip().splitlines()[-1].endswith("(--fail-on error)") and len(q.stdout.splitlines()) == 1


def test_names_shorten_in_the_middle_and_numbers_read_as_numbers():
    name = "encoder.layer.11.attention.self.query.MatMul_output_0"
    short = shorten(name, 20)
    assert len(short) == 20 and short.startswith("encoder.la") and short.endswith("_output_0") and "…" in short
    assert shorten("abc", 20) == "abc"
    assert [number(v) for v in (6.06e14, 3.97e17, 6.1e-5, 65504.0, 0.009845, math.inf, math.nan, 0)] == \
        ["6.06e14", "3.97e17", "6.1e-5", "65504", "0.009845", "inf", "nan", "0"]
    assert ratio(9.74) == "9.7x" and ratio(3.97e17) == "3.97e17x" and ratio(math.inf) == "inf"
    assert percent(0.5) == "50%" and percent(6.06e12) == "6.06e12x" and percent(math.inf) == "inf"
    lines = table_lines("t", ["name", "value"], [("x" * 300, 1.5), ("short", 6.06e14)])
    assert max(map(len, lines)) <= 100 and lines[-1].split() == ["short", "6.06e14"]


def test_a_name_with_text_keeps_its_end_and_the_text_and_sentences_wrap():
    layer = "/m/encoder/layer.{}/attention/self/Softmax"
    # A list of names gives its last names to the count; the name keeps the part that differs.
    rows = [(f"{layer.format(3)}, {layer.format(4)} (+10)",), (f"{layer.format(11)} (x2^1)",),
            ("/m/short",)]
    first, second, third = (line.rstrip() for line in table_lines("t", ["node"], rows, width=28)[3:])
    assert first.startswith("…layer.3/") and first.endswith(" (+11)") and len(first) <= 28
    assert second.startswith("…layer.11/") and second.endswith(" (x2^1)") and len(second) <= 28
    assert third == "/m/short"
    why = "the softmax input is shifted in FP32: its fp16 rounding would be a relative error of exp"
    lines = table_lines("t", ["#", "why"], [(1, why), (2, "short")], width=40, wrap=("why",))
    assert max(map(len, lines)) <= 40 and "…" not in "".join(lines)
    body = lines[3:]
    assert body[0].startswith("1  the softmax") and body[-1].split() == ["2", "short"]
    assert " ".join(" ".join(line.split()[1 if i == 0 else 0:]) for i, line in enumerate(body[:-1])) == why


class _Row:
    """The fields of a TensorCompareResult that compare's verdict column reads."""

    def __init__(self, passed, reason="", rel_l2=0.0, rtol=0.01, saturated_count=0, tensor="t"):
        self.passed, self.reason, self.rel_l2, self.rtol = passed, reason, rel_l2, rtol
        self.saturated_count, self.tensor = saturated_count, tensor

    def __bool__(self):
        return self.passed


def test_compare_rows_say_why_they_are_ok_or_failed():
    from npuprep.cli.compare import verdict_code

    assert verdict_code(_Row(True)) == "ok"
    assert verdict_code(_Row(True, rel_l2=0.47)) == "ok:<atol"
    assert verdict_code(_Row(True, "the reference holds non-finite values; error metrics undefined",
                             rel_l2=math.nan)) == "ok:ref-nan"
    assert verdict_code(_Row(True, "the reference holds non-finite values; error metrics undefined",
                             rel_l2=math.nan, tensor="m"), frozenset({"m"})) == "ok:mask"
    assert verdict_code(_Row(False, "3 Inf and 0 NaN values where the reference is finite")) == "FAIL:inf/nan"
    assert verdict_code(_Row(False, "4 values pinned at +-65504", saturated_count=4)) == "FAIL:saturated"
    assert verdict_code(_Row(False, "rel L2 0.5 > 0.01 and max abs error 3 > 0.001")) == "FAIL:rtol+atol"
