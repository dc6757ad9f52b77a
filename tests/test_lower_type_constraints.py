"""Lowering keeps every op's type constraint: the inputs ScatterElements, ScatterND, Where and
Concat require to share one type do, whichever of their producers is kept FP32."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from npuprep.numerics import get_format
from npuprep.rewrite.lower import lower

RNG = np.random.default_rng(3737)

# Each: a, b come from MatMuls (either may be kept FP32); the op under test joins them.
_HEAD = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[4, 8] x, int64[4, 8] idx, int64[2, 1] nd, bool[4, 8] c) => (float[4, {w}] y) <float[8, 8] wa, float[8, 8] wb> {{
  a = MatMul(x, wa)
  b = MatMul(x, wb)
  {body}
}}
"""
CASES = {
    # a -> ScatterElements(data=a, idx, updates=b, reduction=add) -> y (a graph network's messages)
    "scatter_elements_add": ("8", 'y = ScatterElements<axis=0, reduction="add">(a, idx, b)'),
    # a -> ScatterND(data=a, nd, updates=two rows of b) -> y
    "scatter_nd": ("8", "bs = Slice(b, s0, s2)\n  y = ScatterND(a, nd, bs)"),
    # Where(c, a, b) -> y
    "where": ("8", "y = Where(c, a, b)"),
    # Concat(a, b, axis=1) -> y
    "concat": ("16", "y = Concat<axis=1>(a, b)"),
}


def _model(case: str) -> onnx.ModelProto:
    width, body = CASES[case]
    text = _HEAD.format(w=width, body=body)
    if "Slice" in body:
        text = text.replace("float[8, 8] wb>", "float[8, 8] wb, int64[1] s0 = {0}, int64[1] s2 = {2}>")
    proto = onnx.parser.parse_model(text)
    proto.graph.initializer.extend(onnx.numpy_helper.from_array(RNG.normal(0, .3, (8, 8)).astype(np.float32), n)
                                   for n in ("wa", "wb"))
    return proto


def _feed() -> dict[str, np.ndarray]:
    return {"x": RNG.normal(0, 1, (4, 8)).astype(np.float32),
            "idx": RNG.integers(0, 4, (4, 8)).astype(np.int64),
            "nd": np.array([[3], [1]], np.int64), "c": RNG.random((4, 8)) > .5}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("pinned", [("node_of_a",), ("node_of_b",), ("node_of_y",), ()])
def test_the_joined_inputs_share_one_type_after_lowering(case, pinned):
    proto = _model(case)
    for node in proto.graph.node:
        node.name = f"node_of_{node.output[0]}"
    low = lower(proto, "fp16", pinned_nodes=pinned).model
    onnx.checker.check_model(low, full_check=True)  # strict shape and type inference
    inferred = onnx.shape_inference.infer_shapes(low, strict_mode=True)
    types = {v.name: v.type.tensor_type.elem_type for v in
             (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output)}
    joined = next(n for n in inferred.graph.node if n.output[0] in ("y", "y__fp16"))
    data = [i for i in joined.input if types.get(i) in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)]
    assert len({types[i] for i in data}) == 1, {i: types[i] for i in data}
    feed = _feed()
    got = ort.InferenceSession(low.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    ref = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    assert np.linalg.norm(got - ref) <= 1e-2 * np.linalg.norm(ref)


# x[1, 2049*2] -> Reshape(x, [Cast<int64>(Mul(2049.0, 1.0)), -1]) -> y: a size computed in float
# from constants alone (as a ViT computes its position grid's side, 1369 ** 0.5)
_SIZED = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 4098] x) => (float[2049, 2] y) <float side = {2049.0}, float one = {1.0}, int64[1] rest = {-1}> {
  s = Mul(side, one)
  n = Cast<to=7>(s)
  n1 = Unsqueeze(n, zero)
  shape = Concat<axis=0>(n1, rest)
  y = Reshape(x, shape)
}
"""


def test_a_size_computed_in_float_from_constants_stays_fp32():
    # FP16 rounds 2049 to 2048: the Reshape would fail, and onnxruntime would not fold it
    proto = onnx.parser.parse_model(_SIZED.replace("int64[1] rest = {-1}>", "int64[1] rest = {-1}, int64[1] zero = {0}>"))
    low = lower(proto, "fp16")
    mul = next(n for n in low.model.graph.node if n.op_type == "Mul")
    types = {t.name: t.data_type for t in low.model.graph.initializer}
    assert types[mul.input[0]] == types[mul.input[1]] == onnx.TensorProto.FLOAT
    x = RNG.normal(0, 1, (1, 4098)).astype(np.float32)
    got = ort.InferenceSession(low.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.shape == (2049, 2) and np.array_equal(got, x.reshape(2049, 2).astype(np.float16).astype(np.float32))


def test_bf16_lowering_drops_the_value_info_of_the_if_bodies_it_rewrote():
    # c, x -> If(then: y = Mul(x, Constant 1.5), else: y = Neg(x)) -> y ; the then-body
    # declares its constant FP32 in value_info (as onnx's version converter writes it)
    from onnx import TensorProto, helper

    k = helper.make_node("Constant", [], ["k"], value=helper.make_tensor("kv", TensorProto.FLOAT, [1], [1.5]))
    then = helper.make_graph([k, helper.make_node("Mul", ["x", "k"], ["yt"])], "then", [],
                             [helper.make_tensor_value_info("yt", TensorProto.FLOAT, [2])],
                             value_info=[helper.make_tensor_value_info("k", TensorProto.FLOAT, [1])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["ye"])], "else", [],
                              [helper.make_tensor_value_info("ye", TensorProto.FLOAT, [2])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)], ir_version=10)
    lowered = lower(model, get_format("bf16")).model  # onnx.checker inside: a stale FP32 k failed it
    (body,) = [a.g for n in lowered.graph.node if n.op_type == "If" for a in n.attribute
               if a.name == "then_branch"]
    assert not body.value_info
    (const,) = [n for n in body.node if n.op_type == "Constant"]
    assert const.attribute[0].t.data_type == TensorProto.BFLOAT16
