"""Each 8-bit layer alone: its deviation at the near-threshold scores (scratch analysis)."""
from __future__ import annotations

import pickle
import sys
import time
from pathlib import Path

import numpy as np
import onnx

from npuprep.data import load_samples
from npuprep.numerics import eight_bit_format
from npuprep.verify.qdq_trials import Trials, switched_qdq

pkl, folder, out = sys.argv[1], Path(sys.argv[2]).expanduser(), sys.argv[3]
which = sys.argv[4] if len(sys.argv) > 4 else "calib"
d = pickle.load(open(pkl, "rb"))
ref = onnx.load_from_string(d["reference"])
base = onnx.load_from_string(d["base"])
samples = load_samples(folder / ("calib" if which == "calib" else "heldout"), ref)
assigned = {x.node: x.precision for x in d["layers"] if eight_bit_format(x.precision) is not None}
switched = switched_qdq(base, list(assigned), d["stats"], d["variants"],
                        tensor_scales=d["tensor_scales"], weights=d["weights"], means=d["means"],
                        rules=d["rules"], formats=assigned)
trials = Trials(ref, switched, d["wide"], d["kept_wider"], samples, saturate=d["saturate"])
trials.corrected = d["corrected"]
SCORES = ["transpose_0.tmp_0", "transpose_2.tmp_0", "transpose_4.tmp_0", "transpose_6.tmp_0"]
exp = trials.expected
# near-threshold positions: reference in [0.2, 0.8]
mask = [{s: (np.abs(e[s] - 0.5) < 0.3) for s in SCORES} for e in exp]
refs = np.concatenate([e[s][m[s]] for e, m in zip(exp, mask) for s in SCORES])
where = [(i, s, int(m[s].sum())) for i, m in enumerate(mask) for s in SCORES]


def devs(outs):
    return np.concatenate([o[s][m[s]] - e[s][m[s]] for o, e, m in zip(outs, exp, mask)
                           for s in SCORES])


t0 = time.time()
every = devs(trials.outputs(assigned, d["rules"]))
none = devs(trials.outputs({}, d["rules"]))
alone = {}
for k, layer in enumerate(assigned):
    alone[layer] = devs(trials.outputs({layer: assigned[layer]}, d["rules"])) - none
    if k % 10 == 0:
        print(k, layer, f"{time.time() - t0:.0f}s", flush=True)
np.savez(out, refs=refs, every=every, none=none, layers=np.array(list(alone)),
         alone=np.stack(list(alone.values())), where=np.array(where, dtype=object))
print("done", time.time() - t0)
