"""`npuprep calibrate MODEL --data D -o stats.json`: every float tensor's range on samples."""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING, Any

from npuprep.cli.common import (
    add_data,
    add_jobs,
    add_json,
    out,
    positive_int,
    print_json,
    print_table,
    say,
)
from npuprep.formatting import capped, percent

if TYPE_CHECKING:
    from npuprep.calibrate.stats import CalibrationStats
    from npuprep.model_io import Model

help = "measure every float tensor's range on samples (in-graph statistics) and write stats.json"

# Formats the summary measures headroom against, in the order shown.
_SUMMARY_FORMATS = ("fp16", "fp8_e4m3")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="ONNX model to calibrate")
    add_data(p, required=True)
    p.add_argument("-o", "--output", help="write the statistics here (JSON, kind 'stats')")
    # Every command takes --target; statistics are measured in FP32 whatever it is, and the
    # summary's columns stay fp16 and e4m3. It is checked here, so a typo fails before the run.
    p.add_argument("--target", "-t", help="the target the statistics are for (checked, recorded in "
                                          "nothing: stats are FP32 measurements any target reads)")
    add_jobs(p)
    p.add_argument("--detail", choices=("auto", "all"), default="auto",
                   help="exponent histogram and zero/underflow counts: only for tensor-samples outside "
                        "the ordinary range (auto, fast) or everywhere (all, ~5x slower)")
    p.add_argument("--top", type=positive_int, default=15, help="tensors shown in the summary (default 15)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--shard", type=_shard, metavar="K/N",
                       help="calibrate only the K-th of N slices of the samples (by sorted file name, or "
                            "index); merge the N stats files with `npuprep stats merge`")
    where.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                       help="run shards of the samples as Ray tasks (pip install 'npuprep[ray]'): on a local "
                            "Ray without ADDRESS, else on the cluster at ADDRESS ('auto', 'ray://host:10001'); "
                            "the model and the samples must be at the same path on every node")
    p.add_argument("--ray-cpus", type=positive_int, default=1, metavar="N",
                   help="CPUs per Ray task (default 1): one shard per N CPUs of the cluster")
    add_json(p)


def _shard(text: str) -> tuple[int, int]:
    """`--shard K/N`: 1 <= K <= N."""
    k, _, n = text.partition("/")
    try:
        pair = int(k), int(n)
    except ValueError:
        pair = (0, 0)
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected K/N with 1 <= K <= N, got {text!r}")
    return pair


def run(args: argparse.Namespace) -> int:
    from npuprep.calibrate import calibrate
    from npuprep.calibrate.stats import dump_stats
    from npuprep.cli.common import begin, open_samples

    # Only onnxruntime reads the weights, from the model's file: Python never holds them.
    run_ = begin(args, inputs=("data",), weights="file")
    model, outputs = run_.model, run_.outputs
    if args.output:
        outputs.writes(args.output, "-o")
    with outputs.open() as files:
        samples = open_samples(args, model.proto)
        show = not args.json and sys.stderr.isatty()
        if args.ray is not None:
            from npuprep.calibrate.on_ray import calibrate_on_ray
            from npuprep.errors import NpuprepError

            if args.jobs != 1:
                raise NpuprepError("--ray runs one process per shard: --jobs does not apply")
            stats = calibrate_on_ray(model, samples, address=args.ray or None, detail=args.detail,
                                     streams=args.streams, show_progress=show,
                                     cpus_per_task=args.ray_cpus)
        else:
            if args.shard:
                samples = samples.shard(*args.shard)
            stats = calibrate(model, samples, jobs=args.jobs, streams=args.streams,
                              show_progress=show, detail=args.detail)
        if args.output:
            files.text(args.output, dump_stats(stats))
    if args.json:
        print_json(stats.to_dict() | {"summary": summary_rows(stats, args.top, _masks(model, stats)), "output": args.output or ""})
    else:
        _print(model, stats, args)
    return 0


def summary_rows(stats: CalibrationStats, top: int, masks: set[str] = frozenset()) -> list[dict[str, Any]]:
    """The tensors nearest the limits: highest abs-max first, non-finite ones on top, the
    `masks` (intentional -inf) after every other tensor, labelled."""
    from npuprep.numerics import get_format

    rows = []
    ranked = stats.nearest_limits(n=len(stats.tensors))
    ranked = [s for s in ranked if s.tensor not in masks] + [s for s in ranked if s.tensor in masks]
    for s in ranked[:top]:
        row = {"tensor": s.tensor, "node": s.node, "scope": s.scope, "absmax": s.absmax,
               "mask": s.tensor in masks,
               "min": s.min, "max": s.max, "nan_count": s.nan_count, "inf_count": s.inf_count,
               "samples_seen": len(s.per_sample_absmax)}
        for f in _SUMMARY_FORMATS:
            limit = get_format(f).max
            row[f"{f}_use"] = s.absmax / limit if not math.isnan(s.absmax) else None
            row[f"{f}_over"] = s.over[f]
        below = s.fraction_below(get_format("fp16").min_normal)
        row["fp16_underflow_share"] = below
        rows.append(row)
    return rows


def _print(model: Model, stats: CalibrationStats, args: argparse.Namespace) -> None:
    say(f"model   {model.path}  (fingerprint {model.fingerprint})")
    shard = f"  (shard {args.shard[0]}/{args.shard[1]})" if args.shard else ""
    say(f"samples {stats.samples}{shard}")
    if stats.synthetic:
        say("WARNING: statistics from SYNTHETIC samples (random inputs), not real data; "
            "ranges on real inputs can differ widely", always=True)
    masks = _masks(model, stats)
    rows = summary_rows(stats, args.top, masks)
    wide = out().width is None or out().verbose
    print_table(
        f"Tensors nearest the limits ({len(stats.tensors)} observed" + (", SYNTHETIC data)" if stats.synthetic else ")"),
        ["tensor", *(["node"] if wide else []), "abs-max", "fp16 use", ">fp16", "e4m3 use", ">e4m3",
         "NaN/Inf", "fp16 sub", "n"],
        [(r["tensor"] if r["scope"] == "main" else f"{r['tensor']} [{r['scope']}]",
          *([r["node"]] if wide else []), r["absmax"],
          _pct(r["fp16_use"]), r["fp16_over"], _pct(r["fp8_e4m3_use"]), r["fp8_e4m3_over"],
          f"{r['nan_count']}/{r['inf_count']}" + (" mask" if r["mask"] else ""),
          "-" if r["fp16_underflow_share"] is None else percent(r["fp16_underflow_share"]),
          r["samples_seen"]) for r in rows],
    )
    if masks:
        say(f"{len(masks)} tensor(s) hold an intentional -inf mask (first: {min(masks)}): no risk, "
            "ranked last and marked `mask`")
    if stats.unobserved:
        unobserved = sorted(stats.unobserved.items())
        shown, left = capped(unobserved, 10, out().show_all)
        print_table(f"Not observed ({len(unobserved)})", ["tensor", "reason"], shown)
        if left:
            say(f"... and {left} more not observed (--show-all)")
    if args.output:
        say(f"wrote {args.output}", always=True)


def _masks(model: Model, stats: CalibrationStats) -> set[str]:
    from npuprep.analyse.measured import mask_tensors

    return mask_tensors(model, stats)


def _pct(v: float | None) -> str:
    """The share of a format's max: `97%`, and from 10x up a ratio (`3.97e17x`), never `inf%`."""
    return "-" if v is None else percent(v)
