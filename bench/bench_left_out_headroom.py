"""Balanced depthwise inputs: the clip headroom their samples' spread gives, the headroom a
calibration sample left out of the fit shows, and how far the held-out samples pass the clip.

    python bench/bench_left_out_headroom.py MODEL_DIR

MODEL_DIR holds model.onnx, calib/ and heldout/ (the corpus layout). For every tensor a
depthwise Conv reads, each channel raised to the loudest's calibration abs-max (the Conv-input
balancing's factors, npuprep.rewrite.smooth.conv_smoothing_factors), per line: the spread
headroom of the balanced tensor's per-sample abs-maxima (npuprep.calibrate.scales
.sample_headroom) and of the tensor unbalanced, the left-out raise
(npuprep.calibrate.channels.leave_one_out_raise), and the held-out samples' peak over the clip
(calibration abs-max times the spread headroom), balanced and not.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from npuprep.calibrate.channels import channel_absmax, leave_one_out_raise
from npuprep.calibrate.scales import sample_headroom
from npuprep.calibrate.stats import RangeStats
from npuprep.data import load_samples
from npuprep.graph import attribute, constant_value
from npuprep.model_io import load_model
from npuprep.rewrite.equalise import factors


def _spread(per_sample: np.ndarray) -> float:
    r = RangeStats("t", "", "", 0.0, 0.0, 0.0, 0, 0, 0, 0, {}, {}, {}, (), 0)
    return sample_headroom(replace(r, per_sample_absmax=tuple(float(v) for v in per_sample)))


def main() -> None:
    folder = Path(sys.argv[1])
    model = load_model(folder / "model.onnx")
    calib = load_samples(folder / "calib", model.proto)
    held = load_samples(folder / "heldout", model.proto)
    g = model.proto.graph

    def depthwise(n: object) -> bool:
        w = constant_value(g, n.input[1]) if n.op_type == "Conv" and len(n.input) > 1 else None
        return w is not None and w.shape[1] == 1 and attribute(n, "group", 1) > 1

    xs = list(dict.fromkeys(n.input[0] for n in g.node if depthwise(n)))
    seen, unseen = channel_absmax(model.proto, xs, calib, axis=1), \
        channel_absmax(model.proto, xs, held, axis=1)
    print(f"{'tensor':24s} {'spread bal':>10s} {'unbal':>6s} {'left-out':>8s} "
          f"{'held/clip bal':>13s} {'unbal':>6s}")
    for x in xs:
        s = factors(seen[x].max(axis=0))
        bal, unbal = (seen[x] * s).max(axis=1), seen[x].max(axis=1)
        clip_bal, clip_unbal = bal.max() * _spread(bal), unbal.max() * _spread(unbal)
        print(f"{x[:24]:24s} {_spread(bal):10.2f} {_spread(unbal):6.2f} "
              f"{leave_one_out_raise(seen[x], factors):8.2f} "
              f"{(unseen[x] * s).max() / clip_bal:13.2f} {unseen[x].max() / clip_unbal:6.2f}")


if __name__ == "__main__":
    main()
