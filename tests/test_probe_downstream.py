"""`npuprep probe MODEL` where the amplified layer stays in range at its largest gain and a node
after it overflows (issue 28): the table, the layer line and the overall verdict (terminal and
JSON) tell one story, never `no-overflow` beside "first shows ... inf"."""

from __future__ import annotations

import json

from conftest import run_cli

# x -> MatMul(w, |w| <= 0.1) -> m -> Mul(1000) -> y: at the largest gain the weights allow
# (0.5 * 65504 / 0.1) m stays below 65504 for inputs in [0, 1); y passes it.
DOWNSTREAM = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4] x) => (float[1,4] y)
<float[4,4] w = {0.1,0.01,0.01,0.01,0.01,0.1,0.01,0.01,0.01,0.01,0.1,0.01,0.01,0.01,0.01,0.1},
 float k = {1000.0}> {
  m = MatMul(x, w)
  y = Mul(m, k)
}"""


def test_an_overflow_after_the_layer_is_the_probe_s_verdict(save):
    model = save(DOWNSTREAM)
    text = run_cli("probe", model, "-t", "generic")
    doc = json.loads(run_cli("probe", model, "-t", "generic", "--json").stdout)
    assert text.returncode == 0, text.stderr
    said = " ".join(text.stdout.split())
    assert "no-overflow" not in said and "in range" in said
    assert "its own output stays in range" in said and "shows downstream at tensor 'y'" in said
    assert doc["layer"]["verdict"] == "no-overflow" and doc["layer"]["first_shows"]["tensor"] == "y"
    assert doc["overall"]["verdict"] == doc["layer"]["first_shows"]["verdict"] == "inf"
    assert said.endswith("overall: inf (every probe that overflowed gave inf; declared (emulated))")
