"""Per 8-bit layer: its input's channel ranges against the chosen clip, its weights' (scratch)."""
from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import numpy as np
import onnx

from npuprep.calibrate.channels import channel_absmax
from npuprep.calibrate.scales import clip_for
from npuprep.data import load_samples
from npuprep.graph import constant_value, node_label
from npuprep.numerics import eight_bit_format
from npuprep.verify.qdq_model import activation_scale

pkl, folder, out = sys.argv[1], Path(sys.argv[2]).expanduser(), sys.argv[3]
d = pickle.load(open(pkl, "rb"))
base = onnx.load_from_string(d["base"])
samples = load_samples(folder / "calib", base)
g = base.graph
assigned = {x.node: x.precision for x in d["layers"] if eight_bit_format(x.precision) is not None}
nodes = {node_label(n): n for n in g.node}
inputs = sorted({nodes[k].input[0] for k in assigned})
per = channel_absmax(base, inputs, samples, axis=1)
rows = {}
for k, fmt in assigned.items():
    n = nodes[k]
    x = n.input[0]
    r = d["stats"].tensors[x]
    v = next(v for v in d["variants"] if v.fmt.name == fmt)
    rule = d["rules"].get(x, v.rules[0])
    s = activation_scale(r, v.fmt, rule, d["tensor_scales"].get(x, 1.0), v.headroom)
    ch = per[x].max(axis=0)
    w = constant_value(g, n.input[1])
    wch = np.abs(w.reshape(w.shape[0], -1)).max(axis=1)
    grp = next((a.i for a in n.attribute if a.name == "group"), 1)
    rows[k] = dict(fmt=fmt, input=x, rule=str(rule), absmax=r.absmax, min=r.min,
                   clip={str(q): clip_for(r, v.fmt, q).value for q in v.rules},
                   scale=s.scale, unsigned=s.unsigned, zp=s.zero_point,
                   ch_max=float(ch.max()), ch_med=float(np.median(ch)), ch_min=float(ch.min()),
                   ch_under_4_steps=float((ch < 4 * s.scale).mean()),
                   ch_over_clip=float((ch > s.scale * (255 if s.unsigned else 127)).mean()),
                   group=grp, w_shape=list(w.shape),
                   w_ratio=float(wch.max() / max(np.median(wch), 1e-12)),
                   w_max=float(wch.max()))
json.dump(rows, open(out, "w"), indent=1)
