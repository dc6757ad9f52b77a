"""An epsilon FP16 cannot hold (1e-12 is 0 there) guarding a division of a zero variance.

A LayerNorm written out by hand over a padded row: x - mean is 0, its variance 0, and the
epsilon that keeps the division finite in FP32 is 0 in FP16; Div(0, Sqrt(0)) is NaN. The NaN
shows at the Div, but pinning the Div alone divides the same lost zeros: verification reaches
back up its inputs to where the epsilon is added, and the conversion passes.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper, parser

from npuprep.runtime.session import make_session, run
from tests.conftest import run_cli

# x -> ReduceMean -> m; x - m -> d; d*d -> ReduceMean -> v; Add(v, 1e-12) -> Sqrt -> s;
# d / s -> n -> MatMul(w) -> y
MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 6, 16] x) => (float[2, 6, 256] y) {
    m = ReduceMean <axes = [-1]> (x)
    d = Sub (x, m)
    d2 = Mul (d, d)
    v = ReduceMean <axes = [-1]> (d2)
    ve = Add (v, eps)
    s = Sqrt (ve)
    n = Div (d, s)
    y = MatMul (n, w)
}
"""


def test_a_lost_epsilon_is_pinned_where_it_is_added(tmp_path):
    model = parser.parse_model(MODEL)
    rng = np.random.default_rng(1)
    model.graph.initializer.extend([
        numpy_helper.from_array(np.array(1e-12, np.float32), "eps"),
        numpy_helper.from_array((rng.standard_normal((16, 256)) * 0.3).astype(np.float32), "w")])
    onnx.checker.check_model(model)
    path = tmp_path / "ln.onnx"
    onnx.save(model, str(path))
    data = tmp_path / "data"
    data.mkdir()
    xs = []
    for i in range(4):  # two of six rows are padding: one value repeated
        x = np.concatenate([rng.standard_normal((2, 4, 16)), np.full((2, 2, 16), 0.5)], axis=1)
        xs.append(x.astype(np.float32))
        np.savez(data / f"{i}.npz", x=xs[-1])
    out = tmp_path / "ln.fp16.onnx"
    done = run_cli("convert", path, "--target", "a2000", "--data", data, "-o", out)
    assert done.returncode == 0, done.stdout[-3000:]
    text = " ".join(done.stdout.split())
    assert "the values come in already lost" in text
    written = onnx.load(str(out))
    got = run(make_session(written), {"x": xs[0]})["y"]
    want = run(make_session(model), {"x": xs[0]})["y"]
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
