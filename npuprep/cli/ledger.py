"""`npuprep ledger MODEL --target T [CONVERTED | --plan P]`: what each format and each pin buys (estimate)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from npuprep.cli.common import add_data, add_json, add_target, out, print_json, print_table, say

if TYPE_CHECKING:
    import onnx

    from npuprep.ledger.kit import Kit
    from npuprep.ledger.ledger import Ledger
    from npuprep.model_io import Model
    from npuprep.profiles import TargetProfile, Throughput
    from npuprep.provenance import ConversionRecord

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
    p.add_argument("--measured", metavar="RESULTS", action="append",
                   help="the kit's results.json: measured beside estimated, gaps over 2x flagged, "
                        "and the sustained efficiency per format and the launch cost per op class "
                        "fitted; repeat it with other models' results.json, each in its own kit "
                        "folder, to fit them all at once")
    p.add_argument("--fit-on", choices=("median", "min"), default="median",
                   help="with --measured: the statistic the fit matches (min on a loaded machine, "
                        "where the median is the scheduler's)")
    p.add_argument("--fitted-profile", metavar="YAML", help="with --measured: write the target's "
                                                            "profile with the fitted figures here "
                                                            "(pass it back with --target)")
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
    for path in args.measured or []:
        outputs.reads(path, "the --measured results")
    outputs.reads(args.data, "the --data samples", SAMPLE_FILES)
    outputs.reads_profile(args.target)
    if args.fitted_profile:
        if not args.measured:
            raise NpuprepError("--fitted-profile needs --measured (the results it is fitted on)")
        outputs.writes(args.fitted_profile, "the --fitted-profile file")
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
    converted_trt: list[str] = ["--fp16"]
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
        if record is not None:
            pinned, converted_trt = _recorded_pins(record, converted)
    target = profile.resolve(precision if precision in formats() else None)
    feeds = _feeds(args, model)
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    ledger = build_ledger(model.proto, target, name=args.model, input_shapes=shapes,
                          throughput=throughput, pinned=pinned,
                          converted=converted.proto if converted else None)
    doc: dict[str, Any] = ledger.to_dict()
    fitted_profile = None
    if args.measured:
        fitted_profile = _measured(args, doc, ledger, models, profile, throughput)
    if args.export_kit or fitted_profile is not None and args.fitted_profile:
        with outputs.open() as files:
            if args.export_kit:
                from npuprep.ledger.kit import export_kit

                doc["kit"] = export_kit(files, args.export_kit, models, feeds, ledger, converted_trt)
            if fitted_profile is not None and args.fitted_profile:
                import yaml

                files.text(args.fitted_profile, yaml.safe_dump(fitted_profile.to_dict(),
                                                               sort_keys=False, width=100))
                doc["fitted_profile"] = args.fitted_profile
    if args.json:
        print_json(doc)
        return 0
    _print(doc)
    if args.export_kit:
        say(f"kit written to {args.export_kit}: run time_models.py there (README.md), then "
            "--measured results.json")
    return 0


def _measured(args: argparse.Namespace, doc: dict[str, Any], ledger: Ledger,
              models: dict[str, onnx.ModelProto], profile: TargetProfile,
              throughput: Throughput) -> TargetProfile | None:
    """`--measured`: the model's own results beside its estimate; every kit's rows fitted at
    once (ledger/fit.py); the profile with the fitted figures, None where nothing fits."""
    from dataclasses import replace
    from pathlib import Path

    from npuprep.ledger.fit import METHOD, fit_points, fit_throughput
    from npuprep.ledger.kit import check_results, measured_on, measured_rows, read_kit, read_results

    statistic = f"{args.fit_on}_ms"
    first = args.measured[0]
    results = read_results(first)
    check_results(results, first, models)
    points = fit_points(Path(args.model).stem, ledger, results, statistic)
    kits = [{"kit": Path(args.model).stem, "results": str(first), "measured_on": measured_on(results)}]
    for path in args.measured[1:]:
        other = read_results(path)
        kit = read_kit(path, other)
        name = Path(kit.model).stem
        points += fit_points(name, _kit_ledger(kit, profile, throughput), other, statistic)
        kits.append({"kit": name, "results": str(path), "measured_on": measured_on(other)})
    fit = fit_throughput(points, throughput, statistic)
    doc["measured"] = {"device": results.get("device"), "measured_on": measured_on(results),
                       "estimated_for": profile.throughput.unit or profile.name, "kits": kits,
                       "rows": [r.to_dict() for r in measured_rows(ledger, results)],
                       "fit": fit.to_dict() if fit else None}
    if fit is None:
        return None
    given = ", ".join([*(f"--peak {f}={v}" for f, v in args.peak),
                       *([f"--bandwidth {args.bandwidth}"] if args.bandwidth else [])])
    on = "; ".join(dict.fromkeys(k["measured_on"] for k in kits))
    classes = ", ".join(f"{c} {v:.4g}" for c, v in fit.launch_us_by_class.items())
    sources = {**profile.sources,
               **({"peak": f"set on the command line ({given})"} if args.peak else {}),
               **({"bandwidth": f"set on the command line ({given})"} if args.bandwidth else {}),
               "efficiency": (
        f"Fitted by npuprep ledger --measured on {', '.join(fit.kits)} ({on}), {fit.statistic}, "
        f"{METHOD}: efficiency divided by {', '.join(f'{f} {s:.4g}' for f, s in fit.scales.items())}; "
        f"launch us per node {classes} (others {fit.launch_us:.4g}); {fit.run_us:.4g} us per run")}
    return replace(profile, throughput=fit.throughput, sources=sources)


def _kit_ledger(kit: Kit, profile: TargetProfile, throughput: Throughput) -> Ledger:
    """The ledger of a further kit's models, at its own input sizes, in its conversion's format."""
    from npuprep.ledger.formats import stored_precision
    from npuprep.ledger.ledger import build_ledger
    from npuprep.numerics import formats
    from npuprep.provenance import read_conversion

    converted = kit.models.get("converted")
    precision = None
    if converted is not None:
        record = read_conversion(converted)
        precision = record.precision if record is not None else stored_precision(converted)
    target = profile.resolve(precision if precision in formats() else None)
    return build_ledger(kit.models["fp32"], target, name=kit.model, input_shapes=kit.input_shapes,
                        throughput=throughput, converted=converted)


def _recorded_pins(record: ConversionRecord, converted: Model) -> tuple[list[str], list[str]]:
    """The FP32 pins of the plan a conversion records (npuprep.provenance), verification's
    included: the ledger names the pins convert made; and the trtexec flags convert writes
    for them (the kit builds the converted model with its precision constraints)."""
    from npuprep.plan.plan import Plan
    from npuprep.provenance import RECORD_KEY
    from npuprep.report.constraints import trt_flags

    plan = Plan.from_dict(record.plan, f"{converted.path}: metadata {RECORD_KEY}: plan")
    return sorted(plan.pinned_nodes()), list(trt_flags(plan, converted).args)


def _feeds(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    """One sample: sizes dynamic inputs for the FLOPs and feeds the kit (--data, else synthetic)."""
    from npuprep.cli.common import open_samples, synthetic_from_args

    if not args.data:
        _refuse_symbolic_dims(args, model)
    samples = open_samples(args, model.proto) or synthetic_from_args(args, model.proto, 1)
    return dict(next(iter(samples)))


def _refuse_symbolic_dims(args: argparse.Namespace, model: Model) -> None:
    """Without --data, a dim no --input-shape sizes would be costed at 1: refused instead (a
    detector at 1x1 pixels is estimated 500x too fast)."""
    from npuprep.errors import NpuprepError

    sized = dict(args.input_shape or [])
    weights = {i.name for i in model.proto.graph.initializer}
    open_dims = []
    for vi in model.proto.graph.input:
        if vi.name in weights or vi.name in sized or not vi.type.HasField("tensor_type"):
            continue
        dims = vi.type.tensor_type.shape.dim
        open_dims += [f"{vi.name}[{i}]={d.dim_param or '?'}" for i, d in enumerate(dims)
                      if not d.HasField("dim_value")]
    if open_dims:
        raise NpuprepError(f"{model.path}: symbolic dims {', '.join(open_dims)} have no size: give "
                           "--data (a real sample) or --input-shape NAME:DIMS")


def _ms(value: float | None) -> str:
    from npuprep.formatting import number

    return "unknown" if value is None else number(value)


def _speedup(row: dict[str, Any]) -> str:
    """`9.7x`, or `1.3-12x` where only a range is known."""
    from npuprep.formatting import ratio

    span = row.get("speedup_range")
    if row["speedup_vs_fp32"] is None and span:
        low, high = ratio(span[0]), ratio(span[1])
        return low if low == high else f"{low[:-1]}-{high}"
    return ratio(row["speedup_vs_fp32"])


def _print(doc: dict[str, Any]) -> None:
    from npuprep.formatting import number, percent, ratio

    say(f"Ledger of {doc['model']} on {doc['target']} ({doc['throughput']['unit'] or 'unit not named'})")
    print_table("Estimated time per format", ["format", "est. ms", "vs FP32", "memory-bound time",
                                              "compute/memory nodes", "casts"],
                [(r["format"], _ms(r["estimated_ms"]), _speedup(r),
                  percent(r["memory_bound_share"]),
                  f"{r['compute_bound_nodes']}/{r['memory_bound_nodes']}", r["casts"])
                 for r in doc["formats"]])
    for r in doc["formats"][1:]:
        say(f"{r['format']}: {r['why']}")
    tf32 = next((r for r in doc["formats"] if r["format"] == "tf32"), None)
    row = next((r for r in doc["formats"] if r["format"] == doc["precision"]), None)
    if tf32 is not None and row is not None and (row["speedup_vs_tf32"] or
                                                 row.get("speedup_vs_tf32_range")):
        span = row.get("speedup_vs_tf32_range")
        value = (ratio(row["speedup_vs_tf32"]) if row["speedup_vs_tf32"] else
                 _speedup({"speedup_vs_fp32": None, "speedup_range": span}))
        say(f"{doc['precision']} over TF32 (what FP32 Conv/MatMul run as by default there): {value}")
    if doc["unsized_tensors"]:
        names = doc["unsized_tensors"]
        say(f"{len(names)} tensor(s) without an inferred shape count as one element each "
            f"(first: {', '.join(names[:3])}); --input-shape or static shapes size them")
    if any(r["unknown"] for r in doc["formats"]):
        say(f"times unknown: {next(r['unknown'] for r in doc['formats'] if r['unknown'])}")
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
        say(f"Measured with {measured['measured_on']}; estimated for {measured['estimated_for']}: "
            "a gap between two machines is the machines', not the model's")
        print_table("Measured beside estimated", ["model", "est. ms", "median ms", "p90 ms",
                                                  "measured/est.", "peak MB", "gap"],
                    [(r["model"], _ms(r["estimated_ms"]), number(r["median_ms"]), number(r["p90_ms"]),
                      ratio(r["measured_vs_estimated"]), number(r["peak_memory_mb"]),
                      "over 2x" if r["gap_over_2x"] else "")
                     for r in measured["rows"]])
        fit = measured["fit"]
        if fit:
            say(f"Fit over {len(fit['rows'])} rows of {', '.join(fit['kits'])} "
                f"({fit['fitted_on']}): sustained efficiency "
                + ", ".join(f"{f} x{number(v)}" for f, v in fit["efficiency_scale"].items()))
            say("launch per node: " + ", ".join(f"{c} {number(v)} us" for c, v in
                                                fit["launch_us_by_class"].items())
                + f"; per run {number(fit['run_us'])} us")
            for fmt in fit["efficiency_unbounded"]:
                say(f"{fmt}: the rows put its time under the launch costs; its efficiency is the "
                    "fit's ceiling (1000x the profile's), not a measurement")
            print_table("Fitted beside measured", ["kit", "row", "measured ms", "before fit ms",
                                                   "fitted ms", "fitted/measured"],
                        [(r["kit"], r["model"], number(r["measured_ms"]), number(r["estimated_ms"]),
                          number(r["fitted_ms"]), f"{r['fitted_vs_measured']:.2f}")
                         for r in fit["rows"]])
        if doc.get("fitted_profile"):
            say(f"fitted profile written to {doc['fitted_profile']}: pass it back with --target")
    if not out().quiet:
        say(doc["caveat"])
