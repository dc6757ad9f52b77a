"""A converted model carries its conversion record: written, read back, replaced, refused when broken.

graph: x -> Relu -> y, with the record in metadata_props
"""

from __future__ import annotations

import onnx
import onnx.parser

from npuprep.provenance import (
    RECORD_KEY,
    ConversionRecord,
    Gates,
    Source,
    read_conversion,
    read_source,
    record_conversion,
)


def _model() -> onnx.ModelProto:
    # x -> Relu -> y
    return onnx.parser.parse_model(
        '<ir_version: 8, opset_import: ["" : 17]> g (float[2] x) => (float[2] y) { y = Relu(x) }'
    )


def _record(passed: bool = True) -> ConversionRecord:
    return ConversionRecord(
        source=Source("abc123", {"t": 0.25}), target="a2000", precision="fp16",
        gates=Gates(rtol=1e-2, atol=1e-4, top_k={"y": 1}, max_fp32_share=0.1),
        plan={"kind": "plan", "actions": []}, passed=passed,
        cause="" if passed else "an output underflows fp16",
        stats_fingerprint="s1", calibration_ids=("a.npz",), holdout_ids=("b.npz",),
        host_scales={"y": 4.0},
    )


def test_record_round_trips_and_carries_the_source() -> None:
    proto = _model()
    record_conversion(proto, _record())
    back = read_conversion(proto)
    assert back == _record()
    assert read_source(proto) == Source("abc123", {"t": 0.25})


def test_a_second_record_replaces_the_first() -> None:
    proto = _model()
    record_conversion(proto, _record(passed=True))
    record_conversion(proto, _record(passed=False))
    assert [p.key for p in proto.metadata_props].count(RECORD_KEY) == 1
    back = read_conversion(proto)
    assert back is not None and not back.passed and back.cause.startswith("an output")


def test_no_record_or_a_broken_one_reads_as_none() -> None:
    proto = _model()
    assert read_conversion(proto) is None
    onnx.helper.set_model_props(proto, {RECORD_KEY: '{"version": 1}'})
    assert read_conversion(proto) is None
