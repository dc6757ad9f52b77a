"""`npuprep probe [MODEL] --target T`: loud or silent overflow, per unit, locally or on a board (kit)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from npuprep.cli.common import (
    add_data,
    add_json,
    fmt,
    out,
    positive_float,
    print_json,
    print_table,
    progress_stages,
    say,
)

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from npuprep.model_io import Model
    from npuprep.probe.layer import LayerProbe

help = "measure how the target overflows (inf, nan, saturate, other): locally or via a board kit"

SCHEMA_VERSION = 1
BACKENDS = ("emulate", "ort", "ort-fp32-io", "rknn", "openvino")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="ONNX model for the single-layer probe (none: micro-probes)")
    p.add_argument("--target", "-t", help="built-in profile name or profile YAML path")
    # The number format is --precision, as in check and convert; --format is still read (hidden).
    p.add_argument("--format", dest="fmt", help=argparse.SUPPRESS)
    p.add_argument("--precision", dest="fmt", help="format to probe (default: the profile's "
                                                  "default_precision), e.g. fp8_e4m3 on an FP16+FP8 target")
    p.add_argument("--layer", help="node name or output tensor of the layer to amplify")
    p.add_argument("--gain", type=positive_float, default=100.0, help="weight gain (default 100)")
    p.add_argument("--fixed-gain", action="store_true",
                   help="use --gain as given instead of raising it until the output overflows")
    p.add_argument("--backend", choices=BACKENDS, default="emulate",
                   help="emulate: profile semantics; ort: FP16 model on onnxruntime, tensors stored "
                        "in FP16; ort-fp32-io: same with FP32 outputs (shows wider compute); "
                        "rknn: rknn-toolkit2's FP16 build in its simulator (--vendor-python); "
                        "openvino: OpenVINO's CPU plugin, the format as its precision hint")
    p.add_argument("--vendor-python", metavar="PATH",
                   help="python of the rknn-toolkit2 venv (default: $NPUPREP_RKNN_PYTHON, then "
                        "~/.cache/npuprep/rknn-venv)")
    p.add_argument("--micro", action="store_true", help="also run the micro-probes with a MODEL")
    p.add_argument("--probes", help="comma-separated micro-probes to run (default: all)")
    p.add_argument("--export-kit", metavar="DIR", help="write a board kit instead of running")
    p.add_argument("--classify", metavar="DIR", help="classify board outputs against the kit in DIR")
    p.add_argument("--outputs", metavar="OUT", help="board outputs for --classify")
    p.add_argument("--write-profile", metavar="P", help="write a copy of the target profile with the "
                                                         "measured overflow behaviour")
    add_data(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from npuprep.errors import NpuprepError

    _check_outputs(args)
    if args.classify or args.outputs:
        if not (args.classify and args.outputs):
            raise NpuprepError("--classify DIR and --outputs OUT go together")
        return _classify(args)
    if not args.target:
        raise NpuprepError("--target is required (a built-in profile name or a YAML path)")
    if (args.fmt or "") == "int8":
        return _run_int8(args)
    if args.export_kit:
        return _export(args)
    return _run_local(args)


def _run_int8(args: argparse.Namespace) -> int:
    """INT8 has no overflow of its own: the probe is its quantiser's clipping (probe/int8_clip)."""
    from npuprep.errors import NpuprepError
    from npuprep.probe.int8_clip import run_clip_probe

    if args.model or args.export_kit or args.write_profile:
        raise NpuprepError("--precision int8 runs the INT8 clipping probe only (no MODEL, "
                           "--export-kit or --write-profile)")
    if args.backend not in ("emulate", "rknn", "openvino"):
        raise NpuprepError(f"--precision int8 runs on --backend emulate, rknn or openvino, not "
                           f"{args.backend}")
    profile = _profile(args)
    result = run_clip_probe(args.backend, python=args.vendor_python)
    basis = "QDQ semantics (emulated)" if args.backend == "emulate" else f"measured ({args.backend})"
    doc = {"schema_version": SCHEMA_VERSION, "kind": "probe", "fingerprint": "",
           "target": profile.name, "format": "int8", "backend": result.backend, "basis": basis,
           "probes": [result.to_dict()], "overall": {"verdict": result.verdict,
                                                    "reason": result.reason}}
    if args.json:
        print_json(doc)
        return 0
    evidence = ", ".join(f"{fmt(a)} -> {fmt(b)}" for a, b in result.pairs[:2])
    print_table(f"INT8 clipping probe: {profile.name} on {result.backend}, {basis}",
                ["probe", "verdict", "calibrated |x|", "ref -> observed", "in-range max abs err"],
                [("int8_clip", result.verdict, fmt(result.calibrated), evidence,
                  fmt(result.in_range_error))])
    say(f"overall: {result.verdict} ({result.reason}; {basis})", always=True)
    return 0


