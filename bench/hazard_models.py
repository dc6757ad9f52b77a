"""Small real-shaped models of the FP16 hazard classes of issue 27, built without torch.

Run: python bench/hazard_models.py [--dir DIR]   (default bench/_work/hazards)

Each model lands as NAME/model.onnx with NAME/calib/ (8 samples) and NAME/heldout/ (4,
disjoint seeds), the corpus layout (bench/corpus.py). Shapes and constants follow the
models they stand for:

- log_mel_max: a speech front end, int16-scale audio -> STFT as a Conv (n_fft 256, hop 128,
  Hann) -> re^2 + im^2 -> 40-band mel MatMul -> Log(Max(., 1e-12)) -> Conv1d -> mean -> Gemm;
  speech-like clips (bench/corpus.py's generator), one in four noise only.
- log_power_add: the same front end with `Log(mel + 1e-10)` and clips
  with digital silence (exact zeros), as a DNSMOS-style quality model reads it.
- timestep_mlp: a diffusion UNet's timestep embedding (diffusers' layout: t * exp(-ln(1e4)
  i / 160), Sin | Cos, Linear 320->1280, SiLU, Linear 1280->1280), t uniform in [0, 1000].
- random_logits: an untrained classifier (Conv stem with 1e-12-scale weights, GAP, Linear
  with unit-scale weights): logits ~1e-9.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402 - the sibling script: its speech generator

SR, N_FFT, HOP, MELS, SECONDS = 16000, 256, 128, 40, 0.5
N_CALIB, N_HELDOUT = 8, 4
Sample = dict[str, np.ndarray]


def _mel_filters(bins: int, mels: int) -> np.ndarray:
    """Triangular mel filters, (bins, mels), as librosa's htk=True without normalisation."""
    def mel(f: np.ndarray) -> np.ndarray:
        return 2595 * np.log10(1 + f / 700)
    edges = 700 * (10 ** (np.linspace(0, mel(np.array(SR / 2)), mels + 2) / 2595) - 1)
    freqs = np.linspace(0, SR / 2, bins)
    fb = np.zeros((bins, mels))
    for m in range(mels):
        lo, mid, hi = edges[m], edges[m + 1], edges[m + 2]
        fb[:, m] = np.clip(np.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)), 0, None)
    return fb.astype(np.float32)


