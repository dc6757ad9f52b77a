"""Pick a report reader (by --report-format or by looking at the file) and run it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from npuprep import json_io
from npuprep.crosscheck import horizon, openvino, rknn
from npuprep.crosscheck.generic import read_generic_csv, read_generic_json
from npuprep.crosscheck.names import NodeIndex
from npuprep.crosscheck.record import CompilerReport, malformed
from npuprep.crosscheck.trt_json import read_trt_json
from npuprep.errors import NpuprepError

FORMATS = ("auto", "trt_json", "generic", "horizon", "rknn", "openvino")

# How to obtain each report; the checklist and error messages quote these.
HOW_TO_GET = {
    "trt_json": "trtexec --onnx={model} --fp16 --profilingVerbosity=detailed "
                "--exportLayerInfo={report}",
    "horizon": "hb_mapper makertbin --config config.yaml --model-type onnx 2>&1 | tee {report}",
    "rknn": "rknn.accuracy_analysis(inputs=[...], output_dir='snapshot') "
            "(report: snapshot/error_analysis.txt)",
    "openvino": "npuprep crosscheck {model} --vendor openvino --target openvino-cpu "
                "--save-report {report}",
    "generic": "ask the compiler vendor for the per-node precision list as CSV 'node,precision'",
}
DEFAULT_REPORT_NAME = {
    "trt_json": "layers.json", "horizon": "hb_mapper_makertbin.log",
    "rknn": "snapshot/error_analysis.txt", "generic": "precision.csv",
    "openvino": "openvino_runtime.json",
}


def read_report(path: str | Path, index: NodeIndex, fmt: str = "auto") -> CompilerReport:
    """The records of one compiler report; `fmt` is one of FORMATS."""
    path = Path(path)
    if fmt not in FORMATS:
        raise NpuprepError(f"unknown report format '{fmt}' (use {', '.join(FORMATS)})")
    if not path.is_file():
        raise NpuprepError(f"{path}: report file not found")
    try:
        text = path.read_text(encoding="utf-8-sig")  # spreadsheet exports start with a BOM
    except UnicodeDecodeError:
        raise NpuprepError(f"{path}: not a UTF-8 text file") from None
    name = str(path)
    if fmt == "auto":
        fmt = detect_format(name, text)
    if fmt == "trt_json":
        return read_trt_json(name, _json(name, text), index)
    if fmt == "horizon":
        return horizon.read_horizon(name, text, index)
    if fmt == "rknn":
        return rknn.read_rknn(name, text, index)
    if fmt == "openvino":
        return openvino.read_openvino(name, _json(name, text), index)
    if _looks_like_json(text):
        return read_generic_json(name, _json(name, text), index)
    return read_generic_csv(name, text, index)


def detect_format(path: str, text: str) -> str:
    """The report format a file's content follows."""
    if _looks_like_json(text):
        data = _json(path, text)
        if openvino.looks_like(data):
            return "openvino"
        if isinstance(data, dict) and "Layers" in data:
            return "trt_json"
        if isinstance(data, list) and data and isinstance(data[0], dict) and "count" in data[0]:
            return "trt_json"  # an --exportProfile file; the reader says which file to pass
        return "generic"
    lines = text.splitlines()
    if any(horizon.HEADER.search(line) for line in lines):
        return "horizon"
    if any(rknn.HEADER.match(line) for line in lines) or any(
        rknn.ROW.match(line.strip()) for line in lines
    ):
        return "rknn"
    first = next((line for line in lines if line.strip()), "")
    columns = [c.strip().lower() for c in first.split(",")]
    if "node" in columns and "precision" in columns:
        return "generic"
    raise NpuprepError(f"{path}: cannot tell the report format from its content; pass --report-format "
                       "trt_json, generic, horizon, rknn or openvino")


def _looks_like_json(text: str) -> bool:
    start = text.lstrip()
    if start.startswith("["):
        # An RKNN row starts with "[OpType] tensor" too.
        return not rknn.ROW.match(start.splitlines()[0])
    return start.startswith("{")


def _json(path: str, text: str) -> Any:
    try:
        return json_io.loads(text)
    except json.JSONDecodeError as exc:
        raise malformed(path, f"line {exc.lineno} column {exc.colno}", f"invalid JSON: {exc.msg}") from None
