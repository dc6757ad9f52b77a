"""What the 8-bit search's trial sessions are cut into: pieces, and what each costs.

    python bench/bench_trial_pieces.py MODEL_DIR [--precision int8|fp8_e4m3] [--sessions N]

MODEL_DIR as bench/bench_eight_bit_search.py takes it. Runs convert until the search has built
N trial sessions (default 5: a scratch model's balancings build four before the search's), and
prints for each: its nodes, its pieces, each piece's CPU seconds on the first sample with every
switch off and the values entering it (MB). A trial starts at the last cut before its first
switch, so a layer alone runs only the pieces from its own; one piece means every trial runs
the whole model. Then stops.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import npuprep.verify.qdq_trials as qdq_trials
from npuprep.data import load_samples
from npuprep.model_io import load_model
from npuprep.pipeline.stages import CALIBRATE, convert
from npuprep.profiles import load_profile
from npuprep.runtime.session import run


class _Enough(Exception):
    """The sessions asked for were seen."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--precision", default="int8")
    parser.add_argument("--sessions", type=int, default=5)
    args = parser.parse_args()
    seen = [0]
    local = qdq_trials.LocalRuns

    class Reported(local):  # type: ignore[misc, valid-type]
        def __init__(self, model: object, samples: object) -> None:
            super().__init__(model, samples)
            seen[0] += 1
            values = {**self.samples[0], **{i.name: np.array(False) for i in model.graph.input
                                           if i.type.tensor_type.elem_type == 9}}
            costs = []
            for k, piece in enumerate(self.pieces):
                entering = sum(np.asarray(values[n]).nbytes for n in self.entering[k])
                start = time.process_time()
                values.update(run(self.sessions[k], {n: values[n] for n in piece.inputs},
                                  piece.outputs))
                costs.append(f"{time.process_time() - start:.3f} ({entering / 2**20:.2f} MB)")
            print(f"session {seen[0]}: {len(model.graph.node)} nodes, {len(self.pieces)} "
                  f"piece(s): {', '.join(costs)}", flush=True)
            if seen[0] >= args.sessions:
                raise _Enough

    qdq_trials.LocalRuns = Reported  # type: ignore[misc]
    folder = args.folder
    extra2 = folder.with_suffix(".onnx")
    path = folder / "model.onnx" if (folder / "model.onnx").exists() else extra2
    model = load_model(path)
    calib = load_samples(folder / "calib", model.proto)
    try:
        convert(model, load_profile("a2000"), calib, stats=CALIBRATE, precision=args.precision)
    except _Enough:
        return
    print("the conversion ended before that many trial sessions", file=sys.stderr)


if __name__ == "__main__":
    main()
