"""A small diffusion trajectory planner in decimetre BEV coordinates whose naive FP16 overflows.

One denoising step: the noisy waypoints attend to obstacles through a squared-distance cost
and a softmax written out by hand (no max subtraction), a two-layer MLP with a decomposed
LayerNorm predicts the noise with and without the obstacle context, and classifier-free
guidance combines both with w = 7.5. Coordinates are in decimetres (up to about 1000), so
the squared distances reach 1e6, the risk logits exceed exp's FP16 limit and the LayerNorm
squares pass 65504: everything the toolkit must find and fix.

`python -m npuprep.examples.planner --write` regenerates planner.onnx and data/*.npz.
"""

from __future__ import annotations

import argparse
import io
import os
import zipfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

STEPS = 16  # waypoints per trajectory
OBSTACLES = 8
HIDDEN = 32
GUIDANCE = 7.5
# Risk logits are PRIOR - d2 * INV_TWO_SIGMA2: near obstacles (d2 small) they approach 40, far
# beyond exp's FP16 limit yet finite in FP32; sigma = 22 m keeps far ones above FP32 underflow.
PRIOR = 40.0
INV_TWO_SIGMA2 = 1e-5
LN_EPS = 1e-5
OPSET = 17
IR_VERSION = 8
SAMPLES = 16


