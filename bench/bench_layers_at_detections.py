"""Where a detector's 8-bit score error at its detections comes from: each layer alone.

    python bench/bench_layers_at_detections.py MODEL_DIR --precision int8
        --detect 'SCORES=BOXES,...:THRESHOLD' [--top 25]

Runs `convert` as `bench_eight_bit_search.py` does up to the widening search (calibration,
equalisation, balancing, weight rounding, the rule choice all as convert makes them), then on
the search's own trial session (FP16 around the 8-bit layers, as the board computes) runs
every 8-bit layer alone and every layer together on the calibration samples. For each it
prints the share of a decided score's distance to the threshold its error takes towards it
(the search's `eaten`: >= 0.5 fails the search's 2x margin, >= 1 flips a detection), the
largest |score error| at a detection, the layer's share of the multiply-adds, its group (a
depthwise Conv's > 1) and what its 8-bit input looks like: the spread of its channels'
abs-max (largest / smallest non-silent) and the share of channels under 4 steps of its scale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

import npuprep.pipeline.quantise_and_verify as qv
from npuprep.calibrate.channels import channel_absmax
from npuprep.calibrate.layer_macs import layer_macs
from npuprep.cli.common import parse_decisions
from npuprep.data import load_samples
from npuprep.detections import Detection
from npuprep.graph import attribute, node_label
from npuprep.model_io import load_model
from npuprep.numerics import eight_bit_format
from npuprep.pipeline.stages import CALIBRATE, convert
from npuprep.profiles import load_profile
from npuprep.verify.output_errors import detection_band
from npuprep.verify.pin_rounds import sample_shapes
from npuprep.verify.qdq_model import activation_scale

# Scores this far from the threshold are the ones whose error is kept per layer.
NEAR = 0.3


class _Captured(Exception):
    """The search's inputs, taken where the widening would start."""

    def __init__(self, sessions: Any, layers: list[Any]) -> None:
        super().__init__()
        self.sessions, self.layers = sessions, layers


def _capture(layers: Any, fmt: Any, check: Any, *, trial: Any, **_: Any) -> Any:
    cells = dict(zip(trial.__code__.co_freevars, (c.cell_contents for c in trial.__closure__),
                     strict=True))
    raise _Captured(cells["sessions"], list(layers))


def _eaten(ref: np.ndarray, dev: np.ndarray, threshold: float, band: float) -> float:
    decided = np.abs(ref - threshold) > band
    towards = np.where(ref > threshold, -dev, dev)
    return float(np.where(decided, np.maximum(towards, 0) / np.abs(ref - threshold), 0).max(
        initial=0.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--precision", default="int8")
    parser.add_argument("--target", default="a2000")
    parser.add_argument("--detect", required=True, metavar="SCORES=BOXES,...:THRESHOLD")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rules = parse_decisions([], [args.detect])
    scores = [k for k, r in rules.items() if isinstance(r, Detection) and r.scores is None]
    threshold = next(r.threshold for r in rules.values() if isinstance(r, Detection))
    band = detection_band(threshold, 0.05)
    model = load_model(args.folder / "model.onnx")
    calib = list(load_samples(args.folder / "calib", model.proto))
    qv.widen_by_ranking = _capture
    try:
        convert(model, load_profile(args.target), calib, stats=CALIBRATE,
                precision=args.precision, top_k=rules,
                progress=lambda s: print(s, file=sys.stderr, flush=True))
        sys.exit("the conversion passed before its search: nothing to attribute")
    except _Captured as found:
        sessions, layers = found.sessions, found.layers
    trials = sessions.checks()
    assigned = {x.node: x.precision for x in layers if eight_bit_format(x.precision) is not None}
    expected = trials.expected
    near = [{s: np.abs(e[s] - threshold) < NEAR for s in scores} for e in expected]
    ref = np.concatenate([e[s][m[s]] for e, m in zip(expected, near, strict=True) for s in scores])
    detected = (ref - threshold) > band

    def deviation(assign: dict[str, str]) -> np.ndarray:
        got = trials.outputs(assign, sessions.rules)
        return np.concatenate([o[s][m[s]] - e[s][m[s]] for o, e, m in
                               zip(got, expected, near, strict=True) for s in scores])

    none = deviation({})
    print(f"{len(ref)} scores within {NEAR} of {threshold:g}, {int(detected.sum())} detections "
          f"past the band, on {len(expected)} calibration samples")
    every = deviation(assigned) - none
    print(f"every layer in 8 bits: eaten {_eaten(ref, every, threshold, band):.3f}, |error| at "
          f"detections median {np.median(np.abs(every[detected])):.4f}, 90th percentile "
          f"{np.percentile(np.abs(every[detected]), 90):.4f}, max {np.abs(every[detected]).max():.4f}")
    nodes = {node_label(n): n for n in sessions.base.graph.node}
    macs = layer_macs(sessions.base, sessions.stats, sample_shapes(calib[:1]))
    total = sum(macs.values()) or 1
    inputs = sorted({nodes[k].input[0] for k in assigned if k in nodes})
    spread = channel_absmax(sessions.base, inputs, calib[:4], axis=1)
    rows = []
    for k, fmt in assigned.items():
        dev = deviation({k: fmt}) - none
        x = nodes[k].input[0]
        variant = next(v for v in sessions.variants if v.fmt.name == fmt)
        rule = sessions.rules.get(x, variant.rules[0])
        step = activation_scale(sessions.stats.tensors[x], variant.fmt, rule,
                                sessions.tensor_scales.get(x, 1.0), variant.headroom).scale
        top = spread[x].max(axis=0)
        live = top[top > 1e-6 * top.max()]
        rows.append((k, fmt, _eaten(ref, dev, threshold, band), float(np.abs(dev[detected]).max()),
                     macs.get(k, 0) / total, attribute(nodes[k], "group", 1),
                     float(live.max() / live.min()), float((live < 4 * step).mean())))
    rows.sort(key=lambda r: -r[2])
    print(f"{'layer':16} {'format':8} {'eaten':>6} {'max|err|':>8} {'MACs':>6} {'group':>5} "
          f"{'ch spread':>9} {'<4 steps':>8}")
    for k, fmt, eaten, worst, share, group, ratio, quiet in rows[:args.top]:
        print(f"{k:16} {fmt:8} {eaten:6.3f} {worst:8.4f} {share:6.2%} {group:5d} {ratio:9.1f} "
              f"{quiet:8.0%}")
    trials.close()


if __name__ == "__main__":
    main()
