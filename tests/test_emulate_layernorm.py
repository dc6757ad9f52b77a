"""A pinned (FP32) decomposed LayerNorm fed by a rounded tensor: the emulated model loads and
computes the norm in FP32 on the FP16-rounded input (onnxruntime's layer-norm fusion used to
fuse through the rounding Cast and refuse to load the model)."""

from __future__ import annotations

import numpy as np
from conftest import model_from_text

from npuprep.numerics import get_format
from npuprep.runtime.session import make_session, run
from npuprep.verify.emulate import emulate

# x -> Add(b) "pre" (rounded) -> ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add (pinned) -> y
LAYERNORM = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 8] x) => (float[2, 8] y)
<float two = {2.0}, float eps = {1e-5}, float[8] b = {0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8},
 float[8] gamma = {1.5, 1.0, 0.5, 2.0, 1.0, 1.0, 0.25, 3.0}, float[8] beta = {0, 1, 0, 1, 0, 1, 0, 1}> {
  [pre] pre = Add(x, b)
  [mean] mean = ReduceMean<axes = [-1]>(pre)
  [sub] sub = Sub(pre, mean)
  [pw] pw = Pow(sub, two)
  [var] var = ReduceMean<axes = [-1]>(pw)
  [add] add = Add(var, eps)
  [sq] sq = Sqrt(add)
  [div] div = Div(sub, sq)
  [scale] scale = Mul(div, gamma)
  [y] y = Add(scale, beta)
}"""
NORM = ("mean", "sub", "pw", "var", "add", "sq", "div", "scale", "y")


def test_a_pinned_norm_behind_a_rounded_tensor_loads_and_computes_in_fp32():
    model = model_from_text(LAYERNORM)
    emulated = emulate(model, get_format("fp16"), saturate=False, pinned_nodes=NORM,
                       round_inputs=False)
    x = np.random.default_rng(0).normal(0, 3, (2, 8)).astype(np.float32)
    got = run(make_session(emulated.model), {"x": x})["y"]
    b = (np.arange(1, 9, dtype=np.float32) / 10).astype(np.float16).astype(np.float32)  # a rounded weight
    pre = (x + b).astype(np.float16).astype(np.float32)
    gamma = np.array([1.5, 1.0, 0.5, 2.0, 1.0, 1.0, 0.25, 3.0], np.float32)
    beta = np.array([0, 1, 0, 1, 0, 1, 0, 1], np.float32)
    sub = pre - pre.mean(-1, keepdims=True)
    want = sub / np.sqrt((sub ** 2).mean(-1, keepdims=True) + 1e-5) * gamma + beta
    assert np.abs(got - want).max() < 1e-5
