"""`input.dynamic_shape`: symbolic input dims on a target that builds for fixed sizes only."""

from __future__ import annotations

from npuprep.analyse import static_findings
from npuprep.model_io import Model, fingerprint
from npuprep.profiles import load_profile
from tests.conftest import model_from_text

# images[batch,3,h,w] -> Relu -> y ; k[1,4] -> Relu -> z
TEXT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[batch,3,h,w] images, float[1,4] k) => (float[batch,3,h,w] y, float[1,4] z) {
  y = Relu(images)
  z = Relu(k)
}
"""


def _rules(target: str) -> list[tuple[str, str]]:
    proto = model_from_text(TEXT)
    found = static_findings(Model(proto, "m.onnx", fingerprint(proto)), load_profile(target).resolve())
    return [(f.rule, f.node) for f in found if f.rule.startswith("input.")]


def test_fixed_size_target_flags_the_symbolic_input_only():
    assert _rules("rk3588") == [("input.dynamic_shape", "images")]


def test_targets_with_dynamic_shapes_say_nothing():
    assert _rules("generic") == []