def _weights(seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def dense(n_in: int, n_out: int) -> np.ndarray:
        return (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)

    return {
        "w_in": dense(6, HIDDEN), "b_in": (rng.standard_normal(HIDDEN) * 10).astype(np.float32),
        "ln_gamma": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
        "ln_beta": (0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
        "w_hid": dense(HIDDEN, HIDDEN), "b_hid": (0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
        "w_out": dense(HIDDEN, 2), "b_out": (0.1 * rng.standard_normal(2)).astype(np.float32),
    }


def _const(name: str, value: np.ndarray | float | list[int]) -> onnx.TensorProto:
    array = np.asarray(value)
    if array.dtype.kind == "f":
        array = array.astype(np.float32)
    return numpy_helper.from_array(array, name)


def _trunk(prefix: str, features: str, nodes: list[onnx.NodeProto]) -> str:
    """Linear -> decomposed LayerNorm -> Relu -> Linear -> Relu -> Linear, shared weights."""

    def node(op: str, inputs: list[str], name: str, **attrs: object) -> str:
        out = f"{prefix}_{name}"
        nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    h = node("Add", [node("MatMul", [features, "w_in"], "in_mm"), "b_in"], "in")
    mean = node("ReduceMean", [h], "ln_mean", axes=[-1], keepdims=1)
    centred = node("Sub", [h, mean], "ln_sub")
    square = node("Pow", [centred, "two"], "ln_pow")
    var = node("ReduceMean", [square], "ln_var", axes=[-1], keepdims=1)
    std = node("Sqrt", [node("Add", [var, "ln_eps"], "ln_add")], "ln_sqrt")
    normed = node("Div", [centred, std], "ln_div")
    scaled = node("Add", [node("Mul", [normed, "ln_gamma"], "ln_scale"), "ln_beta"], "ln_out")
    h1 = node("Relu", [scaled], "relu1")
    h2 = node("Relu", [node("Add", [node("MatMul", [h1, "w_hid"], "hid_mm"), "b_hid"], "hid")], "relu2")
    return node("Add", [node("MatMul", [h2, "w_out"], "out_mm"), "b_out"], "eps")


def build_planner() -> onnx.ModelProto:
    """The planner graph, built deterministically (same bytes every time)."""
    nodes: list[onnx.NodeProto] = []

    def node(op: str, inputs: list[str], out: str, **attrs: object) -> str:
        nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    # Pairwise offsets waypoint -> obstacle, [1, T, K, 2], and squared distances [1, T, K].
    wp = node("Unsqueeze", ["traj", "axis2"], "traj_u")
    ob = node("Unsqueeze", ["obstacles", "axis1"], "obst_u")
    offset = node("Sub", [wp, ob], "offset")
    d2 = node("ReduceSum", [node("Pow", [offset, "two"], "offset_sq"), "last_axis"], "dist2", keepdims=0)
    # Gaussian risk logits and a softmax over obstacles, written out without max subtraction.
    logits = node("Add", [node("Mul", [d2, "neg_inv_two_sigma2"], "risk_scaled"), "prior"], "risk_logits")
    weight = node("Exp", [logits], "risk_exp")
    total = node("ReduceSum", [weight, "last_axis"], "risk_sum", keepdims=1)
    attn = node("Div", [weight, total], "risk_attn")
    context = node("MatMul", [attn, node("Squeeze", ["obstacles", "axis0"], "obst_s")], "obst_context")
    node("ReduceSum", [node("Mul", [attn, d2], "risk_weighted"), "last_axis"], "risk_cost", keepdims=0)
    # Conditional features carry the obstacle context; the unconditional branch drops it.
    rel = node("Sub", [context, "traj"], "context_rel")
    cond = node("Concat", ["traj", context, rel], "feat_cond", axis=-1)
    uncond = node("Concat", ["traj", "zeros_ctx", "zeros_ctx"], "feat_uncond", axis=-1)
    eps_c = _trunk("cond", cond, nodes)
    eps_u = _trunk("uncond", uncond, nodes)
    # Classifier-free guidance: eps_c + w * (eps_c - eps_u).
    guided = node("Mul", ["guidance_w", node("Sub", [eps_c, eps_u], "cfg_diff")], "cfg_scaled")
    node("Add", [eps_c, guided], "eps_guided")

    weights = _weights()
    inits = [_const(k, v) for k, v in weights.items()] + [
        _const("two", 2.0), _const("ln_eps", LN_EPS), _const("prior", PRIOR),
        _const("neg_inv_two_sigma2", -INV_TWO_SIGMA2), _const("guidance_w", GUIDANCE),
        _const("axis0", np.array([0], np.int64)), _const("axis1", np.array([1], np.int64)),
        _const("axis2", np.array([2], np.int64)), _const("last_axis", np.array([-1], np.int64)),
        _const("zeros_ctx", np.zeros((1, STEPS, 2), np.float32)),
    ]
    graph = helper.make_graph(
        nodes, "diffusion_planner",
        inputs=[helper.make_tensor_value_info("traj", TensorProto.FLOAT, [1, STEPS, 2]),
                helper.make_tensor_value_info("obstacles", TensorProto.FLOAT, [1, OBSTACLES, 2])],
        outputs=[helper.make_tensor_value_info("eps_guided", TensorProto.FLOAT, [1, STEPS, 2]),
                 helper.make_tensor_value_info("risk_cost", TensorProto.FLOAT, [1, STEPS])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="npuprep.examples.planner", ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model


def planner_samples(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """n calibration samples: noisy waypoint paths and obstacles, in decimetres."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        heading = rng.uniform(-0.6, 0.6)
        speed = rng.uniform(20.0, 60.0)  # decimetres per waypoint
        t = np.arange(1, STEPS + 1)
        path = np.stack([t * speed * np.cos(heading), t * speed * np.sin(heading)], axis=-1)
        traj = path + rng.normal(0.0, 30.0, size=path.shape)
        obstacles = rng.uniform([-200.0, -600.0], [1000.0, 600.0], size=(OBSTACLES, 2))
        samples.append({"traj": traj[None].astype(np.float32),
                        "obstacles": obstacles[None].astype(np.float32)})
    return samples


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An .npz with fixed timestamps and order, so the same arrays give the same bytes."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in sorted(arrays):
            body = io.BytesIO()
            np.lib.format.write_array(body, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            zf.writestr(info, body.getvalue())
    return buffer.getvalue()


def write_example(folder: Path) -> list[Path]:
    """Write planner.onnx and data/sample_NNN.npz under `folder`; returns the paths."""
    from npuprep.output_files import save_model

    folder = Path(folder)
    written = [save_model(build_planner(), folder / "planner.onnx")]
    (folder / "data").mkdir(parents=True, exist_ok=True)
    for i, sample in enumerate(planner_samples(SAMPLES, seed=0)):
        path = folder / "data" / f"sample_{i:03d}.npz"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(_npz_bytes(sample))
        os.replace(tmp, path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m npuprep.examples.planner", description=__doc__)
    parser.add_argument("--write", action="store_true", help="regenerate the bundled files")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help="folder to write into (default: next to this module)")
    args = parser.parse_args(argv)
    if not args.write:
        parser.print_help()
        return 2
    for path in write_example(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