def _front_end(floor: str) -> onnx.ModelProto:
    bins = N_FFT // 2 + 1
    n = int(SR * SECONDS)
    frames = (n - N_FFT) // HOP + 1
    t = np.arange(N_FFT)
    k = np.arange(bins)[:, None]
    window = np.hanning(N_FFT)
    kernel = np.concatenate([np.cos(2 * np.pi * k * t / N_FFT) * window,
                             -np.sin(2 * np.pi * k * t / N_FFT) * window])[:, None, :]
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(kernel.astype(np.float32), "stft_kernel"),
        numpy_helper.from_array(_mel_filters(bins, MELS), "mel_fb"),
        numpy_helper.from_array(np.array(1e-12 if floor == "max" else 1e-10, np.float32), "floor"),
        numpy_helper.from_array((rng.standard_normal((32, MELS, 3)) * 0.1).astype(np.float32), "c1_w"),
        numpy_helper.from_array(np.zeros(32, np.float32), "c1_b"),
        numpy_helper.from_array((rng.standard_normal((32, 8)) * 0.2).astype(np.float32), "fc_w"),
        numpy_helper.from_array(np.zeros(8, np.float32), "fc_b"),
        *[numpy_helper.from_array(np.array(v, np.int64), name) for name, v in
          (("b0", [0]), ("b1", [bins]), ("b2", [2 * bins]), ("ax1", [1]))],
    ]
    log_in = ["mel", "floor"]
    nodes = [
        helper.make_node("Conv", ["audio", "stft_kernel"], ["spec"], name="stft", strides=[HOP]),
        helper.make_node("Slice", ["spec", "b0", "b1", "ax1"], ["re"], name="re"),
        helper.make_node("Slice", ["spec", "b1", "b2", "ax1"], ["im"], name="im"),
        helper.make_node("Mul", ["re", "re"], ["re2"], name="re_sq"),
        helper.make_node("Mul", ["im", "im"], ["im2"], name="im_sq"),
        helper.make_node("Add", ["re2", "im2"], ["power"], name="power"),
        helper.make_node("Transpose", ["power"], ["power_t"], name="power_t", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["power_t", "mel_fb"], ["mel_t"], name="mel_fb"),
        helper.make_node("Transpose", ["mel_t"], ["mel"], name="mel", perm=[0, 2, 1]),
        helper.make_node("Max" if floor == "max" else "Add", log_in, ["floored"], name="floor"),
        helper.make_node("Log", ["floored"], ["logmel"], name="log"),
        helper.make_node("Conv", ["logmel", "c1_w", "c1_b"], ["c1"], name="conv1", pads=[1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("ReduceMean", ["r1"], ["pooled"], name="pool", axes=[2], keepdims=0),
        helper.make_node("Gemm", ["pooled", "fc_w", "fc_b"], ["scores"], name="fc"),
    ]
    graph = helper.make_graph(
        nodes, f"log_mel_{floor}",
        [helper.make_tensor_value_info("audio", TensorProto.FLOAT, [1, 1, n])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 8])], inits)
    assert frames > 0
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _audio(silence: bool) -> Callable[[np.random.Generator], Sample]:
    def make(rng: np.random.Generator) -> Sample:
        clip = corpus.speech_like(rng, SECONDS, SR) * 32767.0  # int16 scale, as read from a file
        if silence and rng.random() < 0.5:
            start = int(rng.integers(0, clip.size // 2))
            clip[start: start + clip.size // 3] = 0.0
        return {"audio": clip.reshape(1, 1, -1).astype(np.float32)}
    return make


def _timestep_mlp() -> onnx.ModelProto:
    half, dim = 160, 1280
    rng = np.random.default_rng(0)
    freqs = np.exp(-np.log(10000.0) * np.arange(half) / half).reshape(1, half)
    inits = [
        numpy_helper.from_array(freqs.astype(np.float32), "freqs"),
        numpy_helper.from_array((rng.standard_normal((2 * half, dim)) / np.sqrt(2 * half))
                                .astype(np.float32), "l1_w"),
        numpy_helper.from_array(np.zeros(dim, np.float32), "l1_b"),
        numpy_helper.from_array((rng.standard_normal((dim, dim)) / np.sqrt(dim))
                                .astype(np.float32), "l2_w"),
        numpy_helper.from_array(np.zeros(dim, np.float32), "l2_b"),
    ]
    nodes = [
        helper.make_node("Mul", ["timesteps", "freqs"], ["phase"], name="phase"),
        helper.make_node("Sin", ["phase"], ["sin"], name="sin"),
        helper.make_node("Cos", ["phase"], ["cos"], name="cos"),
        helper.make_node("Concat", ["cos", "sin"], ["emb"], name="emb", axis=1),
        helper.make_node("Gemm", ["emb", "l1_w", "l1_b"], ["h"], name="linear_1"),
        helper.make_node("Sigmoid", ["h"], ["g"], name="silu_gate"),
        helper.make_node("Mul", ["h", "g"], ["a"], name="silu"),
        helper.make_node("Gemm", ["a", "l2_w", "l2_b"], ["temb"], name="linear_2"),
    ]
    graph = helper.make_graph(
        nodes, "timestep_mlp",
        [helper.make_tensor_value_info("timesteps", TensorProto.FLOAT, [2, 1])],
        [helper.make_tensor_value_info("temb", TensorProto.FLOAT, [2, dim])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _timesteps(rng: np.random.Generator) -> Sample:
    return {"timesteps": rng.uniform(0, 1000, (2, 1)).astype(np.float32)}


def _random_logits() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((rng.standard_normal((64, 3, 3, 3)) * 1e-12).astype(np.float32),
                                "stem_w"),
        numpy_helper.from_array((rng.standard_normal((64, 10)) * 4.0).astype(np.float32), "head_w"),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "stem_w"], ["stem"], name="stem", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["stem"], ["act"], name="act"),
        helper.make_node("GlobalAveragePool", ["act"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["feat"], name="flat"),
        helper.make_node("Gemm", ["feat", "head_w"], ["logits"], name="head"),
    ]
    graph = helper.make_graph(
        nodes, "random_logits",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 64, 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _images(rng: np.random.Generator) -> Sample:
    return {"image": ((rng.uniform(0, 1, (1, 3, 64, 64)) - 0.45) / 0.225).astype(np.float32)}


MODELS: dict[str, tuple[Callable[[], onnx.ModelProto], Callable[[np.random.Generator], Sample],
                        tuple[str, ...]]] = {
    # name: (model, sample maker, outputs read by their argmax)
    "log_mel_max": (lambda: _front_end("max"), _audio(False), ()),
    "log_power_add": (lambda: _front_end("add"), _audio(True), ()),
    "timestep_mlp": (_timestep_mlp, _timesteps, ()),
    "random_logits": (_random_logits, _images, ("logits",)),
}


def build(root: Path) -> list[str]:
    for name, (make_model, make_sample, _) in MODELS.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        model = make_model()
        onnx.checker.check_model(model, full_check=True)
        onnx.save(model, str(folder / "model.onnx"))
        for sub, count, seed in (("calib", N_CALIB, 1), ("heldout", N_HELDOUT, 2)):
            (folder / sub).mkdir(exist_ok=True)
            rng = np.random.default_rng(seed)
            for i in range(count):
                np.savez(folder / sub / f"{i:03d}.npz", **make_sample(rng))
    return list(MODELS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("bench/_work/hazards"))
    args = ap.parse_args()
    for name in build(args.dir):
        print(args.dir / name / "model.onnx")


if __name__ == "__main__":
    main()
