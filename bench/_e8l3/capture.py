"""Run convert up to the widening search and pickle the search's inputs (scratch)."""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

import npuprep.pipeline.quantise_and_verify as qv
from npuprep.cli.common import parse_decisions
from npuprep.data import load_samples
from npuprep.model_io import load_model
from npuprep.pipeline.stages import CALIBRATE, convert
from npuprep.profiles import load_profile

folder = Path(sys.argv[1]).expanduser()
precision = sys.argv[2]
detect = sys.argv[3]
out = Path(sys.argv[4])


class Captured(Exception):
    pass


def hook(layers, fmt, check, *, rank, trial, **kw):
    cells = dict(zip(trial.__code__.co_freevars, [c.cell_contents for c in trial.__closure__]))
    s = cells["sessions"]
    dump = dict(reference=s.reference.SerializeToString(), base=s.base.SerializeToString(),
                layers=list(layers), stats=s.stats, variants=s.variants, wide=s.wide,
                saturate=s.saturate, kept_wider=s.kept_wider, tensor_scales=dict(s.tensor_scales),
                weights=s.weights, means=s.means, corrected=s.corrected, rules=s.rules,
                fmt=fmt)
    with open(out, "wb") as f:
        pickle.dump(dump, f)
    raise Captured()


qv.widen_by_ranking = hook
model = load_model(folder / "model.onnx")
calib = load_samples(folder / "calib", model.proto)
held = load_samples(folder / "heldout", model.proto)
try:
    convert(model, load_profile("a2000"), calib, holdout=held, stats=CALIBRATE,
            precision=precision, progress=lambda n: print(n, file=sys.stderr, flush=True),
            top_k=parse_decisions([], [detect]))
except Captured:
    print("captured", out)
