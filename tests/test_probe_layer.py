"""Single-layer probe: amplify one layer's weights, run on a backend, classify, locate."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import model_from_text

from npuprep.errors import NpuprepError
from npuprep.numerics import get_format
from npuprep.probe.backends import EmulateBackend, OrtBackend
from npuprep.probe.classify import Verdict
from npuprep.probe.layer import amplify, pick_layer, probe_layer
from npuprep.probe.runner import reference_outputs

FP16 = get_format("fp16")
E4M3 = get_format("fp8_e4m3")

# x -> Conv(w1, b1) -> h -> Relu -> r -> Conv(w2) -> y
CONV_CHAIN = """
<ir_version: 8, opset_import: ["" : {opset}]>
g (float[1,3,4,4] x) => (float[1,2,4,4] y)
<float[4,3,1,1] w1 = {{0.1,0.2,-0.3,0.4,0.5,-0.6,0.7,0.8,0.9,-0.1,0.2,0.3}}, float[4] b1 = {{0.1,0.2,0.3,0.4}},
 float[2,4,1,1] w2 = {{0.5,-0.5,0.25,0.1,0.2,0.3,-0.4,0.5}}> {{
  h = Conv(x, w1, b1)
  r = Relu(h)
  y = Conv(r, w2)
}}"""

# x -> Add(c) -> a -> MatMul(w) -> m -> Sigmoid -> y   (the first linear layer is not the first node)
MATMUL_SIGMOID = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2,4] x) => (float[2,4] y)
<float[4] c = {0.5, 0.5, 0.5, 0.5},
 float[4,4] w = {0.1,0.2,-0.3,0.4,0.5,-0.6,0.7,0.8,0.9,-0.1,0.2,0.3,1,1,1,1}> {
  a = Add(x, c)
  m = MatMul(a, w)
  y = Sigmoid(m)
}"""


class WrappingBoard:
    """Board stand-in: runs the amplified FP32 model, wraps outputs into FP16's range."""

    name = "wrapping-board"

    def run(self, probe, tensors=()):
        out = reference_outputs(probe)
        return {k: (((v.astype(np.float64) + 65536) % 131072) - 65536).astype(np.float16)
                for k, v in out.items()}


def _conv(opset=17):
    return model_from_text(CONV_CHAIN.format(opset=opset))


def _feeds(shape=(1, 3, 4, 4)):
    return {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}


@pytest.mark.parametrize(
    ("backend", "fmt", "opset", "expected"),
    [
        (OrtBackend(FP16), FP16, 17, Verdict.INF),
        (EmulateBackend(FP16, saturate=False), FP16, 17, Verdict.INF),
        (EmulateBackend(FP16, saturate=True), FP16, 17, Verdict.SATURATE),
        (EmulateBackend(E4M3, saturate=False), E4M3, 19, Verdict.NAN),
        (EmulateBackend(E4M3, saturate=True), E4M3, 19, Verdict.SATURATE),
        (WrappingBoard(), FP16, 17, Verdict.OTHER_FINITE),
    ],
    ids=["ort", "emulate-ieee", "emulate-saturate", "e4m3-nosat", "e4m3-sat", "wrap"],
)
def test_layer_probe_gives_the_backends_class(backend, fmt, opset, expected):
    result = probe_layer(_conv(opset), _feeds(), fmt, backend)
    c = result.result.classification
    assert c.verdict is expected, c.reason
    assert result.layer.tensor == "h" and result.layer.op_type == "Conv"
    assert c.reference_absmax >= fmt.overflow_threshold
    assert c.over >= 1 and c.pairs
    if expected is not Verdict.OTHER_FINITE:
        # Backends that observe every tensor place the behaviour at the amplified Conv.
        assert result.first_shows["tensor"] == "h"
        assert result.first_shows["verdict"] == str(expected)


def test_small_fixed_gain_is_inconclusive_with_reason():
    result = probe_layer(_conv(), _feeds(), FP16, OrtBackend(FP16), gain=10, raise_gain=False)
    c = result.result.classification
    assert c.verdict is Verdict.NO_OVERFLOW and not c.wider
    assert c.reference_absmax < FP16.overflow_threshold
    assert "raise --gain" in c.reason and result.gain == 10
    assert result.first_shows is None


def test_gain_is_raised_until_the_reference_crosses():
    result = probe_layer(_conv(), _feeds(), FP16, EmulateBackend(FP16, saturate=False), gain=100)
    assert result.gain > 100
    assert result.result.classification.reference_absmax >= FP16.overflow_threshold
    # The weights themselves stay representable: only the activation overflows.
    assert result.gain * float(np.float32(0.9)) <= 0.5 * FP16.max * (1 + 1e-9)


def test_ort_with_fp32_outputs_is_reported_as_computed_wider():
    # onnxruntime's CPU provider computes this Conv in FP32 and drops the Cast pair around it.
    result = probe_layer(_conv(), _feeds(), FP16, OrtBackend(FP16, io="fp32"))
    c = result.result.classification
    assert c.verdict is Verdict.NO_OVERFLOW and c.wider
    assert c.pairs[0][1] == pytest.approx(c.pairs[0][0], rel=1e-3)
    assert abs(c.pairs[0][0]) > FP16.max


