"""`npuprep ledger MODEL --target T [CONVERTED | --plan P]`: what each format and each pin buys (estimate)."""

from __future__ import annotations

import argparse
from typing import Any

from npuprep.cli.common import add_data, add_json, add_target, out, print_json, print_table, say

help = ("estimate per format what the model costs on the target (roofline from published peaks), "
        "what the FP32 pins cost; board timing kit and measured results")


def _peak(text: str) -> tuple[str, float]:
    from npuprep.profiles import THROUGHPUT_FORMATS

    fmt_, _, value = text.partition("=")
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if fmt_ not in THROUGHPUT_FORMATS or not number > 0:
        raise argparse.ArgumentTypeError(f"expected FORMAT=TFLOPS with FORMAT one of "
                                         f"{', '.join(THROUGHPUT_FORMATS)}, got {text!r}")
    return fmt_, number


def _bandwidth(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected GB/s > 0, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the FP32 ONNX model")
    p.add_argument("converted", nargs="?", help="the converted model (npuprep convert's output): "
                                                "its formats and Casts as written")
    add_target(p)
    p.add_argument("--plan", help="plan.yaml: its FP32 pins, Casts at their borders (instead of CONVERTED)")
    p.add_argument("--peak", action="append", type=_peak, default=[], metavar="FMT=TFLOPS",
                   help="set a dense peak the profile leaves unknown, e.g. fp16=3 (repeatable)")
    p.add_argument("--bandwidth", type=_bandwidth, metavar="GBS", help="set the memory bandwidth (GB/s)")
    p.add_argument("--export-kit", metavar="DIR", help="write the board timing kit (FP32 and converted "
                                                        "models, an input, time_models.py, README)")
    p.add_argument("--measured", metavar="RESULTS", help="the kit's results.json: measured beside "
                                                          "estimated, gaps over 2x flagged")
    add_data(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from npuprep.errors import NpuprepError
    from npuprep.ledger.ledger import build_ledger
    from npuprep.model_io import anchored, load_model
    from npuprep.numerics import formats
    from npuprep.output_files import SAMPLE_FILES, OutputPlan
    from npuprep.profiles import load_profile

    if args.converted and args.plan:
        raise NpuprepError("give either CONVERTED or --plan, not both")
    outputs = OutputPlan()
    outputs.reads_model(args.model)
    outputs.reads_model(args.converted, "the converted model")
    outputs.reads(args.plan, "the --plan file")
    outputs.reads(args.measured, "the --measured results")
    outputs.reads(args.data, "the --data samples", SAMPLE_FILES)
    outputs.reads_profile(args.target)
    profile = load_profile(args.target)
    # Weights stay in their files: the estimate reads shapes, a timing kit copies them.
    model = anchored(load_model(args.model, weights="file"))
    converted = anchored(load_model(args.converted, weights="file")) if args.converted else None
    models = {"fp32": model.proto, **({"converted": converted.proto} if converted else {})}
    if args.export_kit:
        from npuprep.ledger.kit import kit_files

        weights = {i.name for i in model.proto.graph.initializer}
        names = [i.name for i in model.proto.graph.input if i.name not in weights]
        for path in kit_files(args.export_kit, list(models), names):
            (outputs.writes_model if path.suffix == ".onnx" else outputs.writes)(path, "a file of the --export-kit kit")
    outputs.check()

    throughput = profile.throughput
    if args.peak or args.bandwidth:
        throughput = replace(throughput, peak_tflops={**throughput.peak_tflops, **dict(args.peak)},
                             bandwidth_gbs=args.bandwidth or throughput.bandwidth_gbs)
    pinned = None
    # The format the plan or the conversion was made for (`--precision bf16`), else the default.
    precision = None
    if args.plan:
        from npuprep.plan.plan import load_plan

        plan = load_plan(args.plan, model)
        pinned, precision = sorted(plan.pinned_nodes()), plan.precision
    elif converted is not None:
        from npuprep.ledger.formats import stored_precision
        from npuprep.provenance import read_conversion

        record = read_conversion(converted.proto)
        precision = record.precision if record is not None else stored_precision(converted.proto)
    target = profile.resolve(precision if precision in formats() else None)
    feeds = _feeds(args, model)
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    ledger = build_ledger(model.proto, target, name=args.model, input_shapes=shapes,
                          throughput=throughput, pinned=pinned,
                          converted=converted.proto if converted else None)
    doc: dict[str, Any] = ledger.to_dict()
    if args.measured:
        from npuprep.ledger.kit import measured_rows, read_results

        results = read_results(args.measured)
        doc["measured"] = {"device": results.get("device"),
                           "rows": [r.to_dict() for r in measured_rows(ledger, results)]}
    if args.export_kit:
        from npuprep.ledger.kit import export_kit

        with outputs.open() as files:
            doc["kit"] = export_kit(files, args.export_kit, models, feeds, ledger)
    if args.json:
        print_json(doc)
        return 0
    _print(doc)
    if args.export_kit:
        say(f"kit written to {args.export_kit}: run time_models.py there (README.md), then "
            "--measured results.json")
    return 0


def _feeds(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    """One sample: sizes dynamic inputs for the FLOPs and feeds the kit (--data, else synthetic)."""
    from npuprep.cli.common import open_samples, synthetic_from_args

    samples = open_samples(args, model.proto) or synthetic_from_args(args, model.proto, 1)
    return dict(next(iter(samples)))


def _ms(value: float | None) -> str:
    from npuprep.formatting import number

    return "unknown" if value is None else number(value)


def _print(doc: dict[str, Any]) -> None:
    from npuprep.formatting import number, percent, ratio

    say(f"Ledger of {doc['model']} on {doc['target']} ({doc['throughput']['unit'] or 'unit not named'})")
    print_table("Estimated time per format", ["format", "est. ms", "vs FP32", "memory-bound time",
                                              "compute/memory nodes", "casts"],
                [(r["format"], _ms(r["estimated_ms"]), ratio(r["speedup_vs_fp32"]),
                  percent(r["memory_bound_share"]),
                  f"{r['compute_bound_nodes']}/{r['memory_bound_nodes']}", r["casts"])
                 for r in doc["formats"]])
    for r in doc["formats"]:
        if r["unknown"]:
            say(f"{r['format']}: unknown: {r['unknown']}")
    pins = doc["pins"]
    if pins is not None:
        if pins["extra_ms"] is None:
            say(f"Pins and casts: {pins['fp32_nodes']} FP32 node(s), {pins['casts']} cast(s); their "
                f"cost is unknown: {pins['unknown']}")
        else:
            say(f"Pins and casts cost {number(pins['extra_ms'])} ms over the same graph "
                f"all in {doc['precision']} "
                f"({percent(pins['extra_share'])} of the converted {number(pins['converted_ms'])} ms): "
                f"{pins['fp32_nodes']} FP32 node(s) take {number(pins['fp32_nodes_ms'])} ms, "
                f"{pins['casts']} cast(s) {number(pins['casts_ms'])} ms")
    rows = doc["costliest"]
    print_table(f"Ten costliest nodes ({doc['costliest_of']})",
                ["node", "op", "format", "GFLOP", "MB", "est. ms", "bound"],
                [(n["node"], n["op_type"], n["format"], number(n["flops"] / 1e9),
                  number(n["bytes"] / 1e6), _ms(n["estimated_ms"]), n["bound"]) for n in rows])
    measured = doc.get("measured")
    if measured:
        print_table("Measured beside estimated", ["model", "est. ms", "median ms", "p90 ms",
                                                  "measured/est.", "peak MB", "gap"],
                    [(r["model"], _ms(r["estimated_ms"]), number(r["median_ms"]), number(r["p90_ms"]),
                      ratio(r["measured_vs_estimated"]), number(r["peak_memory_mb"]),
                      "over 2x" if r["gap_over_2x"] else "")
                     for r in measured["rows"]])
    if not out().quiet:
        say(doc["caveat"])
