"""`npuprep report RESULT.json -o report.html`: one self-contained HTML page from a result JSON."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from npuprep import json_io
from npuprep.errors import NpuprepError
from npuprep.names import shown

if TYPE_CHECKING:
    import onnx

help = "render any command's --json (check, calibrate, compare, convert, crosscheck, probe) as one HTML page"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("result", help="result JSON written by a command's --json (check, calibrate, compare, "
                                  "convert, crosscheck, probe)")
    p.add_argument("-o", "--output", required=True, help="HTML file to write")
    p.add_argument("--model", "-m", help="the model the result belongs to: puts a stats file's "
                   "tensors (stored by name) in topological order")
    p.add_argument("--no-plots", action="store_true", help="tables only, no charts")


def load_result(path: str | Path) -> dict[str, Any]:
    """A result JSON object; a missing file or bad JSON is one NpuprepError."""
    path = Path(path)
    data = json_io.read_json(path, "result file")
    if not isinstance(data, dict) or "kind" not in data:
        raise NpuprepError(f"{path}: not an npuprep result (no 'kind' key)")
    return data


def write_html(result: Any, path: str | Path, *, plots: bool = True,
               order: list[str] | tuple[str, ...] = ()) -> Path:
    """Render a result dict as HTML and write it atomically (for `--html` on other commands)."""
    from npuprep.report.render_html import write_html as _write

    return _write(result, path, plots=plots, order=order)


def tensor_order(model: onnx.ModelProto) -> list[str]:
    """Every tensor name of `model` in topological order, bodies after their
    graph: graph inputs, then each node's outputs."""
    from npuprep.graph import topological_order, walk_graphs

    names: list[str] = []
    for scope in walk_graphs(model.graph):
        names.extend(i.name for i in scope.graph.input)
        names.extend(o for n in topological_order(scope.graph) for o in n.output if o)
    return list(dict.fromkeys(names))


def run(args: argparse.Namespace) -> int:
    from npuprep.output_files import OutputPlan
    from npuprep.report.render_html import render

    outputs = OutputPlan()
    outputs.reads(args.result, "the result JSON")
    outputs.reads_model(args.model)
    outputs.writes(args.output, "-o")
    outputs.check()
    result = load_result(args.result)
    order: list[str] = []
    if args.model:
        from npuprep.model_io import load_model

        model = load_model(args.model)
        if result.get("fingerprint") and result["fingerprint"] != model.fingerprint:
            raise NpuprepError(f"{args.result}: belongs to the model with fingerprint "
                               f"{result['fingerprint']}, not {args.model} ({model.fingerprint})")
        order = tensor_order(model.proto)
    try:
        page = render(result, plots=not args.no_plots, order=order)
    except NpuprepError as exc:
        raise NpuprepError(f"{args.result}: {exc}") from None
    with outputs.open() as files:
        files.text(args.output, page)
    print(f"wrote {shown(args.output)}")
    return 0