def _check_outputs(args: argparse.Namespace) -> None:
    """--write-profile and --export-kit against every file probe reads, before any probing."""
    from npuprep.output_files import SAMPLE_FILES, OutputPlan

    outputs = OutputPlan()
    outputs.reads_model(args.model)
    outputs.reads(args.data, "the --data samples", SAMPLE_FILES)
    outputs.reads(args.classify, "the --classify kit")
    outputs.reads(args.outputs, "the --outputs folder")
    outputs.reads_profile(args.target)
    if args.write_profile:
        outputs.writes(args.write_profile, "--write-profile")
    if args.export_kit:
        outputs.writes_folder(args.export_kit, "--export-kit")
    outputs.check()


def _profile(args: argparse.Namespace):
    from npuprep.profiles import load_profile

    return load_profile(args.target)


def _format(args: argparse.Namespace, profile: Any):
    """The format to probe, resolved once: --precision, else the profile's default."""
    return profile.resolve(args.fmt).fmt


def _declared_saturate(profile: Any, fmt_: Any) -> bool | None:
    """What the profile declares for `fmt_`: True/False, or None where it does not know."""
    from npuprep.profiles import OverflowMode

    if fmt_.name.startswith("fp8"):
        return profile.fp8_saturate
    if profile.overflow is OverflowMode.UNKNOWN:
        return None
    return profile.overflow is OverflowMode.SATURATE


def _names(args: argparse.Namespace) -> tuple[str, ...] | None:
    return tuple(n.strip() for n in args.probes.split(",") if n.strip()) if args.probes else None


def _feeds(args: argparse.Namespace, model: Model) -> dict[str, np.ndarray]:
    from npuprep.cli.common import open_samples, synthetic_from_args

    samples = open_samples(args, model.proto) or synthetic_from_args(args, model.proto, 1)
    return next(iter(samples))


def _data_said(args: argparse.Namespace, proto: onnx.ModelProto) -> str:
    """What the layer probe ran on; without --data, one random sample, said so (the verdict
    then speaks of that input, not of the model's real range)."""
    if args.data:
        return f"the first sample of {args.data}"
    from npuprep.data import input_specs

    shapes = ", ".join(f"{s.name} {'x'.join(str(d or 1) for d in s.shape)}" for s in input_specs(proto))
    return (f"no --data: one synthetic sample ({shapes}); the layer's real range needs --data "
            "(the verdict below is that input's)")


def _backend(args: argparse.Namespace, profile: Any, fmt_: Any):
    from npuprep.errors import NpuprepError
    from npuprep.probe.backends import EmulateBackend, OrtBackend

    if args.backend == "rknn":
        from npuprep.probe.rknn_backend import RknnBackend

        if fmt_.name != "fp16":
            raise NpuprepError(f"--backend rknn builds FP16 (do_quantization=False); it cannot "
                               f"probe {fmt_.name}")
        return RknnBackend(args.vendor_python)
    if args.backend == "openvino":
        from npuprep.probe.openvino_backend import OpenvinoBackend
        from npuprep.vendors.openvino import HINTS

        if fmt_.name not in HINTS:
            # Its hint would fall back to another format and probe that one instead.
            raise NpuprepError(f"--backend openvino has no precision hint for {fmt_.name} "
                               f"(it runs {', '.join(HINTS)}); it cannot probe {fmt_.name}")
        return OpenvinoBackend(fmt_.name)
    if args.backend == "emulate":
        # Unknown is emulated as the loud case (as ResolvedTarget.saturate does); the note says so.
        return EmulateBackend(fmt_, saturate=bool(_declared_saturate(profile, fmt_)))
    return OrtBackend(fmt_, io="fp16" if args.backend == "ort" else "fp32")


