"""Depthwise inputs balanced on the captured search model; each layer alone and all (scratch)."""
from __future__ import annotations

import pickle
import sys
import time
from pathlib import Path

import numpy as np
import onnx

from npuprep.data import load_samples
from npuprep.detections import Detection
from npuprep.graph import attribute, node_label
from npuprep.numerics import eight_bit_format
from npuprep.verify.decision_margin import decision_error
from npuprep.verify.qdq_model import balance_conv_inputs
from npuprep.verify.qdq_trials import Trials, Variant, errors_alone, switched_qdq

pkl, folder, out, how = sys.argv[1], Path(sys.argv[2]).expanduser(), sys.argv[3], sys.argv[4]
if len(sys.argv) > 5:
    import npuprep.rewrite.equalise as eq
    eq.MAX_FACTOR = float(sys.argv[5])
d = pickle.load(open(pkl, "rb"))
ref = onnx.load_from_string(d["reference"])
base = onnx.load_from_string(d["base"])
calib = list(load_samples(folder / "calib", ref))
held = list(load_samples(folder / "heldout", ref))
assigned = {x.node: x.precision for x in d["layers"] if eight_bit_format(x.precision) is not None}
SCORES = ["transpose_0.tmp_0", "transpose_2.tmp_0", "transpose_4.tmp_0", "transpose_6.tmp_0"]
BOXES = ["transpose_1.tmp_0", "transpose_3.tmp_0", "transpose_5.tmp_0", "transpose_7.tmp_0"]
top_k = {s: Detection(0.5, tuple(SCORES)) for s in SCORES}
top_k.update({b: Detection(0.5, tuple(SCORES), s) for s, b in zip(SCORES, BOXES)})


def score(got, expected):
    return decision_error(got, expected, top_k=top_k, aim=0.04, margin=2.0, tie_rtol=0.05)


int8 = next(v for v in d["variants"] if v.fmt.name == "int8")
alone_v = Variant(int8.fmt, (int8.rules[0],), True)
nodes = {node_label(n): n for n in base.graph.node}
dw = [k for k, f in assigned.items() if f == "int8" and attribute(nodes[k], "group", 1) > 1]
t0 = time.time()
stats = d["stats"]
if how != "none":
    def measure(model, st, groups, on):
        return errors_alone(ref, model, groups, st, alone_v, on, tensor_scales=d["tensor_scales"],
                            weights=d["weights"], )
    found = balance_conv_inputs(base, dw, stats, calib, measure=measure, left_alone=set(),
                                weights=d["weights"])
    base, stats = found.model, found.stats
    print("balanced", len(found.tensors), sorted(found.tensors), "whole", found.whole,
          f"{time.time() - t0:.0f}s", flush=True)
switched = switched_qdq(base, list(assigned), stats, d["variants"],
                        tensor_scales=d["tensor_scales"], weights=d["weights"], means=d["means"],
                        rules=d["rules"], formats=assigned)
res = {}
for name, samples in (("calib", calib), ("held", held)):
    trials = Trials(ref, switched, d["wide"], d["kept_wider"], samples, saturate=d["saturate"])
    exp = trials.expected
    mask = [{s: (np.abs(e[s] - 0.5) < 0.3) for s in SCORES} for e in exp]
    refs = np.concatenate([e[s][m[s]] for e, m in zip(exp, mask) for s in SCORES])

    def devs(outs):
        return np.concatenate([o[s][m[s]] - e[s][m[s]] for o, e, m in zip(outs, exp, mask)
                               for s in SCORES])
    every_out = trials.outputs(assigned, d["rules"])
    res[name] = dict(refs=refs, every=devs(every_out), none=devs(trials.outputs({}, d["rules"])),
                     score=score(every_out, exp))
    lay = dw if name == "calib" else []
    res[name]["alone"] = {k: devs(trials.outputs({k: assigned[k]}, d["rules"])) for k in lay}
    trials.close()
    print(name, "score all-8bit", res[name]["score"], f"{time.time() - t0:.0f}s", flush=True)
pickle.dump(res, open(out, "wb"))
