"""What a conversion writes: `out.onnx` -> `out.onnx`, `out.plan.yaml`, `out.report.json`, `out.report.md` (+ constraint files asked for).

The model, its plan and its reports always; a FAILED conversion's model as `out.FAILED.onnx`,
never under the requested name, so a deployment script that picks up `out.onnx` never ships
one (an older `out.onnx` goes with the rest of the older set: the reports beside it now say
why this one failed). A compiler's precision-constraint file only for
the target's own compiler (its profile's `compiler.report_format`) or those named in
`exports` (`trt`, `horizon`, `rknn`, `yaml`). `ConversionResult.save` and the CLI both write
through `save_conversion`, so the Python API and `npuprep convert` leave the same files.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from npuprep.errors import NpuprepError

# Export name -> (artefact key in the report, file suffix).
EXPORTS = {
    "trt": ("trtexec", ".trtexec.txt"),
    "horizon": ("horizon_node_info", ".horizon.yaml"),
    "rknn": ("rknn_custom_quantize_layers", ".rknn.yaml"),
    "yaml": ("precision_yaml", ".precision.yaml"),
}
# A profile's compiler report format -> the constraint file its compiler reads.
COMPILER_EXPORT = {"trt_json": "trt", "horizon": "horizon", "rknn": "rknn", "generic": "yaml",
                   "openvino": "yaml"}


def parse_exports(text: str) -> tuple[str, ...]:
    """`trt,horizon` -> ('trt', 'horizon'); `none` -> (); an unknown name is one clear error."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if names == ("none",):
        return ()
    unknown = [n for n in names if n not in EXPORTS]
    if unknown or not names:
        raise NpuprepError(f"--export: unknown '{unknown[0] if unknown else text}' "
                           f"(choose from {', '.join(EXPORTS)}, comma-separated, or none)")
    return names


def default_exports(report_format: str) -> tuple[str, ...]:
    """The constraint file of the target's own compiler."""
    return (COMPILER_EXPORT[report_format],) if report_format in COMPILER_EXPORT else ()


# What each file is called in messages (clashes, refusals).
ROLES = {
    "plan": "the plan written beside -o", "precision_yaml": "the precision YAML written beside -o",
    "trtexec": "the trtexec file written beside -o", "horizon_node_info": "the Horizon file written beside -o",
    "rknn_custom_quantize_layers": "the RKNN file written beside -o",
    "report_json": "the JSON report", "report_md": "the Markdown report written beside -o",
    "report_html": "--html", "vendor_error_analysis": "the vendor's layer report written beside -o",
    "failed_model": "the FAILED model written beside -o",
}


def failed_name(output: str | Path) -> Path:
    """Where a conversion that failed its gates writes its model: `out.onnx` -> `out.FAILED.onnx`."""
    output = Path(output)
    return Path(f"{output.with_suffix('')}.FAILED{output.suffix or '.onnx'}")


def artefact_paths(output: str | Path, *, exports: Sequence[str], report_path: str | Path | None = None,
                   html: str | Path | None = None, vendor: str | None = None) -> dict[str, Path]:
    """Every file a conversion may write, by role, the model first (`failed_model`: where it
    goes instead when the conversion fails)."""
    output = Path(output)
    base = output.with_suffix("")
    paths = {"model": output, "failed_model": failed_name(output), "plan": Path(f"{base}.plan.yaml")}
    for name in exports:
        key, suffix = EXPORTS[name]
        paths[key] = Path(f"{base}{suffix}")
    paths["report_json"] = Path(report_path) if report_path else Path(f"{base}.report.json")
    paths["report_md"] = Path(f"{base}.report.md")
    if html:
        paths["report_html"] = Path(html)
    if vendor:
        # OpenVINO's layer report is its runtime graph's precisions (crosscheck reads it).
        paths["vendor_error_analysis"] = Path(f"{base}.openvino_runtime.json" if vendor == "openvino"
                                              else f"{base}.{vendor}_error_analysis.txt")
    return paths


def declare(outputs: Any, paths: dict[str, Path]) -> None:
    """Tell an OutputPlan (npuprep.output_files) every file of the set, before any work, and
    the files an earlier conversion to the same model wrote that this set does not: they are
    removed with it, so none of them reads as part of the new set."""
    for role, path in paths.items():
        if role in ("model", "failed_model"):
            # One of the two is written (the verdict says which); the other's older copy goes.
            what = "-o" if role == "model" else ROLES[role]
            outputs.writes(path, what, optional=True)
            outputs.writes(f"{path}.data", f"the weights file of {what}", optional=True)
        else:
            outputs.writes(path, ROLES[role])
    if "model" in paths:
        for path, what in older_artefacts(paths):
            outputs.removes_stale(path, what)


# Constraint files a conversion may write beside OUT.onnx.
_COMPANIONS = tuple(suffix for _, suffix in EXPORTS.values())


