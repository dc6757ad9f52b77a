"""Exposing tensors for a probe runs shape inference once per model, not once per tensor."""

from __future__ import annotations

import onnx
from conftest import model_from_text

from npuprep.probe.backends import expose

# x -> Relu -> a -> Neg -> b -> Exp -> c -> Abs -> y
CHAIN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 3] x) => (float[2, 3] y) {
  a = Relu (x)
  b = Neg (a)
  c = Exp (b)
  y = Abs (c)
}"""


def test_one_inference_pass_for_every_exposed_tensor(monkeypatch):
    model = model_from_text(CHAIN)
    calls = []
    real = onnx.shape_inference.infer_shapes

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", counting)
    out = expose(model, ["a", "b", "c", "a", "nope", "y"])
    # y is already an output, "nope" is not a tensor, "a" is asked twice: a, b, c are added.
    assert [o.name for o in out.graph.output] == ["y", "a", "b", "c"]
    dims = [[d.dim_value for d in o.type.tensor_type.shape.dim] for o in out.graph.output[1:]]
    assert dims == [[2, 3]] * 3
    # The tensors' types come from one pass and their shapes from one more (the weightless
    # skeleton), whatever the number of tensors: before, each tensor cost a pass of its own.
    assert 1 <= len(calls) <= 2
    calls.clear()
    expose(model, ["y"])
    assert len(calls) <= 1
