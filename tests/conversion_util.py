"""A conversion made in a test, carrying its record, and a compiler report that runs every node
exactly as the conversion stored it.

Until convert writes its own record (npuprep.provenance.ConversionRecord) into every model it
converts, `convert_recorded` stamps one from the report convert writes beside the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx
from conftest import run_cli

from npuprep.graph import node_label
from npuprep.provenance import (
    ConversionRecord,
    Gates,
    read_conversion,
    read_source,
    record_conversion,
)
from npuprep.verify.compare import DEFAULT_ATOL


def convert_recorded(source: Path, data: Path, target: str, out: Path, *extra: str) -> dict[str, Any]:
    """`npuprep convert SOURCE --target T --data D -o OUT`; OUT carries its record. Returns the report."""
    done = run_cli("convert", source, "--target", target, "--data", data, "-o", out, *extra)
    assert done.returncode in (0, 1), done.stderr
    report = json.loads(out.with_suffix(".report.json").read_text())
    proto = onnx.load(str(out))
    if read_conversion(proto) is None:
        source_record = read_source(proto)
        assert source_record is not None
        record_conversion(proto, ConversionRecord(
            source=source_record, target=report["target"], precision=report["precision"],
            gates=Gates(rtol=report["verification"]["rtol"], atol=DEFAULT_ATOL),
            plan=report["plan"], passed=report["passed"], host_scales=report["host_scales"]))
        onnx.save(proto, str(out))
    return report


def as_stored_report(converted: Path, csv: Path) -> Path:
    """A compiler report (CSV node,precision) that runs each node of `converted` in the
    precision the conversion wrote: fp16 where an input or output is FP16, else fp32."""
    m = onnx.shape_inference.infer_shapes(onnx.load(str(converted)))
    types = {v.name: v.type.tensor_type.elem_type for v in [*m.graph.value_info, *m.graph.output,
                                                            *m.graph.input]}
    types.update({i.name: i.data_type for i in m.graph.initializer})
    half = onnx.TensorProto.FLOAT16
    rows = ["node,precision"]
    for n in m.graph.node:
        in_half = any(types.get(t) == half for t in [*n.input, *n.output])
        rows.append(f"{node_label(n)},{'fp16' if in_half else 'fp32'}")
    csv.write_text("\n".join(rows) + "\n")
    return csv
