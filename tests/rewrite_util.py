"""Helpers for the rewrite tests: models from ONNX text with numpy weights, ORT runs, errors."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, parser

from npuprep.runtime.session import make_session, run


def build(text: str, **weights: np.ndarray) -> onnx.ModelProto:
    """Parse ONNX text whose `<...>` initialisers are declared without values; fill them in."""
    model = parser.parse_model(text)
    declared = {i.name for i in model.graph.initializer}
    for name, value in weights.items():
        if name in declared:
            model.graph.initializer.remove(next(i for i in model.graph.initializer if i.name == name))
        model.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    onnx.checker.check_model(model, full_check=True)
    return model


def outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return run(make_session(model, optimize=False), feeds)


def rel_err(ref: np.ndarray, cand: np.ndarray) -> float:
    """max |cand - ref| / max |ref| (0 for an all-zero reference that matches)."""
    ref = np.asarray(ref, np.float64)
    cand = np.asarray(cand, np.float64)
    scale = float(np.abs(ref).max()) or 1.0
    return float(np.abs(cand - ref).max()) / scale


C = 4


class RandomChain:
    """Builds a random chain starting with a Conv entry; block kinds listed in BLOCKS."""

    BLOCKS = ("relu", "leaky", "maxpool", "avgpool", "mulc", "divc", "addc", "residual",
              "transpose", "concat", "square_sqrt", "center", "neg", "instnorm", "batchnorm",
              "reshape", "clip", "sigmoid_after_mul")

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0

    def name(self, base: str) -> str:
        self.n += 1
        return f"{base}{self.n}"

    def const(self, value: np.ndarray) -> str:
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def node(self, op: str, inputs: list[str], **attrs) -> str:
        out = self.name("t")
        self.nodes.append(helper.make_node(op, inputs, [out], name=f"n_{out}", **attrs))
        return out

    def conv(self, x: str, cin: int = C, bias: bool = True) -> str:
        ins = [x, self.const(self.rng.normal(size=(C, cin, 1, 1)))]
        if bias:
            ins.append(self.const(self.rng.normal(size=C)))
        return self.node("Conv", ins)

    def block(self, kind: str, x: str) -> str:
        r = self.rng
        if kind == "relu":
            return self.node("Relu", [x])
        if kind == "leaky":
            return self.node("LeakyRelu", [x], alpha=0.1)
        if kind == "maxpool":
            return self.node("MaxPool", [x], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
        if kind == "avgpool":
            return self.node("AveragePool", [x], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
        if kind == "mulc":
            return self.node("Mul", [x, self.const(r.uniform(0.5, 2, size=(1, C, 1, 1)))])
        if kind == "divc":
            return self.node("Div", [x, self.const(r.uniform(0.5, 2))])
        if kind == "addc":
            return self.node("Add", [x, self.const(r.normal(size=(1, C, 1, 1)))])
        if kind == "residual":
            return self.node("Add", [x, self.conv(self.node("Relu", [x]))])
        if kind == "transpose":
            return self.node("Transpose", [x], perm=[0, 1, 3, 2])
        if kind == "concat":
            cat = self.node("Concat", [x, self.conv(x)], axis=1)
            return self.conv(cat, cin=2 * C)
        if kind == "square_sqrt":
            sq = self.node("Mul", [x, x])
            return self.node("Sqrt", [self.node("Add", [sq, self.const(1e-3)])])
        if kind == "center":
            mean = self.node("ReduceMean", [x], axes=[2, 3], keepdims=1)
            return self.node("Sub", [x, mean])
        if kind == "neg":
            return self.node("Neg", [x])
        if kind == "instnorm":
            return self.node("InstanceNormalization", [x, self.const(r.normal(size=C)),
                                                      self.const(r.normal(size=C))], epsilon=1e-4)
        if kind == "batchnorm":
            return self.node("BatchNormalization", [x, self.const(r.normal(size=C)),
                                                    self.const(r.normal(size=C)),
                                                    self.const(r.normal(size=C)),
                                                    self.const(r.uniform(0.5, 2, size=C))])
        if kind == "reshape":
            shape = self.name("shape")
            self.inits.append(numpy_helper.from_array(np.array([1, C, 16], np.int64), shape))
            flat = self.node("Reshape", [x, shape])
            back = self.name("shape")
            self.inits.append(numpy_helper.from_array(np.array([1, C, 4, 4], np.int64), back))
            return self.node("Reshape", [self.node("Relu", [flat]), back])
        if kind == "clip":
            return self.node("Clip", [x, self.const(-1.0), self.const(5.0)])
        if kind == "sigmoid_after_mul":
            return self.node("Sigmoid", [self.node("Mul", [x, self.const(0.01)])])
        raise AssertionError(kind)

    def model(self) -> tuple[onnx.ModelProto, list[str], str]:
        first = self.conv("x", cin=C)
        cur = first
        kinds = list(self.rng.choice(self.BLOCKS, size=int(self.rng.integers(2, 6))))
        for kind in kinds:
            cur = self.block(str(kind), cur)
        ending = self.rng.choice(["conv", "output", "tanh"])
        if ending == "conv":
            cur = self.conv(cur)
        elif ending == "tanh":
            cur = self.node("Tanh", [cur])
        self.nodes.append(helper.make_node("Identity", [cur], ["y"], name="out"))
        graph = helper.make_graph(
            self.nodes, "random",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, 4, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, C, 4, 4])], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        onnx.checker.check_model(model, full_check=True)
        return model, [*kinds, str(ending)], first
