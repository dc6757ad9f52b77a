"""The micro-probes in PyTorch on a GPU: `y = op(x)` in FP16 (or under autocast) vs a float64 reference.

Same values as the ONNX micro-probes (designs.py), so a GPU verdict reads like a board's.
Needs torch (the optional extra `npuprep[torch]`) and numpy only: it runs on machines
without onnx. Mode `fp16` runs every op on FP16 tensors; mode `autocast` feeds FP32 tensors
through torch.autocast, which keeps some ops (exp, sum, softmax, pow) in FP32: those come
through exactly and are reported as computed wider.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from npuprep.probe.classify import Classification, Overall, classify, overall
from npuprep.probe.designs import DESIGNS

MODES = ("fp16", "autocast")


@dataclass(frozen=True)
class TorchFormat:
    """FP16's limits read from torch.finfo (the same numbers npuprep.numerics reads from numpy)."""

    name: str
    max: float
    eps: float

    @property
    def overflow_threshold(self) -> float:
        nmant = round(-math.log2(self.eps))
        return self.max + 2.0 ** (math.floor(math.log2(self.max)) - nmant - 1)


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError("the GPU probe needs PyTorch: pip install 'npuprep[torch]'") from None
    return torch


def torch_format() -> TorchFormat:
    fi = _torch().finfo(_torch().float16)
    return TorchFormat("fp16", float(fi.max), float(fi.eps))


def _ops(torch: ModuleType) -> dict[str, Callable[..., Any]]:
    """Each micro-probe's op, taking the design's inputs then weights, as in the ONNX graph."""
    f = torch.nn.functional
    return {
        "conv": lambda x, w: f.conv2d(x, w),
        "matmul": lambda a, b: a @ b,
        "gemm": lambda a, b, c: torch.addmm(c, a, b),
        "add": lambda a, b: a + b,
        "mul": lambda a, b: a * b,
        "exp": lambda x: torch.exp(x),
        "pow": lambda x, e: torch.pow(x, e),
        "reducesum": lambda x: x.sum(dim=1),
        "cast": lambda x: x.to(torch.float16),
        "softmax": lambda x: torch.softmax(x, dim=-1),
    }


@dataclass(frozen=True)
class TorchProbe:
    name: str
    unit: str
    mode: str
    classification: Classification


def run_torch_probes(device: str = "cuda", mode: str = "fp16",
                     names: tuple[str, ...] | None = None) -> list[TorchProbe]:
    """Every micro-probe (or those named) on `device` in `mode`, classified against float64 on CPU."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    torch = _torch()
    fmt = torch_format()
    ops = _ops(torch)
    results = []
    for name in names or tuple(DESIGNS):
        design = DESIGNS[name](fmt)
        args = [*design.inputs.values(), *design.weights.values()]
        op = ops[name]
        reference = op(*[torch.from_numpy(np.asarray(a, np.float64)) for a in args])
        if name == "cast":
            # The reference of a Cast is its input: nothing is lost in FP32.
            reference = torch.from_numpy(np.asarray(args[0], np.float64))
        with torch.no_grad():
            if mode == "fp16":
                # The Cast probe's input stays FP32: the Cast is what it probes.
                dt = [torch.float32 if name == "cast" else torch.float16] * len(args)
                tensors = [torch.from_numpy(np.asarray(a)).to(device=device, dtype=d) for a, d in zip(args, dt, strict=True)]
                observed = op(*tensors)
            else:
                tensors = [torch.from_numpy(np.asarray(a, np.float32)).to(device) for a in args]
                with torch.autocast(device_type=device.split(":")[0], dtype=torch.float16):
                    observed = op(*tensors)
        obs = observed.float().cpu().numpy()
        results.append(TorchProbe(name, design.unit, mode, classify(reference.numpy(), obs, fmt)))
    return results


def summary(results: list[TorchProbe]) -> Overall:
    return overall((r.name, r.classification.verdict) for r in results)
