"""An 8-bit conversion through the vendor's own INT8, three ways, each on the held-out samples.

    QDQ model -> toolkit import (build without its quantiser: our scales)     "qdq_import"
    FP32 model + dataset -> toolkit INT8, npuprep's wider layers in FP16      "hybrid"
    FP32 source + dataset -> toolkit INT8 alone (the baseline)                "vendor_int8"

Where the toolkit runs a layer of the imported QDQ model in FP16 and so refuses its INT8
weights, the import is retried with that layer in float, weights and inputs (`fp16_tensors`).
The chosen path (DEFAULT_PATH, else the other npuprep path where the toolkit refuses it)
gives the VendorCheck's verdict and its accuracy_analysis; every path's error sits beside
npuprep's own (the QDQ model in onnxruntime) in `eight_bit`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from npuprep.data import Feed
from npuprep.detections import Decision
from npuprep.errors import NpuprepError
from npuprep.graph import node_label
from npuprep.verify.output_errors import output_passes
from npuprep.verify.vendor import VENDORS, VendorCheck, vendor_output_errors

PATHS = ("qdq_import", "hybrid", "vendor_int8")
# Measured on the corpus (BENCHMARKS.md, "8-bit through rknn-toolkit2"): the more accurate of
# the two paths that carry npuprep's plan.
DEFAULT_PATH = "qdq_import"
# Ops the toolkit folds into the layer before them: that layer's tensor is the later one's.
_FUSED_AFTER = ("BatchNormalization", "Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid",
                "HardSwish", "Add")


# `build: Invalid w_par['dtype'] = float16 for W_dq8!`: the toolkit chose FP16 for the layer
# reading that dequantised weight (rknn-toolkit2 2.5.0, on a MatMul or Conv whose input
# tensor also feeds a layer kept wider).
_FP16_WEIGHT = re.compile(r"Invalid w_par\['dtype'\] = float16 for (\S+?)!")
# Imports retried with one more such weight in float each: a build takes seconds to a minute.
MAX_IMPORT_ROUNDS = 24


def float_layer(model: onnx.ModelProto, tensor: str) -> onnx.ModelProto:
    """`model` with the layers reading dequantised weight `tensor` in float: the weight's
    DequantizeLinear replaced by the values it gives (an initialiser of the same name), and
    their activation inputs read before their QuantizeLinear/DequantizeLinear pair."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    producer = {o: n for n in g.node for o in n.output}
    node = producer.get(tensor)
    inits = {i.name: i for i in g.initializer}
    if node is None or node.op_type != "DequantizeLinear" or \
            any(i not in inits for i in node.input if i):
        raise NpuprepError(f"rknn: '{tensor}' is not a dequantised constant weight")
    w, scale, *rest = (numpy_helper.to_array(inits[i]).astype(np.float64) for i in node.input if i)
    zero = rest[0] if rest else np.zeros_like(scale)
    axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
    if scale.ndim == 1 and w.ndim > 1:
        shape = [1] * w.ndim
        shape[axis] = -1
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    g.node.remove(node)
    g.initializer.append(numpy_helper.from_array(((w - zero) * scale).astype(np.float32), tensor))
    for layer in g.node:
        if tensor not in layer.input:
            continue
        for i, name in enumerate(layer.input):
            dq = producer.get(name)
            q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" \
                else None
            if q is not None and q.op_type == "QuantizeLinear":
                layer.input[i] = q.input[0]
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    # Drop the Q/DQ pairs no layer reads any more (the toolkit would quantise them anyway).
    while dead := [n for n in g.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")
                   and not any(o in used for o in n.output)]:
        for n in dead:
            g.node.remove(n)
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    return out


