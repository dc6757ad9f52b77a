"""How much a model's decisions move with its weights alone in 8 bits: every Conv/MatMul/Gemm
weight rounded to nearest at one symmetric scale per output channel (abs-max / levels), every
activation left in FP32, judged as bench_eight_bit.py judges a conversion (held-out + judge set).

    python bench/bench_weights_only.py MODEL [MODEL ...] [--levels 127 1023 0] [--layers A:B]
        [--oracle] [--extra2 DIR] [--out DIR]

(`--levels 0`: FP8 E4M3 weights, each output channel's abs-max at 448.)

Where INT8 weights alone (127 levels) already change decided outputs, no 8-bit conversion that
keeps those layers' weights in 8 bits can hold every decision: the model's decisions sit closer
to each other than INT8 weight rounding. `--layers A:B` rounds only the A-th to (B-1)-th layer
with a constant weight (graph order). Writes OUT/NAME.wLEVELS.onnx and prints a row per model
and level: outputs' rel L2 and decided outputs changed, of the samples judged. `--oracle`:
the layers' weights rounded one more at a time, largest first, each kept where the judge
still sees every decision held: how much a weights-only choice could keep knowing the judge.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).parent))
import bench_eight_bit as bench  # noqa: E402

from npuprep.calibrate.layer_macs import layer_macs  # noqa: E402
from npuprep.graph import constant_value, node_label  # noqa: E402
from npuprep.numerics import eight_bit_format  # noqa: E402
from npuprep.rewrite.qdq_weights import quantise_weight  # noqa: E402

FP8 = eight_bit_format("fp8_e4m3")


def weights_rounded(model: onnx.ModelProto, levels: int, first: int = 0,
                    last: int | None = None, chosen: set[int] | None = None
                    ) -> tuple[onnx.ModelProto, int]:
    """`model` with its Conv/MatMul/Gemm constant weights (the first..last-1 of them, or the
    `chosen` ones) rounded to `levels` steps either side of zero per output channel (levels 0:
    to FP8 E4M3 as convert stores them, each channel's abs-max at 448); how many were
    rounded."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {i.name: i for i in g.initializer}
    consts = {n.output[0]: n for n in g.node if n.op_type == "Constant"}
    k, done = -1, 0
    for node in g.node:
        if node.op_type not in ("Conv", "MatMul", "Gemm") or len(node.input) < 2:
            continue
        w = constant_value(g, node.input[1])
        if w is None or w.ndim < 2:
            continue
        k += 1
        if k < first or (last is not None and k >= last) or (chosen is not None and k not in chosen):
            continue
        w = w.astype(np.float32)
        transposed = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
        axis = 0 if node.op_type == "Conv" or transposed else w.ndim - 1
        keep = tuple(i for i in range(w.ndim) if i != axis)
        if levels:
            scale = np.abs(w).max(axis=keep, keepdims=True) / levels
            scale[scale == 0] = 1.0
            rounded = (np.clip(np.round(w / scale), -levels, levels) * scale).astype(np.float32)
        else:
            stored, scale = quantise_weight(w, axis, FP8, saturate=True)
            rounded = (stored.astype(np.float32) * np.expand_dims(scale, keep)).astype(np.float32)
        tensor = numpy_helper.from_array(rounded, node.input[1])
        if node.input[1] in inits:
            inits[node.input[1]].CopyFrom(tensor)
        else:
            value = next(a for a in consts[node.input[1]].attribute if a.name == "value")
            value.t.CopyFrom(tensor)
        done += 1
    return out, done


def weight_layers(model: onnx.ModelProto) -> list[str]:
    """The labels of the layers weights_rounded counts, in its order."""
    g = model.graph
    return [node_label(n) for n in g.node
            if n.op_type in ("Conv", "MatMul", "Gemm") and len(n.input) > 1
            and (w := constant_value(g, n.input[1])) is not None and w.ndim >= 2]


def oracle(name: str, entry: bench.Entry, decided: tuple[str, ...], source: onnx.ModelProto,
           levels: int, out: Path) -> None:
    """Layers' weights rounded one more at a time, largest multiply-adds first, each kept
    where the judge itself (held-out and judge sets) still sees every decided output held
    and the outputs clean: the most a weights-only choice could keep, knowing the judge. An
    upper bound, not a method (nothing a conversion may read)."""
    labels = weight_layers(source)
    shapes = {k: tuple(v.shape) for k, v in bench._feeds(entry.calib)[0].items()}
    macs = layer_macs(source, None, shapes)
    total = sum(macs.values()) or 1
    kept: set[int] = set()
    share = 0.0
    for k in sorted(range(len(labels)), key=lambda i: -macs.get(labels[i], 0)):
        model, _ = weights_rounded(source, levels, chosen=kept | {k})
        path = out / f"{name}.oracle{levels}.onnx"
        onnx.save(model, str(path))
        judged = bench.judge(entry.model, path, entry, decided)
        changed = sum((judged.get("decided_flips") or {}).values())
        held = changed == 0 and bool(judged["outputs_ok"])
        part = macs.get(labels[k], 0) / total
        if held:
            kept.add(k)
            share += part
        print(f"{name:14s} {labels[k][:34]:34s} {part:6.1%}: rel L2 {judged['rel_l2']:.4f}, "
              f"{changed} changed -> {'kept' if held else 'left FP32'}, share {share:.1%}",
              flush=True)
    print(f"{name}: {len(kept)} of {len(labels)} layers' weights at {levels} levels hold every "
          f"decision of {judged['judged_samples']} samples: {share:.1%} of the multiply-adds",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--levels", type=int, nargs="+", default=[127, 1023])
    ap.add_argument("--layers", default="", help="A:B, only these layers' weights")
    ap.add_argument("--oracle", action="store_true",
                    help="layers added largest first while the judge sees nothing change (oracle)")
    ap.add_argument("--extra2", type=Path)
    ap.add_argument("--out", type=Path, default=Path("bench/_work/weights_only"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    first, _, last = args.layers.partition(":")
    for name in args.models:
        entry = bench.Entry(name, args.extra2)
        decided = bench.decided_of(entry)
        source = onnx.load(str(entry.model))
        if args.oracle:
            for levels in args.levels:
                oracle(name, entry, decided, source, levels, args.out)
            continue
        for levels in args.levels:
            model, count = weights_rounded(source, levels, int(first or 0),
                                           int(last) if last else None)
            path = args.out / f"{name}.w{levels}.onnx"
            onnx.save(model, str(path))
            judged = bench.judge(entry.model, path, entry, decided)
            changed = sum((judged.get("decided_flips") or {}).values())
            print(f"{name:18s} {levels:5d} levels, {count:3d} weights: rel L2 "
                  f"{judged['rel_l2']:.4f}, decided outputs changed at {changed} of "
                  f"{judged['judged_samples']} samples", flush=True)


if __name__ == "__main__":
    main()
