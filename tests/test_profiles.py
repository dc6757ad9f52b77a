"""Target profiles: built-ins load with their facts and sources; malformed files fail in one line."""

from pathlib import Path

import pytest
import yaml

from npuprep.errors import NpuprepError
from npuprep.numerics import Int8Activations, get_format
from npuprep.profiles import OverflowMode, Pinning, Severity, builtin_names, load_profile

GOOD = """\
name: myboard
description: a user's board
dtypes:
  fast: [fp16, int8]
  supported: [fp32]
  unsupported: [bf16]
default_precision: fp16
overflow: saturate
fp32_pinning: per_node
keeps_fp32_ops: [Softmax]
headroom: 0.25
severity:
  hazard: error
sources:
  overflow: measured with npuprep probe
"""


def test_builtins_load_with_the_design_facts():
    assert {"generic", "orin", "a2000"} <= set(builtin_names())
    a2000, orin, generic = load_profile("a2000"), load_profile("orin"), load_profile("generic")
    assert "bf16" in a2000.unsupported_dtypes and a2000.overflow is OverflowMode.UNKNOWN
    assert a2000.fp32_pinning is Pinning.COMPILER_DECIDES
    assert "bf16" in orin.slow_dtypes and "fp8_e4m3" in orin.unsupported_dtypes
    assert orin.overflow is OverflowMode.INF and not orin.resolve().saturate
    # TensorRT takes symmetric INT8 only; unknown elsewhere (zero points where barely negative).
    assert orin.int8_activations is Int8Activations.SYMMETRIC and "int8_activations" in orin.sources
    assert a2000.int8_activations is generic.int8_activations is Int8Activations.UNKNOWN
    assert load_profile("rk3588").int8_activations is Int8Activations.ASYMMETRIC
    assert all("fp64" in p.unsupported_dtypes for p in (a2000, orin, generic))
    for p in (a2000, orin, generic):
        assert p.resolve().fmt is get_format("fp16")
        assert p.resolve().limit == p.headroom * get_format("fp16").max
        assert p.sources and all(isinstance(v, str) and v for v in p.sources.values())


def test_user_profile_from_path(tmp_path: Path):
    path = tmp_path / "myboard.yaml"
    path.write_text(GOOD)
    p = load_profile(str(path))
    assert p.name == "myboard" and p.resolve().saturate and p.headroom == 0.25
    assert p.resolve().limit == 0.25 * 65504
    assert p.severity["hazard"] is Severity.ERROR and p.keeps_fp32_ops == ("Softmax",)
    assert load_profile(path).to_dict()["dtypes"]["unsupported"] == ["bf16"]
    path.write_text(GOOD + "int8_activations: asymmetric\n")
    assert load_profile(path).int8_activations is Int8Activations.ASYMMETRIC
    assert load_profile(path).to_dict()["int8_activations"] == "asymmetric"


@pytest.mark.parametrize(("text", "expected"), [
    (GOOD.replace("overflow: saturate", "overflow: [saturate"), "YAML syntax error"),
    (GOOD + "colour: red\n", "key 'colour': unknown key"),
    (GOOD.replace("headroom: 0.25", "headroom: lots"), "key 'headroom': expected a number"),
    (GOOD.replace("fast: [fp16, int8]", "fast: fp16"), "key 'dtypes.fast': expected a list"),
    (GOOD.replace("fast: [fp16, int8]", "fast: [fp16, fp12]"), "key 'dtypes.fast[1]': 'fp12' is not one of"),
    (GOOD.replace("overflow: saturate\n", ""), "key 'overflow': required key is missing"),
    (GOOD.replace("  hazard: error", "  hazard: fatal"), "key 'severity.hazard'"),
    (GOOD + "int8_activations: signed\n", "key 'int8_activations'"),
    (GOOD.replace("  overflow: measured", "  overflow: 3\n  x: measured"), "key 'sources.overflow'"),
])
def test_malformed_profile_is_one_line_naming_file_and_key(tmp_path: Path, text: str, expected: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(NpuprepError) as info:
        load_profile(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and expected in message


def test_unknown_target_name_lists_the_builtins():
    with pytest.raises(NpuprepError, match="generic"):
        load_profile("no_such_board")


def test_rk3588_profile_cannot_pin_and_wants_fixed_sizes():
    profile = load_profile("rk3588")
    assert str(profile.fp32_pinning) == "none"
    assert str(profile.overflow) == "inf"
    assert (profile.input_shapes, profile.input_layout) == ("fixed", "nchw")
    assert profile.report_format == "rknn"
    assert profile.to_dict()["inputs"] == {"shapes": "fixed", "layout": "nchw"}


def test_profile_inputs_key_is_validated(tmp_path):
    data = load_profile("generic").to_dict()
    data["inputs"] = {"shapes": "sometimes"}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(NpuprepError, match=r"inputs\.shapes"):
        load_profile(path)
