"""Report readers: each documented format -> LayerRecords, malformed input, auto-detection."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from conftest import model_from_text

from npuprep.crosscheck.names import NodeIndex
from npuprep.crosscheck.readers import detect_format, read_report
from npuprep.crosscheck.record import normalise_dtype
from npuprep.errors import NpuprepError
from npuprep.model_io import load_model

FIXTURES = Path(__file__).parent / "fixtures" / "reports"
NAMES = {
    "enc_matmul": "/enc/MatMul", "enc_relu": "/enc/Relu", "norm_sq": "/norm/Mul",
    "norm_mean": "/norm/ReduceMean", "norm_add": "/norm/Add", "norm_sqrt": "/norm/Sqrt",
    "norm_div": "/norm/Div",
}


def norm_model() -> onnx.ModelProto:
    """The model every fixture in tests/fixtures/reports describes."""
    # x -> MatMul -> Relu -> Mul(r, r) -> ReduceMean -> Add(eps) -> Sqrt -> Div(r, .) -> Exp -> y
    model = model_from_text("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,4] x) => (float[1,4] y)
      <float[4,4] W = {1,0,0,0, 0,1,0,0, 0,0,1,0, 0,0,0,1}, float eps = {0.00001}> {
      [enc_matmul] h = MatMul(x, W)
      [enc_relu] r = Relu(h)
      [norm_sq] s = Mul(r, r)
      [norm_mean] m = ReduceMean<axes = [1]>(s)
      [norm_add] v = Add(m, eps)
      [norm_sqrt] d = Sqrt(v)
      [norm_div] n = Div(r, d)
      y = Exp(n)
    }
    """)
    for node in model.graph.node:
        node.name = NAMES.get(node.name, node.name)
    return model


@pytest.fixture
def index(save) -> NodeIndex:
    return NodeIndex(load_model(save(norm_model())))


def by_layer(report) -> dict:
    return {r.layer: r for r in report.records}


def test_dtype_vocabularies_normalise_to_one_name():
    assert normalise_dtype("Row major linear FP16 format") == "fp16"
    assert normalise_dtype("Half") == "fp16"
    assert normalise_dtype("Channel major FP16 format where channel % 8 == 0") == "fp16"
    assert normalise_dtype("Thirty-two wide channel vectorized row major Int8 format") == "int8"
    assert normalise_dtype("Row major linear BFloat16 format") == "bf16"
    assert normalise_dtype("Row major linear FP8 format") == "fp8_e4m3"
    assert normalise_dtype("Float") == "fp32"
    assert normalise_dtype("Int32") == "int32"
    assert normalise_dtype("N/A due to dynamic shapes") is None


def test_trt_detailed_metadata_maps_layers_to_nodes(index):
    report = read_report(FIXTURES / "trt_detailed.json", index)
    assert report.format == "trt_json"
    layers = by_layer(report)
    gemm = layers["/enc/MatMul + /enc/Relu"]
    # "| Local Function: EncBlock" is not part of the node name
    assert gemm.onnx_nodes == ("/enc/MatMul", "/enc/Relu")
    assert gemm.compute_dtype == "fp32" and gemm.compute
    # Truncated Metadata (" ... " in the middle): the lost entries come back from the graph.
    myelin = layers["{ForeignNode[/norm/Mul.../norm/Div]}"]
    assert myelin.onnx_nodes == ("/norm/Mul", "/norm/ReduceMean", "/norm/Div", "/norm/Add", "/norm/Sqrt")
    assert myelin.compute_dtype == "fp16" and myelin.out_dtypes == ("fp16",)
    assert any("truncated" in n for n in report.notes)
    reformat = layers["Reformatting CopyNode for Input Tensor 0 to {ForeignNode[/norm/Mul.../norm/Div]}"]
    assert not reformat.compute
    assert reformat.out_dtypes == ("fp16",)
    assert set(reformat.onnx_nodes) == {"/norm/Mul", "/norm/ReduceMean", "/norm/Add", "/norm/Sqrt", "/norm/Div"}
    exp = layers["PWN(node_of_y)"]
    assert exp.onnx_nodes == ("node_of_y",) and exp.in_dtypes == ("fp16",) and exp.out_dtypes == ("fp32",)
    assert layers["(Unnamed Layer* 14) [Shuffle]"].unresolved == ("(Unnamed Layer* 14) [Shuffle]",)
    kgen = layers["__myl_MulMeanAddSqrtDiv_myl0_0"]
    assert kgen.compute_dtype == "" and kgen.in_dtypes == ("int32",)
    assert layers["/enc/MatMul + /enc/Relu [profile 1]"].onnx_nodes == ("/enc/MatMul", "/enc/Relu")