def _run_local(args: argparse.Namespace) -> int:
    from npuprep.errors import NpuprepError
    from npuprep.model_io import anchored, load_model
    from npuprep.probe.layer import probe_layer
    from npuprep.probe.runner import ProbeReport, run_micro_probes

    profile = _profile(args)
    fmt_ = _format(args, profile)
    if args.write_profile and _basis(args, profile, fmt_) == ASSUMED:
        raise NpuprepError(f"--write-profile: profile '{profile.name}' does not know its {fmt_.name} overflow "
                           "mode and --backend emulate only assumes one; measure it on the board "
                           "(--export-kit DIR, run the kit there, then --classify DIR --outputs OUT)"
                           + (" or with --backend rknn" if profile.report_format == "rknn" else ""))
    backend = _backend(args, profile, fmt_)
    results = []
    layer = None
    fingerprint = ""
    with progress_stages("probing", not args.json) as stage:
        if args.model:
            stage("loading the model")
            model = anchored(load_model(args.model, weights="file"))
            fingerprint = model.fingerprint
            layer = probe_layer(model.proto, _feeds(args, model), fmt_, backend, layer=args.layer,
                                gain=args.gain, raise_gain=not args.fixed_gain, progress=stage)
            results.append(layer.result)
        if not args.model or args.micro:
            stage("micro-probes")
            results += run_micro_probes(backend, fmt_, _names(args)).results
    report = ProbeReport(fmt_, backend.name, tuple(results))
    basis = _basis(args, profile, fmt_)
    doc = {
        "schema_version": SCHEMA_VERSION, "kind": "probe", "fingerprint": fingerprint,
        "target": profile.name, "profile_overflow": str(profile.overflow),
        **report.to_dict(), "layer": layer.to_dict() if layer else None,
        "emulated_saturate": bool(_declared_saturate(profile, fmt_)) if args.backend == "emulate" else None,
        "note": _note(args, profile, fmt_), "basis": basis,
        "data": _data_said(args, model.proto) if args.model else "",
    }
    if (downstream := _shown_downstream(layer)) is not None:
        doc["overall"] = _overall_with_downstream(results, downstream)
    if args.write_profile:
        from npuprep.probe.kit import write_profile

        write_profile(args.write_profile, profile, list(results), backend.name, fmt_,
                      basis="emulated" if args.backend == "emulate" else "measured")
    _show(args, doc, layer)
    return 0


ASSUMED = "assumed (emulated)"


def _basis(args: argparse.Namespace, profile: Any, fmt_: Any) -> str:
    """Whether the verdicts are measured, or replay what the profile declares or assumes."""
    if args.backend != "emulate":
        return f"measured ({args.backend})"
    return ASSUMED if _declared_saturate(profile, fmt_) is None else "declared (emulated)"


def _note(args: argparse.Namespace, profile: Any, fmt_: Any) -> str:
    """Emulation only replays what the profile declares; say so when that is a guess."""
    if args.backend != "emulate":
        return ""
    declared = _declared_saturate(profile, fmt_)
    if declared is None:
        return (f"profile '{profile.name}' does not know its {fmt_.name} overflow mode; emulation assumes "
                "the loud case. Measure the board: npuprep probe --export-kit DIR --target ...")
    return f"emulation replays the profile's declared behaviour ({'saturate' if declared else 'loud'})"


def _export(args: argparse.Namespace) -> int:
    from npuprep.model_io import anchored, load_model
    from npuprep.probe.kit import export_kit
    from npuprep.probe.layer import layer_probe_model
    from npuprep.probe.micro import micro_probes

    profile = _profile(args)
    fmt_ = _format(args, profile)
    probes = []
    fingerprint = ""
    if args.model:
        model = anchored(load_model(args.model, weights="file"))
        fingerprint = model.fingerprint
        probe, *_ = layer_probe_model(model.proto, _feeds(args, model), fmt_, layer=args.layer,
                                      gain=args.gain, raise_gain=not args.fixed_gain)
        probes.append(probe)
    probes += micro_probes(fmt_, _names(args))
    manifest = export_kit(args.export_kit, probes, fmt_, target=args.target, fingerprint=fingerprint,
                          runner="rknn" if args.backend == "rknn" else "")
    if args.json:
        print_json(manifest)
    else:
        print(f"probe kit for {profile.name} ({fmt_.name}): {len(manifest['probes'])} probes in "
              f"{args.export_kit}; steps in {Path(args.export_kit) / 'README.md'}")
    return 0