@dataclass(frozen=True)
class VendorPath:
    """One way the vendor ran the 8-bit model: truthy when built, finite and within rtol."""

    path: str
    built: bool
    stage: str
    rtol: float
    refusal: str = ""
    outputs: Mapping[str, Mapping[str, Any]] | None = None
    fp16_tensors: tuple[str, ...] = ()
    unknown_tensors: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.built and all(output_passes(o, self.rtol) for o in (self.outputs or {}).values())

    @property
    def worst_rel_l2(self) -> float | None:
        """The worst output's rel L2; inf where an output holds Inf/NaN, None when not built."""
        outs = list((self.outputs or {}).values())
        if not self.built or not outs:
            return None
        if any(o["nonfinite"] for o in outs):
            return float("inf")
        return max(float(o["rel_l2"]) for o in outs)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "passed": bool(self), "built": self.built, "stage": self.stage,
                "refusal": self.refusal, "worst_rel_l2": self.worst_rel_l2,
                "outputs": {k: dict(v) for k, v in sorted((self.outputs or {}).items())},
                "fp16_tensors": list(self.fp16_tensors),
                "unknown_tensors": list(self.unknown_tensors)}


def wider_tensors(model: onnx.ModelProto, layers: Sequence[Any]) -> list[list[str]]:
    """Per layer the plan keeps in FP16/FP32: its output tensor, then the tensors of the
    single-consumer ops the toolkit fuses into it (alternatives, first choice first)."""
    wide = {x.node for x in layers if x.precision in ("fp16", "fp32")}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    out = []
    for node in model.graph.node:
        if node_label(node) not in wide or not node.output:
            continue
        chain = [node.output[0]]
        while len(nxt := consumers.get(chain[-1], [])) == 1 and nxt[0].op_type in _FUSED_AFTER \
                and nxt[0].output:
            chain.append(nxt[0].output[0])
        out.append(chain)
    return out