def test_trt_names_without_metadata_expand_fusions_pwn_and_ranges(index):
    layers = by_layer(read_report(FIXTURES / "trt_legacy_names.json", index, "trt_json"))
    assert layers["/enc/MatMul + /enc/Relu"].onnx_nodes == ("/enc/MatMul", "/enc/Relu")
    assert layers["PWN(PWN(/norm/Mul), /norm/ReduceMean)"].onnx_nodes == ("/norm/Mul", "/norm/ReduceMean")
    assert layers["PWN(PWN(/norm/Mul), /norm/ReduceMean)"].compute_dtype == "fp32"
    # ForeignNode[first...last] lists only its ends; the members come from topological order.
    foreign = layers["{ForeignNode[/norm/Add.../norm/Div]}"]
    assert foreign.onnx_nodes == ("/norm/Add", "/norm/Sqrt", "/norm/Div")
    exp = layers["node_of_y"]
    assert exp.in_dtypes == ("int8",) and exp.out_dtypes == ("bf16",)


def test_foreign_node_range_leaves_out_nodes_other_layers_claim(tmp_path, index):
    # The range /enc/Relu.../norm/Sqrt spans /norm/Mul, which another layer names outright.
    report = {"Layers": [
        {"Name": "{ForeignNode[/enc/Relu.../norm/Sqrt]}", "LayerType": "Myelin",
         "Inputs": [{"Name": "h", "Format/Datatype": "Half"}], "Outputs": []},
        {"Name": "/norm/Mul", "LayerType": "ElementWise",
         "Inputs": [{"Name": "r", "Format/Datatype": "Float"}], "Outputs": []},
    ]}
    path = tmp_path / "li.json"
    path.write_text(json.dumps(report))
    layers = by_layer(read_report(path, index))
    assert layers["{ForeignNode[/enc/Relu.../norm/Sqrt]}"].onnx_nodes == (
        "/enc/Relu", "/norm/ReduceMean", "/norm/Add", "/norm/Sqrt")


def test_trt_dynamic_shapes_give_no_dtype(index):
    (record,) = read_report(FIXTURES / "trt_dynamic_shapes.json", index).records
    assert record.compute_dtype == "" and record.in_dtypes == ("",)
    assert len(record.onnx_nodes) == 8


def test_trt_names_only_asks_for_detailed_profiling(index):
    with pytest.raises(NpuprepError, match=r"trt_names_only.json: Layers: .*--profilingVerbosity=detailed"):
        read_report(FIXTURES / "trt_names_only.json", index)


@pytest.mark.parametrize(("content", "where"), [
    ('{"Layers": [{"LayerType": "Myelin"}]}', r"Layers\[0\]\.Name"),
    ('{"Layers": [{"Name": "/norm/Mul", "Inputs": [{"Name": "r", "Format/Datatype": "Sparkly"}]}]}',
     r"Layers\[0\]\.Inputs\[0\]\.Format/Datatype: 'Sparkly'"),
    ('{"Layers": [{"Name": "/norm/Mul", "Inputs": [{"Name": "r"}]}]}',
     r"Layers\[0\]\.Inputs\[0\]\.Format/Datatype: missing"),
    ('{"Layers": {"Name": "x"}}', r"Layers: expected a list"),
    ('{"Layers": [\n{"Name": "x",}]}', r"line 2 column \d+: invalid JSON"),
    ('[{"count": 10}, {"name": "/enc/MatMul", "timeMs": 0.1}]', r"top level: this is a trtexec --exportProfile"),
])
def test_malformed_trt_json_names_the_field(tmp_path, index, content, where):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(NpuprepError, match=rf"bad.json: {where}") as err:
        read_report(path, index, "trt_json")
    assert "\n" not in str(err.value)


