"""One layer: activation-only / weight-only / both, each rule, with and without balancing (scratch)."""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import onnx

from npuprep.data import load_samples
from npuprep.graph import node_label
from npuprep.runtime.session import make_session, run
from npuprep.scale_rules import ScaleRule
from npuprep.verify.qdq_model import balance_conv_inputs, quantise
from npuprep.verify.qdq_trials import Variant, errors_alone

pkl, folder, layer = sys.argv[1], Path(sys.argv[2]).expanduser(), sys.argv[3]
d = pickle.load(open(pkl, "rb"))
ref = onnx.load_from_string(d["reference"])
base = onnx.load_from_string(d["base"])
calib = list(load_samples(folder / "calib", ref))
SCORES = ["transpose_0.tmp_0", "transpose_2.tmp_0", "transpose_4.tmp_0", "transpose_6.tmp_0"]
int8 = next(v for v in d["variants"] if v.fmt.name == "int8")
rs = make_session(ref, prepack=False)
exp = [run(rs, f) for f in calib]


def metric(model):
    s = make_session(model, prepack=False)
    worst, errs = 0.0, []
    for f, e in zip(calib, exp):
        o = run(s, f)
        for k in SCORES:
            r, c = e[k], o[k]
            dec = np.abs(r - 0.5) > 0.05
            tw = np.where(r > 0.5, r - c, c - r)
            worst = max(worst, float(np.where(dec, np.maximum(tw, 0) / np.abs(r - 0.5), 0).max()))
            errs.append(np.abs(c - r)[dec & (r > 0.5)])
    e = np.concatenate(errs)
    return f"eaten {worst:.3f} med {np.median(e):.4f} p90 {np.percentile(e, 90):.4f} max {e.max():.4f}"


def strip(model, keep):
    """Drop the activation pair (keep='weight') or the weight DQ (keep='act') of `layer`."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    node = next(n for n in g.node if node_label(n) == layer)
    made = {o: n for n in g.node for o in n.output}
    if keep == "weight":
        dq = made[node.input[0]]
        node.input[0] = made[dq.input[0]].input[0]
    else:
        dq = made[node.input[1]]
        w = onnx.numpy_helper.to_array(next(i for i in g.initializer if i.name == dq.input[0]))
        sc = onnx.numpy_helper.to_array(next(i for i in g.initializer if i.name == dq.input[1]))
        g.initializer.append(onnx.numpy_helper.from_array(
            (w.astype(np.float32) * sc.reshape(-1, *[1] * (w.ndim - 1))).astype(np.float32), "w_exact"))
        node.input[1] = "w_exact"
    return m


def show(model, stats, tag):
    for rule in ScaleRule:
        q = quantise(model, [layer], stats, int8.fmt, saturate=True, rule=rule,
                     weights=None).model
        print(tag, rule, "both", metric(q), "| act", metric(strip(q, "act")), flush=True)
    print(tag, "weight only", metric(strip(q, "weight")), flush=True)


show(base, d["stats"], "plain")
alone_v = Variant(int8.fmt, (int8.rules[0],), True)
found = balance_conv_inputs(base, [layer], d["stats"], calib, left_alone=set(),
                            measure=lambda m, st, g, on: errors_alone(ref, m, g, st, alone_v, on))
print("balanced", found.tensors)
if found.tensors:
    show(found.model, found.stats, "balanced")
    x = next(iter(found.tensors.values()))[0]
    r = found.stats.tensors[x]
    print("balanced stats absmax", r.absmax, "min", r.min)
