"""A decomposed LayerNorm whose squares pass FP16's headroom: rescaled, though the squares' small
values sink under the smallest normal (their ReduceMean sums them, and loses almost nothing)."""

from __future__ import annotations

import numpy as np
import onnx

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.model_io import Model
from npuprep.plan import Rescale
from npuprep.profiles import load_profile

WIDTH = 64


def _layernorm_model() -> onnx.ModelProto:
    # x -> MatMul(W) -> h -> ReduceMean/Sub -> d -> Pow(2) -> sq -> ReduceMean -> +eps -> Sqrt -> Div(d) -> y
    eye = ", ".join("1.0" if i == j else "0.0" for i in range(WIDTH) for j in range(WIDTH))
    return onnx.parser.parse_model(f"""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4, {WIDTH}] x) => (float[4, {WIDTH}] y)
      <float[{WIDTH}, {WIDTH}] W = {{{eye}}}, float two = {{2.0}}, float eps = {{1e-5}}> {{
        [proj] h = MatMul (x, W)
        [mean] m = ReduceMean <axes = [-1]> (h)
        [sub] d = Sub (h, m)
        [pow] sq = Pow (d, two)
        [var] v = ReduceMean <axes = [-1]> (sq)
        [add] ve = Add (v, eps)
        [sqrt] s = Sqrt (ve)
        [div] y = Div (d, s)
    }}
    """)


def _rows(n: int, peak: float, seed: int) -> list[dict[str, np.ndarray]]:
    """Rows of +-peak and 31 pairs +-v, v log-uniform in [1e-2, 1e-1]: mean 0, squares from 1e-4."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        small = 10.0 ** rng.uniform(-2, -1, size=(4, WIDTH // 2 - 1))
        rows = np.concatenate([np.full((4, 1), peak), small, -np.full((4, 1), peak), -small], axis=1)
        out.append({"x": rng.permuted(rows, axis=1).astype(np.float32)})
    return out


def test_squares_past_the_headroom_are_rescaled_though_their_small_values_sink():
    model = Model(proto=_layernorm_model(), path="ln.onnx", digest="ln")
    # Calibration squares reach 200^2 = 40000: past the headroom (32752), within FP16's max.
    # Held-out rows reach 290^2 = 84100: Inf in FP16 unless the plan scaled the squares down.
    samples = _rows(4, 200.0, 0)
    result = convert(model, load_profile("generic"), samples, stats=calibrate(model, samples),
                     holdout=_rows(2, 290.0, 1))
    (rescale,) = [a for a in result.plan.actions if isinstance(a, Rescale)]
    assert rescale.entry == "proj" and rescale.k >= 1
    # A quarter of the squares sink under the smallest normal at 2^-2; their mean loses
    # at most half a subnormal step each and the outputs hold.
    assert result, result.to_dict()["verification"]
    for check in (result.output_check, result.holdout):
        (y,) = check.outputs.values()
        assert y["nonfinite"] == 0 and y["rel_l2"] <= 1e-2
