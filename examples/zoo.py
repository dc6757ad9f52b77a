"""A zoo of small models with planted FP16 hazards, each with deterministic samples.

Every model computes finite FP32 outputs on its samples and leaves FP16's range (or loses
its accuracy) somewhere inside when converted naively. `ZOO` maps a name to a builder
returning a `ZooModel`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


@dataclass(frozen=True)
class ZooModel:
    name: str
    hazard: str
    model: onnx.ModelProto
    samples: tuple[dict[str, np.ndarray], ...]


def _init(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)


def _model(nodes, inputs, outputs, inits, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)
    model.producer_name = "npuprep-zoo"
    onnx.checker.check_model(model, full_check=True)
    return model


def _vi(name: str, shape: list[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _samples(n: int, seed: int, make: Callable[[np.random.Generator], dict[str, np.ndarray]]):
    return tuple(make(np.random.default_rng([seed, i])) for i in range(n))


def bev_distance(n_samples: int = 8, seed: int = 0) -> ZooModel:
    """Squared distances of BEV points in decimetres to fixed obstacles, Gaussian-weighted.

    pos[16,2] -> Sub(obst) -> Pow 2 -> ReduceSum -> d2 (~1e6) -> Exp(-d2/sigma2) -> MatMul -> y
    """
    rng = np.random.default_rng(100)
    obstacles = rng.uniform(-800, 800, (1, 8, 2)).astype(np.float32)
    w = rng.standard_normal((8, 4)).astype(np.float32) * 0.5
    nodes = [
        helper.make_node("Unsqueeze", ["pos", "ax1"], ["pos3"], name="unsq_pos"),
        helper.make_node("Sub", ["pos3", "obstacles"], ["delta"], name="delta"),
        helper.make_node("Pow", ["delta", "two"], ["delta_sq"], name="square"),
        helper.make_node("ReduceSum", ["delta_sq", "axis_last"], ["d2"], name="dist2", keepdims=0),
        helper.make_node("Div", ["d2", "sigma2"], ["d2n"], name="scale_dist"),
        helper.make_node("Neg", ["d2n"], ["neg_d2n"], name="neg"),
        helper.make_node("Exp", ["neg_d2n"], ["gauss"], name="gauss"),
        helper.make_node("MatMul", ["gauss", "w_out"], ["cost"], name="cost_head"),
    ]
    inits = [
        numpy_helper.from_array(np.array([1], np.int64), "ax1"),
        numpy_helper.from_array(np.array([-1], np.int64), "axis_last"),
        _init("obstacles", obstacles), _init("two", np.array(2.0)),
        _init("sigma2", np.array(2.0e5)), _init("w_out", w),
    ]
    model = _model(nodes, [_vi("pos", [16, 2])], [_vi("cost", [16, 4])], inits, "bev_distance")
    return ZooModel("bev_distance", "decimetre squared distances (1e6) before a Gaussian",
                    model, _samples(n_samples, seed, lambda r: {
                        "pos": r.uniform(-1000, 1000, (16, 2)).astype(np.float32)}))


def exp_logits(n_samples: int = 8, seed: int = 0) -> ZooModel:
    """Large logits into a decomposed softmax without max subtraction.

    x[4,32] -> Gemm -> logits (~20) -> Exp -> ReduceSum -> Div -> Gemm -> y
    """
    rng = np.random.default_rng(101)
    w1 = rng.standard_normal((32, 16)).astype(np.float32) * 1.2
    w2 = rng.standard_normal((16, 8)).astype(np.float32) * 0.3
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["logits"], name="logit_proj"),
        helper.make_node("Exp", ["logits"], ["e"], name="exp"),
        helper.make_node("ReduceSum", ["e", "axis_last"], ["den"], name="den", keepdims=1),
        helper.make_node("Div", ["e", "den"], ["probs"], name="normalise"),
        helper.make_node("Gemm", ["probs", "w2", "b2"], ["y"], name="out_proj"),
    ]
    inits = [_init("w1", w1), _init("b1", np.full(16, 4.0)), _init("w2", w2), _init("b2", np.zeros(8)),
             numpy_helper.from_array(np.array([-1], np.int64), "axis_last")]
    model = _model(nodes, [_vi("x", [4, 32])], [_vi("y", [4, 8])], inits, "exp_logits")
    return ZooModel("exp_logits", "logits up to ~20 into Exp (FP16 Exp overflows above 11.09)",
                    model, _samples(n_samples, seed, lambda r: {
                        "x": r.standard_normal((4, 32)).astype(np.float32)}))


def guidance(n_samples: int = 8, seed: int = 0) -> ZooModel:
    """Classifier-free guidance on large noise predictions.

    x -> Gemm_c -> eps_c ; x -> Gemm_u -> eps_u ; y = eps_c + 7.5 * (eps_c - eps_u)
    """
    rng = np.random.default_rng(102)
    wc = rng.standard_normal((16, 16)).astype(np.float32) * 1800
    wu = wc + rng.standard_normal((16, 16)).astype(np.float32) * 1200
    nodes = [
        helper.make_node("Gemm", ["x", "wc"], ["eps_c"], name="eps_cond"),
        helper.make_node("Gemm", ["x", "wu"], ["eps_u"], name="eps_uncond"),
        helper.make_node("Sub", ["eps_c", "eps_u"], ["diff"], name="guid_diff"),
        helper.make_node("Mul", ["diff", "w"], ["scaled"], name="guid_scale"),
        helper.make_node("Add", ["eps_c", "scaled"], ["y"], name="guid_add"),
    ]
    inits = [_init("wc", wc), _init("wu", wu), _init("w", np.array(7.5))]
    model = _model(nodes, [_vi("x", [2, 16])], [_vi("y", [2, 16])], inits, "guidance")
    return ZooModel("guidance", "eps_c + 7.5*(eps_c - eps_u) with predictions ~1e4",
                    model, _samples(n_samples, seed, lambda r: {
                        "x": r.standard_normal((2, 16)).astype(np.float32)}))


def conv_stack(n_samples: int = 4, seed: int = 0) -> ZooModel:
    """A conv stack whose middle activations reach ~1e5.

    x -> Conv -> Relu -> Conv -> Relu -> Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm -> y
    """
    rng = np.random.default_rng(103)
    w1 = rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 40
    w2 = rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 60
    w3 = rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 0.05
    wf = rng.standard_normal((8, 4)).astype(np.float32) * 0.1
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], name="conv3", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c3"], ["r3"], name="relu3"),
        helper.make_node("GlobalAveragePool", ["r3"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "wf", "bf"], ["y"], name="fc"),
    ]
    inits = [_init("w1", w1), _init("b1", np.zeros(8)), _init("w2", w2), _init("b2", np.zeros(8)),
             _init("w3", w3), _init("b3", np.zeros(8)), _init("wf", wf), _init("bf", np.zeros(4))]
    model = _model(nodes, [_vi("x", [1, 3, 16, 16])], [_vi("y", [1, 4])], inits, "conv_stack")
    return ZooModel("conv_stack", "conv activations ~1e5 in the middle of the stack",
                    model, _samples(n_samples, seed, lambda r: {
                        "x": r.uniform(0, 1, (1, 3, 16, 16)).astype(np.float32)}))


def residual_outliers(n_samples: int = 8, seed: int = 0) -> ZooModel:
    """A residual stream with outlier channels (~1e5) read through LayerNormalization.

    x -> Gemm_in -> h ; h + MatMul(LN(h)) -> h2 ; h2 + MatMul(LN(h2)) -> h3 ; LN(h3) -> Gemm -> y
    """
    rng = np.random.default_rng(104)
    d = 32
    w_in = rng.standard_normal((16, d)).astype(np.float32)
    w_in[:, 3] *= 3.0e4  # outlier channels, as large transformers grow them
    w_in[:, 17] *= 2.0e4
    nodes = [helper.make_node("Gemm", ["x", "w_in"], ["h0"], name="embed")]
    inits = [_init("w_in", w_in)]
    cur = "h0"
    for i in range(2):
        nodes += [
            helper.make_node("LayerNormalization", [cur, f"g{i}", f"be{i}"], [f"ln{i}"],
                             name=f"ln{i}", axis=-1, epsilon=1e-5),
            helper.make_node("MatMul", [f"ln{i}", f"wb{i}"], [f"upd{i}"], name=f"block{i}"),
            helper.make_node("Add", [cur, f"upd{i}"], [f"h{i + 1}"], name=f"residual{i}"),
        ]
        inits += [_init(f"g{i}", np.ones(d)), _init(f"be{i}", np.zeros(d)),
                  _init(f"wb{i}", rng.standard_normal((d, d)).astype(np.float32) * 0.2)]
        cur = f"h{i + 1}"
    nodes += [
        helper.make_node("LayerNormalization", [cur, "gf", "bef"], ["lnf"], name="ln_final",
                         axis=-1, epsilon=1e-5),
        helper.make_node("Gemm", ["lnf", "w_head"], ["y"], name="head"),
    ]
    inits += [_init("gf", np.ones(d)), _init("bef", np.zeros(d)),
              _init("w_head", rng.standard_normal((d, 4)).astype(np.float32) * 0.2)]
    model = _model(nodes, [_vi("x", [4, 16])], [_vi("y", [4, 4])], inits, "residual_outliers")
    return ZooModel("residual_outliers", "residual stream with outlier channels ~1e5",
                    model, _samples(n_samples, seed, lambda r: {
                        "x": r.standard_normal((4, 16)).astype(np.float32)}))


def decomposed_layernorm(n_samples: int = 8, seed: int = 0) -> ZooModel:
    """A LayerNorm written out op by op on activations ~400: the variance overflows.

    x -> Gemm -> h -> ReduceMean, Sub, Pow 2 (1.6e5), ReduceMean, Add eps, Sqrt, Div, Mul, Add -> Gemm -> y
    """
    rng = np.random.default_rng(105)
    w = rng.standard_normal((16, 32)).astype(np.float32) * 120
    nodes = [
        helper.make_node("Gemm", ["x", "w"], ["h"], name="proj"),
        helper.make_node("ReduceMean", ["h"], ["mu"], name="ln_mean", axes=[-1]),
        helper.make_node("Sub", ["h", "mu"], ["xc"], name="ln_center"),
        helper.make_node("Pow", ["xc", "two"], ["xc2"], name="ln_square"),
        helper.make_node("ReduceMean", ["xc2"], ["var"], name="ln_var", axes=[-1]),
        helper.make_node("Add", ["var", "eps"], ["var_eps"], name="ln_add_eps"),
        helper.make_node("Sqrt", ["var_eps"], ["std"], name="ln_sqrt"),
        helper.make_node("Div", ["xc", "std"], ["norm"], name="ln_div"),
        helper.make_node("Mul", ["norm", "gamma"], ["scaled"], name="ln_gamma"),
        helper.make_node("Add", ["scaled", "beta"], ["ln"], name="ln_beta"),
        helper.make_node("Gemm", ["ln", "w_out"], ["y"], name="head"),
    ]
    inits = [_init("w", w), _init("two", np.array(2.0)), _init("eps", np.array(1e-5)),
             _init("gamma", np.ones(32)), _init("beta", np.zeros(32)),
             _init("w_out", rng.standard_normal((32, 8)).astype(np.float32) * 0.2)]
    model = _model(nodes, [_vi("x", [4, 16])], [_vi("y", [4, 8])], inits, "decomposed_layernorm")
    return ZooModel("decomposed_layernorm", "decomposed LayerNorm whose variance reaches ~1e5",
                    model, _samples(n_samples, seed, lambda r: {
                        "x": r.standard_normal((4, 16)).astype(np.float32)}))


def if_body_hazard(n_samples: int = 8, seed: int = 0) -> ZooModel:
    """A square that overflows inside an If branch.

    x -> Gemm -> h ; If(flag): then Mul(h, h) -> ReduceMean -> Sqrt ; else h -> ReduceMean ; -> y
    """
    rng = np.random.default_rng(106)
    w = rng.standard_normal((8, 8)).astype(np.float32) * 200
    then_g = helper.make_graph(
        [helper.make_node("Mul", ["h", "h"], ["h_sq"], name="then_square"),
         helper.make_node("ReduceMean", ["h_sq"], ["ms"], name="then_mean", axes=[-1]),
         helper.make_node("Sqrt", ["ms"], ["t_out"], name="then_rms")],
        "then_branch", [], [_vi("t_out", [4, 1])])
    else_g = helper.make_graph(
        [helper.make_node("ReduceMean", ["h"], ["e_out"], name="else_mean", axes=[-1])],
        "else_branch", [], [_vi("e_out", [4, 1])])
    nodes = [
        helper.make_node("Gemm", ["x", "w"], ["h"], name="proj"),
        helper.make_node("If", ["flag"], ["y"], name="branch", then_branch=then_g, else_branch=else_g),
    ]
    model = _model(nodes, [_vi("x", [4, 8]), helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                   [_vi("y", [4, 1])], [_init("w", w)], "if_body_hazard")
    return ZooModel("if_body_hazard", "x*x overflows inside an If branch",
                    model, _samples(n_samples, seed, lambda r: {
                        "x": r.standard_normal((4, 8)).astype(np.float32), "flag": np.array(True)}))


def bf16_weights(n_samples: int = 8, seed: int = 0) -> ZooModel:
    """BF16 weights (a BF16-trained export) with magnitudes beyond 1e4, cast to FP32 in-graph.

    x -> Gemm(Cast32(W_bf16)) -> Relu -> Gemm -> y
    """
    rng = np.random.default_rng(107)
    w1 = (rng.standard_normal((16, 16)) * 3.0e4).astype(ml_dtypes.bfloat16)
    w2 = rng.standard_normal((16, 4)).astype(np.float32) * 1e-4
    bf16 = helper.make_tensor("w1_bf16", TensorProto.BFLOAT16, w1.shape,
                              w1.view(np.uint16).flatten().tolist())
    nodes = [
        helper.make_node("Cast", ["w1_bf16"], ["w1"], name="cast_w1", to=TensorProto.FLOAT),
        helper.make_node("Gemm", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "w2"], ["y"], name="fc2"),
    ]
    model = _model(nodes, [_vi("x", [2, 16])], [_vi("y", [2, 4])], [bf16, _init("w2", w2)], "bf16_weights")
    return ZooModel("bf16_weights", "BF16 weights ~3e4 (beyond onnxconverter-common's 1e4 clip)",
                    model, _samples(n_samples, seed, lambda r: {
                        "x": r.standard_normal((2, 16)).astype(np.float32) * 0.01}))


def bn_large_variance(n_samples: int = 4, seed: int = 0) -> ZooModel:
    """BatchNormalization with running variances of 9.8e7, as in a real OCR model.

    x -> Conv -> BatchNormalization(var ~1e8) -> Relu -> GlobalAveragePool -> Flatten -> y
    """
    rng = np.random.default_rng(108)
    w = rng.standard_normal((4, 2, 3, 3)).astype(np.float32) * 3000
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["bn"],
                         name="bn", epsilon=1e-5),
        helper.make_node("Relu", ["bn"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["y"], name="flatten"),
    ]
    inits = [_init("w", w), _init("b", np.zeros(4)), _init("gamma", np.ones(4)),
             _init("beta", np.full(4, 0.1)), _init("mean", np.full(4, 10.0)),
             _init("var", np.array([9.8e7, 5.0e7, 2.0e7, 8.0e7]))]
    model = _model(nodes, [_vi("x", [1, 2, 8, 8])], [_vi("y", [1, 4])], inits, "bn_large_variance")
    return ZooModel("bn_large_variance", "BatchNorm variances of 9.8e7 (clipping them breaks the output)",
                    model, _samples(n_samples, seed, lambda r: {
                        "x": r.uniform(0, 1, (1, 2, 8, 8)).astype(np.float32)}))


ZOO: dict[str, Callable[..., ZooModel]] = {
    "bev_distance": bev_distance,
    "exp_logits": exp_logits,
    "guidance": guidance,
    "conv_stack": conv_stack,
    "residual_outliers": residual_outliers,
    "decomposed_layernorm": decomposed_layernorm,
    "if_body_hazard": if_body_hazard,
    "bf16_weights": bf16_weights,
    "bn_large_variance": bn_large_variance,
}