def vendor_check_8bit(
    reference: onnx.ModelProto,
    result: Any,
    calibration: Sequence[Feed],
    samples: Sequence[Feed],
    *,
    vendor: str = "rknn",
    python: str | None = None,
    target_platform: str = "rk3588",
    rtol: float = 5e-2,
    top_k: Mapping[str, Decision] | None = None,
    path: str = DEFAULT_PATH,
    work_dir: str | Path | None = None,
) -> VendorCheck:
    """`result` (an 8-bit ConversionResult) through the vendor's INT8 three ways on `samples`
    (held-out), the toolkit's quantiser calibrated on `calibration`; the verdict is `path`'s."""
    from npuprep.vendors.rockchip import require_python, run_rknn

    if vendor not in VENDORS:
        raise NpuprepError(f"unknown vendor '{vendor}' (known: {', '.join(VENDORS)})")
    if path not in PATHS[:2]:
        raise NpuprepError(f"unknown 8-bit vendor path '{path}' (known: {', '.join(PATHS[:2])})")
    exe = require_python(python)
    feeds = [{k: np.asarray(v, dtype=np.float32) for k, v in s.items()} for s in samples]
    calib = [{k: np.asarray(v, dtype=np.float32) for k, v in s.items()} for s in calibration]
    hybrid = wider_tensors(result.rewritten, result.plan.eight_bit)
    builds = {
        "qdq_import": (result.lowered.model, {}),
        "hybrid": (result.rewritten, {"quantize_on": calib, "hybrid_fp16": hybrid}),
        "vendor_int8": (reference, {"quantize_on": calib}),
    }
    order = [path, *(p for p in PATHS if p != path)]
    runs: dict[str, Any] = {}
    paths: dict[str, VendorPath] = {}
    for name in order:
        model, extra = builds[name]
        # accuracy_analysis for the verdict's path only (it doubles a build's time), and not
        # on an imported QDQ model: without a board it refuses ("The QAT model need set
        # 'target'!", rknn-toolkit2 2.5.0).
        verdict = name != "qdq_import" and (name == path or (name in PATHS[:2]
                                                             and not runs.get(path)))
        where = Path(work_dir) / name if work_dir is not None else None
        widened: list[str] = []
        while True:
            done = run_rknn(model, feeds, python=exe, target_platform=target_platform,
                            accuracy=verdict, work_dir=where, **extra)
            refused = _FP16_WEIGHT.search(done.refusal) if not done else None
            if name != "qdq_import" or refused is None or len(widened) >= MAX_IMPORT_ROUNDS:
                break
            # The toolkit runs this layer in FP16 and refuses its INT8 weights: keep it wider.
            try:
                model = float_layer(model, refused.group(1))
            except NpuprepError:
                break  # not one of our weight DequantizeLinears: the refusal stands
            widened.append(refused.group(1))
        runs[name] = done
        outputs = vendor_output_errors(reference, samples, done.outputs, {}, rtol, top_k) if done else {}
        fp16 = widened if name == "qdq_import" else _lines(done.extra.get("hybrid_fp16"))
        paths[name] = VendorPath(
            path=name, built=bool(done), stage=done.stage, rtol=rtol, refusal=done.refusal,
            outputs=outputs, fp16_tensors=tuple(fp16),
            unknown_tensors=tuple(_lines(done.extra.get("hybrid_unknown"))))
    chosen = path if runs[path] else next((p for p in PATHS[:2] if runs[p]), path)
    done, picked = runs[chosen], paths[chosen]
    held = getattr(result, "holdout", None)
    own = list(held.outputs.values()) if held is not None else []
    eight = {"format": result.eight_bit.format, "chosen": chosen, "asked": path,
             "npuprep_rel_l2": max((float(o["rel_l2"]) for o in own), default=None),
             "npuprep_max_abs_error": max((float(o["max_abs_error"]) for o in own), default=None),
             "paths": [paths[p].to_dict() for p in PATHS]}
    return VendorCheck(
        vendor=vendor, target_platform=target_platform, rtol=rtol, samples=len(feeds),
        built=picked.built, stage=done.stage, refusal=picked.refusal,
        outputs={k: dict(v) for k, v in (picked.outputs or {}).items()},
        range_warnings=tuple(dict.fromkeys(w["tensor"] for w in done.range_warnings)),
        accuracy_report=done.accuracy_report, eight_bit=eight)


def _lines(text: str | None) -> list[str]:
    return [x for x in (text or "").split("\n") if x]


PATH_SAID = {"qdq_import": "npuprep's QDQ, imported", "hybrid": "toolkit INT8 + npuprep FP16",
             "vendor_int8": "toolkit INT8 alone"}


def paths_table(eight: Mapping[str, Any]) -> tuple[str, list[str], list[tuple[Any, ...]]]:
    """Title, header and rows for the terminal: each path's held-out error, npuprep's first."""
    rows: list[tuple[Any, ...]] = []
    if eight["npuprep_rel_l2"] is not None:
        rows.append(("npuprep QDQ in onnxruntime", "", "", eight["npuprep_max_abs_error"],
                     eight["npuprep_rel_l2"]))
    for p in eight["paths"]:
        outs = p["outputs"].values()
        chosen = " (verdict)" if p["path"] == eight["chosen"] else ""
        if not p["built"]:
            rows.append((PATH_SAID[p["path"]] + chosen, "no", "", "", p["refusal"]))
            continue
        rows.append((PATH_SAID[p["path"]] + chosen, "yes", sum(o["nonfinite"] for o in outs),
                     max(o["max_abs_error"] for o in outs), p["worst_rel_l2"]))
    fp16 = next((p for p in eight["paths"] if p["path"] == "hybrid"), None)
    title = "INT8 on held-out samples, rknn-toolkit2's simulator beside npuprep"
    if fp16 and fp16["built"]:
        title += f" (hybrid: {len(fp16['fp16_tensors'])} layers FP16)"
    return title, ["path", "built", "Inf/NaN", "max abs err", "rel L2 / refusal"], rows