def test_generic_csv_and_json(index):
    csv_report = read_report(FIXTURES / "generic.csv", index)
    assert csv_report.format == "generic"
    layers = by_layer(csv_report)
    assert layers["/norm/Mul"].compute_dtype == "fp32" and layers["/norm/Mul"].device == "NPU"
    assert layers["/norm/Mul"].op_type == "Mul"
    assert layers["node_of_y"].compute_dtype == "int8"
    assert layers["vendor_inserted_cast"].onnx_nodes == ()
    assert layers["vendor_inserted_cast"].unresolved == ("vendor_inserted_cast",)
    json_layers = by_layer(read_report(FIXTURES / "generic.json", index))
    assert json_layers["/norm/Sqrt"].compute_dtype == "fp16"
    assert json_layers["node_of_y"].compute_dtype == "fp32"


def test_generic_mapping_form(tmp_path, index):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"/norm/Mul": "half", "/norm/Div": "fp32"}))
    layers = by_layer(read_report(path, index, "generic"))
    assert layers["/norm/Mul"].compute_dtype == "fp16" and layers["/norm/Div"].compute_dtype == "fp32"


@pytest.mark.parametrize(("content", "where"), [
    ("node,precision\n/norm/Mul,fp16\n/norm/Div,quarter\n", "line 3 precision: 'quarter'"),
    ("node,precision\n/norm/Mul\n", "line 2: 1 fields"),
    ("layer,dtype\n/norm/Mul,fp16\n", "line 1: header needs a 'node' column"),
])
def test_malformed_generic_csv_names_the_line(tmp_path, index, content, where):
    path = tmp_path / "p.csv"
    path.write_text(content)
    with pytest.raises(NpuprepError, match=f"p.csv: {where}"):
        read_report(path, index, "generic")


def test_horizon_node_table(index):
    report = read_report(FIXTURES / "horizon_makertbin.log", index)
    assert report.format == "horizon"
    layers = by_layer(report)
    assert len(layers) == 9
    mul = layers["/norm/Mul"]
    assert (mul.device, mul.compute_dtype, mul.op_type) == ("BPU", "int16", "HzSElementwiseMul")
    assert mul.metrics == {"cosine": 0.9988}
    sqrt = layers["/norm/Sqrt"]
    assert (sqrt.device, sqrt.compute_dtype, sqrt.metrics) == ("CPU", "fp32", {})
    assert layers["/enc/MatMul"].compute_dtype == "int8"
    assert layers["/head/Dequantize"].unresolved == ("/head/Dequantize",)


@pytest.mark.parametrize(("row", "where"), [
    ("/norm/Mul  BPU  id(0)  HzSElementwiseMul  0.99  int16", "line 3: 6 fields"),
    ("/norm/Mul  BPU  id(0)  HzSElementwiseMul  0.99  2.4  int9", "line 3 DataType: 'int9'"),
    ("/norm/Mul  GPU  id(0)  HzSElementwiseMul  0.99  2.4  int8", "line 3 ON: 'GPU'"),
    ("/norm/Mul  BPU  id(0)  HzSElementwiseMul  high  2.4  int8", "line 3 Cosine Similarity: 'high'"),
])
def test_malformed_horizon_row_names_the_line(tmp_path, index, row, where):
    path = tmp_path / "hb.log"
    path.write_text("The main quantized node information:\n"
                    "Node ON Subgraph Type Cosine Similarity Threshold DataType\n" + row + "\n")
    with pytest.raises(NpuprepError, match=rf"hb.log: {where}"):
        read_report(path, index)


def test_rknn_rows_map_tensors_to_producers(index):
    report = read_report(FIXTURES / "rknn_error_analysis.txt", index)
    assert report.format == "rknn" and not report.dtypes_reported
    layers = by_layer(report)
    assert "[Input] x" not in layers
    assert layers["[Relu] r"].onnx_nodes == ("/enc/Relu",)
    assert layers["[Relu] r"].metrics["runtime_entire_euc"] == pytest.approx(1.4931)
    assert layers["[MatMul] h"].onnx_nodes == ("/enc/MatMul",) and layers["[MatMul] h"].metrics == {}
    exp = layers["[Exp] y"]
    assert exp.onnx_nodes == ("node_of_y",)
    assert exp.metrics["markers"] == ["rt_inf", "rt_nan"]
    assert exp.metrics["simulator_entire_cos"] == "nan" and exp.metrics["simulator_entire_euc"] == "inf"
    assert layers["[Conv] 779"].unresolved == ("779",)