def older_artefacts(paths: dict[str, Path]) -> list[tuple[Path, str]]:
    """Files of an earlier conversion to `paths["model"]` that this set does not write: those
    its report (`<out>.report.json`, or this run's report path) lists as its own set, and the
    companions beside the model (constraint files) that npuprep wrote for it."""
    import json

    output = paths["model"]
    ours = {p.resolve() for p in paths.values()}
    base = output.with_suffix("")
    found: dict[Path, str] = {}
    for report in dict.fromkeys((Path(f"{base}.report.json"), paths.get("report_json", output))):
        try:
            data = json.loads(report.read_text(encoding="utf-8"))
            listed = data.get("artefacts", {}) if data.get("kind") == "convert" else {}
            mine = Path(str(listed.get("model", ""))).name in (output.name, failed_name(output).name)
        except (OSError, ValueError, AttributeError):
            continue
        if not mine:
            continue
        found[report] = "an older report of this -o"
        for role, path in listed.items():
            older = Path(str(path))
            # Only files beside -o or the report: an older run's relative paths may name
            # another folder from here.
            if role not in ("model", "failed_model") and older.parent.resolve() in (output.parent.resolve(), report.parent.resolve()):
                found[older] = f"an older {ROLES.get(role, role)}"
    for suffix in _COMPANIONS:
        companion = Path(f"{base}{suffix}")
        if companion not in found and _names(companion, output.name):
            found[companion] = "an older file written beside -o for this model"
    return [(p, what) for p, what in found.items() if p.resolve() not in ours and p.is_file()]


def _names(path: Path, model_name: str) -> bool:
    """`path` is a constraint file npuprep wrote for `model_name`: a trtexec line building it,
    or a file that opens with npuprep's header (named after the model by artefact_paths)."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith("# npuprep ") or f"--onnx={model_name}" in head.split("\n", 1)[0]


def stage_conversion(result: Any, paths: dict[str, Path], files: Any,
                     resources: dict[str, Any] | None = None) -> dict[str, Any]:
    """Stage `result` (a ConversionResult) in `files` (an open output set, which puts them in
    place together); return the report, its `artefacts` naming every file of the set.
    `resources`: what the run cost (npuprep.resources.MemoryWatch.to_dict)."""
    from npuprep.json_io import dump_json
    from npuprep.model_io import Model
    from npuprep.names import comment
    from npuprep.plan import PinFp32, dump_plan
    from npuprep.report import constraints
    from npuprep.report.host_scales import host_scales_block
    from npuprep.report.render_md import convert_markdown

    paths = dict(paths)
    # A conversion that failed its gates is never written under the requested name.
    if not result.passed:
        paths["model"] = paths["failed_model"]
    del paths["failed_model"]
    output = paths["model"]
    lowered = result.lowered.model
    files.model(lowered, output)
    report = result.to_dict(output=str(output))
    # Constraint files speak of the lowered model's node names, pins from lowering included.
    low_model = Model(proto=lowered, path=str(output), digest=report["output_fingerprint"])
    plan = result.plan
    extra = sorted(set(result.pinned_nodes) - plan.pinned_nodes())
    if extra:
        from dataclasses import replace

        # Lowering-forced nodes (shape computations, integer lookups, FP32-only types) are told
        # apart from rewriting's: a compiler running them narrower breaks nothing measured.
        lowered_only = set(getattr(result.lowered, "forced_fp32", {}))
        rewriting = tuple(n for n in extra if n not in lowered_only)
        lowering = tuple(n for n in extra if n in lowered_only)
        pins = [PinFp32(nodes=nodes, why=why) for nodes, why in (
            (rewriting, "kept FP32 by rewriting (boundary, range)"),
            (lowering, "kept FP32 by lowering (shape, type or lookup)")) if nodes]
        plan = replace(plan, actions=(*plan.actions, *pins))
    host = host_scales_block(result.host_scales)
    texts = {"plan": dump_plan(result.plan)}
    if "trtexec" in paths:
        flags = constraints.trt_flags(plan, low_model)
        texts["trtexec"] = "\n".join([flags.command_line(output.name), "",
                                      *(f"# {comment(n)}" for n in flags.notes)]) + "\n"
    if "horizon_node_info" in paths:
        texts["horizon_node_info"] = constraints.horizon_node_info(plan, low_model)
    if "rknn_custom_quantize_layers" in paths:
        texts["rknn_custom_quantize_layers"] = constraints.rknn_custom_quantize_layers(plan, low_model) + host
    if "precision_yaml" in paths:
        texts["precision_yaml"] = constraints.precision_yaml(plan, low_model) + host
    vendor = result.vendor
    if vendor is not None and vendor.accuracy_report and "vendor_error_analysis" in paths:
        texts["vendor_error_analysis"] = vendor.accuracy_report
    else:
        paths.pop("vendor_error_analysis", None)  # the report names only files of its set
    for role, text in texts.items():
        files.text(paths[role], text)
    # The report names every file of its set (and the model's fingerprint), so a file
    # left from another run is never taken for part of this one.
    report["artefacts"] = {role: str(path) for role, path in paths.items()}
    if resources is not None:
        report["resources"] = resources
    files.text(paths["report_json"], dump_json(report))
    files.text(paths["report_md"], convert_markdown(report))
    if "report_html" in paths:
        from npuprep.report.render_html import render

        files.text(paths["report_html"], render(report))
    return report


def save_conversion(result: Any, output: str | Path, *, exports: Sequence[str] | None = None,
                    report_path: str | Path | None = None, html: str | Path | None = None,
                    protected: Iterable[str | Path] = ()) -> dict[str, Any]:
    """Write `result` (a ConversionResult) as `output` and its artefacts, as one set (see
    npuprep.output_files); return the report dict. `exports` None: the target compiler's
    constraint file. `protected` paths (the input model) are never overwritten."""
    from npuprep.output_files import OutputPlan

    if exports is None:
        exports = default_exports(result.profile.report_format)
    paths = artefact_paths(output, exports=exports, report_path=report_path, html=html,
                           vendor=result.vendor.vendor if result.vendor is not None else None)
    outputs = OutputPlan()
    for path in protected:
        outputs.reads_model(path)
    declare(outputs, paths)
    with outputs.open() as files:
        return stage_conversion(result, paths, files)
