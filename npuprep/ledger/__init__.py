"""The precision ledger: what each format and each FP32 pin costs on the target (an estimate).

roofline.py  per node max(FLOPs / peak[format], bytes / bandwidth), compute- or memory-bound
formats.py   which format each node runs in: a uniform format, an 8-bit plan, a plan's pins,
             or read back from a converted model (its Casts are nodes too)
ledger.py    the totals per format, the pins' cost, the costliest nodes, the bound mix
kit.py       the board timing kit and `--measured` (measured beside estimated)
fit.py       one fit of efficiency per format, launch cost per op class and per-run cost
             over the measured rows of several kits
"""