def test_named_layer_and_downstream_outputs():
    model = model_from_text(MATMUL_SIGMOID)
    result = probe_layer(model, _feeds((2, 4)), FP16, EmulateBackend(FP16, saturate=False), layer="m")
    assert result.layer.node == "node_of_m"
    assert result.verdict == "inf"
    # Sigmoid(+-Inf) is finite: the graph output hides the overflow, the probed tensor does not.
    assert result.graph_outputs["y"].verdict is Verdict.NO_OVERFLOW
    assert result.first_shows["tensor"] == "m"


def test_pick_layer_defaults_to_first_linear_op_and_rejects_others():
    model = model_from_text(MATMUL_SIGMOID)
    assert pick_layer(model).tensor == "m"
    assert pick_layer(model, "node_of_m").weights == ("w",)
    with pytest.raises(NpuprepError, match="not a Conv, ConvTranspose, Gemm or MatMul"):
        pick_layer(model, "node_of_y")
    with pytest.raises(NpuprepError, match="'zzz' not found"):
        pick_layer(model, "zzz")


def test_model_without_linear_layer_is_a_user_error():
    # x -> Relu -> y
    model = model_from_text("""<ir_version: 8, opset_import: ["" : 17]>
g (float[4] x) => (float[4] y) { y = Relu(x) }""")
    with pytest.raises(NpuprepError, match="no Conv, ConvTranspose, Gemm or MatMul"):
        pick_layer(model)


def test_amplify_copies_and_leaves_shared_weights_alone():
    # x -> MatMul(w) -> a ; x -> MatMul(w) -> b ; a + b -> y   (w shared by both layers)
    model = model_from_text("""<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2] x) => (float[1,2] y) <float[2,2] w = {1, 2, 3, 4}> {
  a = MatMul(x, w)
  b = MatMul(x, w)
  y = Add(a, b)
}""")
    before = model.SerializeToString()
    amp = amplify(model, pick_layer(model, "a"), 8.0)
    assert model.SerializeToString() == before
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in amp.graph.initializer}
    assert np.array_equal(inits["w"], [[1, 2], [3, 4]])
    assert np.array_equal(inits["w__probe_gain"], [[8, 16], [24, 32]])
    assert [o.name for o in amp.graph.output] == ["y", "a"]


def test_amplify_keeps_a_weight_an_if_branch_reads_from_outside():
    # x -> MatMul(w) -> a ; If(c) then Mul(a, v) else a -> y   (v read only inside the branch)
    model = model_from_text("""<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2] x, bool c) => (float[1,2] y) <float[2,2] w = {1, 2, 3, 4}, float[2] v = {2, 3}> {
  a = MatMul(x, w)
  y = If(c) <then_branch = t () => (float[1,2] ty) { ty = Mul(a, v) },
             else_branch = e () => (float[1,2] ey) { ey = Identity(a) }>
}""")
    amp = amplify(model, pick_layer(model, "a"), 8.0)
    assert "v" in {i.name for i in amp.graph.initializer}
    import onnxruntime as ort

    feed = {"x": np.ones((1, 2), np.float32), "c": np.array(True)}
    y, a = ort.InferenceSession(amp.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    assert np.array_equal(a, [[32, 48]]) and np.array_equal(y, [[64, 144]])


def test_bad_gain_is_a_user_error():
    with pytest.raises(NpuprepError, match="--gain must be a positive number"):
        probe_layer(_conv(), _feeds(), FP16, OrtBackend(FP16), gain=0)


def test_the_models_own_overflow_is_kept_apart():
    # x -> Mul(x, x) -> sq (overflows FP16 by itself) -> MatMul(w) -> m -> y ; x -> MatMul(v) -> n
    model = model_from_text("""<ir_version: 8, opset_import: ["" : 17]>
g (float[1,2] x) => (float[1,2] y, float[1,2] n)
<float[2,2] w = {1, 0, 0, 1}, float[2,2] v = {0.5, 0.25, 0.125, 1}> {
  sq = Mul(x, x)
  m = MatMul(sq, w)
  y = Relu(m)
  n = MatMul(x, v)
}""")
    feeds = {"x": np.array([[300.0, 1.0]], np.float32)}
    backend = EmulateBackend(FP16, saturate=False)
    dirty = probe_layer(model, feeds, FP16, backend, layer="m")
    assert dirty.pre_existing["tensor"] == "sq"
    assert dirty.dirty_inputs == ("sq",)
    assert "already non-finite" in dirty.result.classification.reason
    clean = probe_layer(model, feeds, FP16, backend, layer="n")
    assert clean.verdict == "inf" and clean.dirty_inputs == ()
    assert clean.first_shows["tensor"] == "n"
    assert clean.pre_existing["tensor"] == "sq"
