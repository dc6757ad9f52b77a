"""What a conversion writes: `out.onnx` -> `out.onnx`, `out.plan.yaml`, `out.report.json`, `out.report.md` (+ constraint files asked for).

The model, its plan and its reports always; a compiler's precision-constraint file only for
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
COMPILER_EXPORT = {"trt_json": "trt", "horizon": "horizon", "rknn": "rknn", "generic": "yaml"}


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


def save_conversion(result: Any, output: str | Path, *, exports: Sequence[str] | None = None,
                    report_path: str | Path | None = None, html: str | Path | None = None,
                    protected: Iterable[str | Path] = ()) -> dict[str, Any]:
    """Write `result` (a ConversionResult) as `output` and its artefacts; return the report dict.

    `exports` None: the target compiler's constraint file. Every file is written atomically;
    `protected` paths (the input model) are never overwritten.
    """
    from npuprep.cli.common import dump_json
    from npuprep.model_io import Model, save_model, write_text_atomic
    from npuprep.plan import PinFp32, save_plan
    from npuprep.report import constraints
    from npuprep.report.render_md import convert_markdown

    output = Path(output)
    if exports is None:
        exports = default_exports(result.profile.report_format)
    base = output.with_suffix("")
    report_path = Path(report_path) if report_path else Path(f"{base}.report.json")
    lowered = result.lowered.model
    save_model(lowered, output, protected=tuple(protected))
    report = result.to_dict(output=str(output))
    artefacts: dict[str, str] = {"model": str(output),
                                 "plan": str(save_plan(result.plan, f"{base}.plan.yaml"))}
    if exports:
        # Constraint files speak of the lowered model's node names, pins from lowering included.
        low_model = Model(proto=lowered, path=str(output), digest=report["output_fingerprint"])
        plan = result.plan
        extra = sorted(set(result.pinned_nodes) - plan.pinned_nodes())
        if extra:
            from dataclasses import replace

            pin = PinFp32(nodes=tuple(extra), why="kept FP32 by rewriting or lowering (boundary, range)")
            plan = replace(plan, actions=(*plan.actions, pin))
        for name in exports:
            key, suffix = EXPORTS[name]
            if name == "trt":
                flags = constraints.trt_flags(plan, low_model)
                text = "\n".join([flags.command_line(output.name), "", *(f"# {n}" for n in flags.notes)]) + "\n"
            elif name == "horizon":
                text = constraints.horizon_node_info(plan, low_model)
            elif name == "rknn":
                text = constraints.rknn_custom_quantize_layers(plan, low_model)
            else:
                text = constraints.precision_yaml(plan, low_model)
            artefacts[key] = str(write_text_atomic(f"{base}{suffix}", text))
    report["artefacts"] = artefacts | {"report_json": str(report_path), "report_md": f"{base}.report.md"}
    if html:
        report["artefacts"]["report_html"] = str(html)
    write_text_atomic(report_path, dump_json(report))
    write_text_atomic(f"{base}.report.md", convert_markdown(report))
    if html:
        from npuprep.report.render_html import write_html

        write_html(report, html)
    return report