def _classify(args: argparse.Namespace) -> int:
    from npuprep.probe.kit import classify_kit, write_profile
    from npuprep.profiles import load_profile

    manifest, report = classify_kit(args.classify, args.outputs)
    doc = {"schema_version": SCHEMA_VERSION, "kind": "probe", "fingerprint": manifest.get("fingerprint", ""),
           "target": manifest.get("target", ""), **report.to_dict(), "layer": None,
           "basis": f"measured ({report.backend})"}
    if args.write_profile:
        profile = load_profile(args.target or manifest.get("target", ""))
        write_profile(args.write_profile, profile, list(report.results), report.backend, report.fmt)
    _show(args, doc, None)
    return 0


def _shown_downstream(layer: LayerProbe | None) -> dict[str, Any] | None:
    """Where the amplified layer's own output stays in range (its weights allow no larger
    gain) but a tensor after it overflows: that tensor's behaviour, which is the probe's
    finding. None when the layer itself overflowed, nothing did, or the model overflows
    without the probe."""
    from npuprep.probe.classify import Verdict

    first = None if layer is None else layer.first_shows
    if not first or layer.pre_existing or layer.verdict != Verdict.NO_OVERFLOW:
        return None
    return first if Verdict(first["verdict"]).conclusive else None


def _overall_with_downstream(results: list[Any], downstream: dict[str, Any]) -> dict[str, Any]:
    """The overall verdict with the layer probe judged where its overflow shows."""
    from npuprep.probe.classify import Verdict, overall

    name = f"layer (downstream, at {downstream['tensor']})"
    verdicts = [(name, Verdict(downstream["verdict"]))]
    verdicts += [(r.name, r.classification.verdict) for r in results[1:]]
    return overall(verdicts).to_dict()


def _show(args: argparse.Namespace, doc: dict[str, Any], layer: LayerProbe | None) -> None:
    if args.json:
        print_json(doc)
        return
    assumed = doc.get("basis") == ASSUMED
    if doc.get("data", "").startswith("no --data"):
        say(f"note: {doc['data']}")
    full = out().verbose or out().width is None
    rows = []
    for p in doc["probes"]:
        pair = p["pairs"][0] if p["pairs"] else None
        evidence = f"{fmt(pair['reference'])} -> {fmt(pair['observed'])}" if pair else ""
        verdict = ("in range" if p["name"] == "layer" and _shown_downstream(layer) else p["verdict"]) \
            + (" (wider)" if p["wider"] else "") + (" (assumed)" if assumed else "")
        rows.append((p["name"], p["unit"], verdict, p["counts"]["over"], evidence,
                     *([p["reason"]] if full else [])))
    print_table(f"Overflow probe: {doc.get('target', '')} {doc['format']} on {doc['backend']}, "
                f"{doc.get('basis') or 'measured'}",
                ["probe", "unit", "verdict", "over", "ref -> observed", *(["why"] if full else [])], rows)
    if layer is not None:
        first = layer.first_shows
        where = (f"first shows at tensor '{first['tensor']}' ({first['op_type']} '{first['node']}'): "
                 f"{first['verdict']}") if first else "no tensor shows an overflow behaviour"
        if _shown_downstream(layer):
            where = (f"its own output stays in range (max |x| {fmt(layer.result.classification.reference_absmax)}"
                     f" < {fmt(doc['threshold'])}); the overflow {where.replace('first shows', 'shows downstream')}")
        say(f"layer '{layer.layer.node}' x{layer.gain:g} (max gain {fmt(layer.max_gain)}); {where}")
        pre = layer.pre_existing
        if pre:
            say(f"the model overflows without the probe too: first at tensor '{pre['tensor']}' "
                f"({pre['op_type']} '{pre['node']}'): {pre['verdict']}")
    if doc.get("note"):
        say(f"note: {doc['note']}")
    o = doc["overall"]
    if assumed:
        say(f"overall: {ASSUMED}: {o['verdict']} is the emulator's assumption, not a measurement",
            always=True)
    else:
        say(f"overall: {o['verdict']} ({o['reason']}; {doc.get('basis') or 'measured'})", always=True)
