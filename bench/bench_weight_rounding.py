"""Weight rounding of a model's layers, one layer at a time and side by side:

    python bench/bench_weight_rounding.py MODEL_DIR [MODEL_DIR ...]

Each MODEL_DIR holds model.onnx and calib/ (the corpus layout), or is an extra2 model's folder
(DIR/NAME/calib/ beside DIR/NAME.onnx). Rounds every Conv/MatMul/Gemm weight in INT8 and FP8
(as an 8-bit conversion on the A2000 does, on the raw model: no balancing before it) with one
worker and with one per core, alternating, and prints each run's CPU and wall seconds, the
machine's load, and a hash of every rounded weight and note (the same for both).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import time
from pathlib import Path

import numpy as np

from npuprep.data import load_samples
from npuprep.graph import node_label
from npuprep.model_io import load_model
from npuprep.numerics import eight_bit_format
from npuprep.rewrite.qdq_weights import WeightStore
from npuprep.rewrite.weight_rounding import round_layers


def rounded_hash(done: list[object], store: WeightStore) -> str:
    h = hashlib.sha256(repr(done).encode())
    for stored, scale in store._preferred.values():
        h.update(np.ascontiguousarray(stored).tobytes())
        h.update(np.ascontiguousarray(scale).tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    formats = [(eight_bit_format("int8"), True), (eight_bit_format("fp8_e4m3"), False)]
    for folder in args.folders:
        path = folder / "model.onnx" if (folder / "model.onnx").exists() else folder.with_suffix(".onnx")
        model = load_model(path)
        samples = list(load_samples(folder / "calib", model.proto))
        layers = [node_label(n) for n in model.proto.graph.node
                  if n.op_type in ("MatMul", "Gemm", "Conv")]
        # An older round_layers (no `workers`: one layer at a time) is timed once per repeat.
        side_by_side = "workers" in inspect.signature(round_layers).parameters
        for _ in range(args.repeat):
            for workers in (1, None) if side_by_side else (1,):
                store = WeightStore()
                load = os.getloadavg()[0]
                cpu, wall = time.process_time(), time.perf_counter()
                done = (round_layers(model.proto, layers, formats, samples, store, workers=workers)
                        if side_by_side else round_layers(model.proto, layers, formats, samples, store))
                print(f"{folder.name}: workers {workers or 'per core'}: "
                      f"{time.process_time() - cpu:.2f} CPU s, {time.perf_counter() - wall:.2f} s "
                      f"wall, load {load:.1f}, {len(done)} roundings, {rounded_hash(done, store)}",
                      flush=True)


if __name__ == "__main__":
    main()