def test_rknn_cos_only_rows(tmp_path, index):
    path = tmp_path / "error_analysis.txt"
    path.write_text("[Mul] s   0.99990   0.99995\n")
    (record,) = read_report(path, index).records
    assert record.metrics == {"simulator_entire_cos": 0.9999, "simulator_single_cos": 0.99995}


@pytest.mark.parametrize(("row", "message"), [
    ("[Mul] s   0.99990 | 3.1   0.99995 |", "line 1: cos | euc values come in pairs"),
    ("[Mul] s   0.99990 | high", "line 1: 'high' is not a number"),
])
def test_malformed_rknn_row_names_the_line(tmp_path, index, row, message):
    path = tmp_path / "error_analysis.txt"
    path.write_text(row + "\n")
    with pytest.raises(NpuprepError, match=f"error_analysis.txt: {message}"):
        read_report(path, index, "rknn")


@pytest.mark.parametrize(("name", "expected"), [
    ("trt_detailed.json", "trt_json"), ("trt_names_only.json", "trt_json"),
    ("generic.csv", "generic"), ("generic.json", "generic"),
    ("horizon_makertbin.log", "horizon"), ("rknn_error_analysis.txt", "rknn"),
])
def test_auto_detection(name, expected):
    path = FIXTURES / name
    assert detect_format(str(path), path.read_text()) == expected


def test_undetectable_report_asks_for_format(tmp_path, index):
    path = tmp_path / "notes.txt"
    path.write_text("the compiler said it went fine\n")
    with pytest.raises(NpuprepError, match="notes.txt: cannot tell the report format.*--report-format"):
        read_report(path, index)


def test_missing_report_file(tmp_path, index):
    with pytest.raises(NpuprepError, match="nope.json: report file not found"):
        read_report(tmp_path / "nope.json", index)


@pytest.mark.parametrize("joiner", ["\x1f", "\x1e", "\n", ""])
def test_metadata_entries_split_on_any_joiner(tmp_path, index, joiner):
    metadata = joiner.join(["[ONNX Layer: /norm/Add]", "[ONNX Layer: /norm/Sqrt | Local Function: Norm]"])
    path = tmp_path / "li.json"
    path.write_text(json.dumps({"Layers": [{"Name": "fused", "LayerType": "PointWiseV2",
                                            "Metadata": metadata, "Inputs": [], "Outputs": []}]}))
    (record,) = read_report(path, index).records
    assert record.onnx_nodes == ("/norm/Add", "/norm/Sqrt") and record.unresolved == ()


def test_unnamed_layer_maps_through_the_onnx_tensor_it_writes(tmp_path, index):
    path = tmp_path / "li.json"
    path.write_text(json.dumps({"Layers": [
        {"Name": "(Unnamed Layer* 7) [ElementWise]", "LayerType": "ElementWise", "Metadata": "",
         "Inputs": [{"Name": "r", "Format/Datatype": "Half"}],
         "Outputs": [{"Name": "s", "Format/Datatype": "Half"}]},
        {"Name": "(Unnamed Layer* 8) [Shuffle]", "LayerType": "Shuffle", "Metadata": "",
         "Inputs": [{"Name": "s", "Format/Datatype": "Half"}],
         "Outputs": [{"Name": "(Unnamed Layer* 8) [Shuffle]_output", "Format/Datatype": "Half"}]},
    ]}))
    layers = by_layer(read_report(path, index))
    assert layers["(Unnamed Layer* 7) [ElementWise]"].onnx_nodes == ("/norm/Mul",)
    assert layers["(Unnamed Layer* 7) [ElementWise]"].unresolved == ()
    assert layers["(Unnamed Layer* 8) [Shuffle]"].unresolved == ("(Unnamed Layer* 8) [Shuffle]",)


def test_csv_from_a_spreadsheet_with_a_bom(tmp_path, index):
    path = tmp_path / "p.csv"
    path.write_bytes("\ufeffnode,precision\r\n/norm/Mul,FP16\r\n".encode())
    (record,) = read_report(path, index).records
    assert record.onnx_nodes == ("/norm/Mul",) and record.compute_dtype == "fp16"
