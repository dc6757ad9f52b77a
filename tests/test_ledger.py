"""The ledger's arithmetic: the article's 16x / 2x, memory-bound chains, casts and pins, unknowns."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from npuprep.errors import NpuprepError
from npuprep.graph import node_label
from npuprep.ledger.ledger import build_ledger
from npuprep.ledger.roofline import roofline_ms
from npuprep.profiles import Throughput, load_profile, parse_profile
from tests.conftest import model_from_text

# a[4096,4096] -> MatMul(., b) -> y : 137 GFLOP over 201 MB, compute-bound on every GPU profile
MATMUL = """<ir_version: 8, opset_import: ["" : 17]>
g (float[4096,4096] a, float[4096,4096] b) => (float[4096,4096] y) { y = MatMul(a, b) }"""
# x[16M] -> Relu -> Neg -> Abs -> y : one op per element, memory-bound everywhere
CHAIN = """<ir_version: 8, opset_import: ["" : 17]>
g (float[16777216] x) => (float[16777216] y) { r = Relu(x)  s = Neg(r)  y = Abs(s) }"""


def _speedup(text: str, target: str, fmt: str) -> float:
    ledger = build_ledger(model_from_text(text), load_profile(target).resolve())
    row = next(r for r in ledger.rows() if r["format"] == fmt)
    return row["speedup_vs_fp32"]


@pytest.mark.parametrize(("target", "expected"), [("a100", 16.0), ("rtx5000ada", 2.0)])
def test_the_article_compute_bound_matmul_gains_16x_on_a100_and_2x_on_rtx5000ada(target, expected):
    assert _speedup(MATMUL, target, "bf16") == pytest.approx(expected, rel=1e-9)
    assert _speedup(MATMUL, target, "fp16") == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("target", ["a100", "rtx5000ada"])
def test_the_article_memory_bound_chain_gains_2x_on_both(target):
    assert _speedup(CHAIN, target, "bf16") == pytest.approx(2.0, rel=1e-9)
    ledger = build_ledger(model_from_text(CHAIN), load_profile(target).resolve())
    assert all(r["memory_bound_share"] == pytest.approx(1.0) for r in ledger.rows())


def test_roofline_time_is_the_larger_of_compute_and_memory():
    tp = Throughput(peak_tflops={"fp16": 100.0}, bandwidth_gbs=1000.0)
    # 1e12 FLOPs at 100 TFLOPS = 10 ms; 1e9 bytes at 1000 GB/s = 1 ms
    assert roofline_ms(1e12, 1e9, "fp16", tp) == (pytest.approx(10.0), "compute")
    assert roofline_ms(1e9, 1e11, "fp16", tp) == (pytest.approx(100.0), "memory")
    assert roofline_ms(1e9, 1e9, "fp32", tp) == (None, "unknown")


def test_pins_cost_counts_the_fp32_node_and_the_casts_at_its_borders():
    # x -> Relu(r) -> Exp(e, pinned FP32) -> Abs -> y: casts fp16->fp32 before Exp, back after it
    model = model_from_text(CHAIN.replace("s = Neg(r)", "s = Exp(r)"))
    label = node_label(next(n for n in model.graph.node if n.op_type == "Exp"))
    ledger = build_ledger(model, load_profile("a100").resolve(), pinned=[label])
    converted = ledger.get("converted")
    casts = sorted(n.node for n in converted.nodes if n.cast)
    # graph input and output casts, and the two around the pinned Exp
    assert casts == ["Cast(r) fp16->fp32", "Cast(s) fp32->fp16", "Cast(x) fp32->fp16",
                     "Cast(y) fp16->fp32"]
    pins = ledger.pins_cost()
    n, bw = 16777216, 2039e9
    # a100 fuses: all-FP16 runs Exp and Abs in Relu's epilogue (they cost nothing); the Casts
    # split the chain, so Exp at fp32 (8 B/elt) and Abs (4) move their tensors, plus four
    # casts of 6 B/elt each
    assert pins["extra_ms"] == pytest.approx(1e3 * n * (8 + 4 + 4 * 6) / bw, rel=1e-9)
    assert pins["extra_share"] == pytest.approx(pins["extra_ms"] / converted.estimated_ms)
    assert pins["casts"] == 4


def test_a_converted_model_is_read_as_written_with_its_casts():
    # x -> Cast(fp16) -> Relu -> Cast(fp32) -> Exp (FP32) -> y
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1024])
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16, name="to16"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Cast", ["r"], ["f"], to=TensorProto.FLOAT, name="to32"),
             helper.make_node("Exp", ["f"], ["y"], name="exp")]
    converted = helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                                  opset_imports=[helper.make_opsetid("", 17)])
    source = model_from_text("""<ir_version: 8, opset_import: ["" : 17]>
g (float[1024] x) => (float[1024] y) { r = Relu(x)  y = Exp(r) }""")
    ledger = build_ledger(source, load_profile("a100").resolve(), converted=converted)
    nodes = {n.node: n for n in ledger.get("converted").nodes}
    assert (nodes["relu"].fmt, nodes["relu"].bytes) == ("fp16", 1024 * 4)
    assert (nodes["exp"].fmt, nodes["exp"].bytes) == ("fp32", 1024 * 8)
    assert nodes["to16"].cast and nodes["to16"].bytes == 1024 * 6
    assert ledger.get("converted").casts == 2
    assert nodes["to32"].fmt == "fp16"  # a Cast runs on the unit of its narrower side
    # rk3588 cannot pin: its compiler runs the FP32 Exp in FP16
    rk = build_ledger(source, load_profile("rk3588").resolve(), converted=converted,
                      throughput=Throughput(peak_tflops={"fp16": 1.5}, bandwidth_gbs=34.1))
    assert {n.node: n.fmt for n in rk.get("converted").nodes}["exp"] == "fp16"
    assert rk.get("converted").estimated_ms is not None
    # against the same graph all in FP16 with its Casts free: two casts (6 B/elt) and Exp's
    # extra 4 B/elt in FP32
    assert ledger.pins_cost()["extra_ms"] == pytest.approx(1e3 * 1024 * 16 / 2039e9, rel=1e-9)


def test_a_qdq_matmul_runs_at_int8_and_its_dequantize_is_fused():
    w = numpy_helper.from_array(np.ones((64, 64), np.int8), "w")
    s = numpy_helper.from_array(np.array(0.1, np.float32), "s")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])
    nodes = [helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], name="dq"),
             helper.make_node("MatMul", ["x", "wf"], ["y"], name="mm")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w, s]),
                              opset_imports=[helper.make_opsetid("", 17)])
    ledger = build_ledger(model, load_profile("a100").resolve(), converted=model)
    nodes = {n.node: n for n in ledger.get("converted").nodes}
    assert nodes["mm"].fmt == "int8" and nodes["dq"].bound == "free"
    assert nodes["mm"].bytes == 64 * 64 * (4 + 1 + 4)


def test_unknown_figures_stay_unknown_and_say_whom_to_ask():
    ledger = build_ledger(model_from_text(CHAIN), load_profile("rk3588").resolve())
    fp16 = ledger.get("fp16")
    assert fp16.estimated_ms is None
    assert "throughput.peak_tflops.fp16" in fp16.unknown and "ask the vendor" in fp16.unknown
    set_by_user = Throughput(peak_tflops={"fp16": 3.0}, bandwidth_gbs=30.0)
    known = build_ledger(model_from_text(CHAIN), load_profile("rk3588").resolve(), throughput=set_by_user)
    assert known.get("fp16").estimated_ms == pytest.approx(1e3 * 16777216 * 12 / 30e9)


def _profile(throughput: dict, sources: dict) -> dict:
    return {"name": "t", "description": "d", "dtypes": {"fast": ["fp16"]}, "default_precision": "fp16",
            "overflow": "inf", "fp32_pinning": "per_node", "throughput": throughput, "sources": sources}


def test_a_profile_peak_needs_a_source_and_a_positive_number():
    good = parse_profile(_profile({"peak_tflops": {"fp16": 10, "fp32": "unknown"}},
                                  {"peak": "datasheet X"}), "t.yaml")
    assert good.throughput.peak("fp16") == 10.0 and good.throughput.peak("fp32") is None
    with pytest.raises(NpuprepError, match="t.yaml: key 'sources.peak'"):
        parse_profile(_profile({"peak_tflops": {"fp16": 10}}, {}), "t.yaml")
    with pytest.raises(NpuprepError, match="key 'throughput.peak_tflops.fp16'"):
        parse_profile(_profile({"peak_tflops": {"fp16": -1}}, {"peak": "x"}), "t.yaml")
    with pytest.raises(NpuprepError, match="key 'throughput.peak_tflops.fp99'"):
        parse_profile(_profile({"peak_tflops": {"fp99": 1}}, {"peak": "x"}), "t.yaml")


def test_assumed_ranges_efficiency_and_fusion_need_their_sources_and_sane_values():
    assumed = {"assumed": {"ridge_fp32": [4, 64], "peak_vs_fp32": {"fp16": [1, 16]}}}
    good = parse_profile(_profile(assumed, {"assumed": "doc"}), "t.yaml")
    assert good.throughput.assumed_peak_vs_fp32 == {"fp16": (1.0, 16.0)}
    with pytest.raises(NpuprepError, match="key 'sources.assumed'"):
        parse_profile(_profile(assumed, {}), "t.yaml")
    with pytest.raises(NpuprepError, match="key 'throughput.assumed.ridge_fp32'"):
        parse_profile(_profile({"assumed": {"ridge_fp32": [64, 4]}}, {"assumed": "d"}), "t.yaml")
    with pytest.raises(NpuprepError, match="key 'sources.efficiency'"):
        parse_profile(_profile({"efficiency": {"fp16": 0.7}}, {}), "t.yaml")
    with pytest.raises(NpuprepError, match="key 'sources.fusion'"):
        parse_profile(_profile({"fuses_elementwise": True}, {}), "t.yaml")


def test_every_published_builtin_figure_carries_its_source():
    from npuprep.profiles import builtin_names

    for name in builtin_names():
        profile = load_profile(name)
        tp = profile.throughput
        if any(v is not None for v in tp.peak_tflops.values()):
            assert profile.sources["peak"]
        if tp.bandwidth_gbs is not None:
            assert profile.sources["bandwidth"]
    assert load_profile("a100").throughput.peak("bf16") == 312.0
    assert load_profile("rtx5000ada").throughput.bandwidth_gbs == 576.0


def test_a_gather_reads_the_rows_it_picks_not_the_whole_table():
    # ids[8] -> Gather(table[30000,64]) -> y[8,64]: 8 rows read and written, plus the ids
    table = numpy_helper.from_array(np.zeros((30000, 64), np.float32), "table")
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 64])
    model = helper.make_model(helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["y"],
                                                                  name="g")], "g", [ids], [y], [table]),
                              opset_imports=[helper.make_opsetid("", 17)])
    node = build_ledger(model, load_profile("a100").resolve()).get("fp16").nodes[0]
    assert node.bytes == 8 * 8 + 2 * 8 * 64 * 2


@pytest.mark.parametrize("target", ["a2000", "rk3588", "orin"])
def test_every_row_has_a_speedup_or_a_range_with_each_end_named(target):
    for text in (MATMUL, CHAIN):
        ledger = build_ledger(model_from_text(text), load_profile(target).resolve())
        for row in ledger.rows():
            if row["speedup_vs_fp32"] is None:
                low, high = row["speedup_range"]
                assert 0 < low <= high
                assert "assumed" in row["range_low_assumes"] + row["range_high_assumes"]
            assert row["why"]
            if row["format"] == "fp16" and target == "orin":  # TF32 there: FP16 over it too
                low, high = row["speedup_vs_tf32_range"]
                assert 0 < low <= high


def test_a_memory_bound_chain_is_2x_at_both_ends_and_a_matmul_spans_the_peak_ratios():
    # CHAIN: 1 FLOP per 8 bytes, under every assumed ridge: FP16 halves the bytes, nothing else
    chain = {r["format"]: r for r in build_ledger(model_from_text(CHAIN),
                                                  load_profile("a2000").resolve()).rows()}
    assert chain["fp16"]["speedup_range"] == pytest.approx([2.0, 2.0])
    # MATMUL: 683 FLOP/B, compute-bound at any assumed ridge: the peak ratio's range, 1x..16x
    mm = {r["format"]: r for r in build_ledger(model_from_text(MATMUL),
                                               load_profile("a2000").resolve()).rows()}
    assert mm["fp16"]["speedup_range"] == pytest.approx([1.0, 16.0], rel=1e-3)
    assert "FP16 peak 1x FP32 (assumed)" in mm["fp16"]["range_low_assumes"]


def test_h200_keeps_the_measured_speedups_within_15_percent_and_has_a_tf32_row():
    # measured on one H200 (BENCHMARKS.md): 14.7x on an 8192^3 GEMM, 1.98x on a memory-bound chain
    mm = {r["format"]: r for r in build_ledger(model_from_text(MATMUL),
                                               load_profile("h200").resolve()).rows()}
    assert mm["fp16"]["speedup_vs_fp32"] == pytest.approx(14.7, rel=0.15)
    # the profile's sustained efficiencies: FP16 0.71 of 989.5, TF32 0.73 of 494.5
    assert mm["fp16"]["speedup_vs_tf32"] == pytest.approx(989.5 * 0.71 / (494.5 * 0.73), rel=1e-6)
    chain = {r["format"]: r for r in build_ledger(model_from_text(CHAIN),
                                                  load_profile("h200").resolve()).rows()}
    assert chain["fp16"]["speedup_vs_fp32"] == pytest.approx(1.98, rel=0.15)
    assert chain["tf32"]["speedup_vs_fp32"] == pytest.approx(1.0)


def test_fused_activations_move_nothing_and_each_kernel_pays_its_launch():
    # a[4096,4096] -> MatMul -> Relu -> Neg: with fusion one kernel, without three
    text = MATMUL.replace("{ y = MatMul(a, b) }", "{ m = MatMul(a, b)  r = Relu(m)  y = Neg(r) }")
    base = Throughput(peak_tflops={"fp32": 20.0, "fp16": 80.0}, bandwidth_gbs=1000.0, launch_us=5.0)
    fused = replace(base, fuses_elementwise=True)
    matmul_ms = 1e3 * 2 * 4096 ** 3 / 20e12
    one = build_ledger(model_from_text(text), load_profile("a100").resolve(), throughput=fused)
    assert one.get("fp32").estimated_ms == pytest.approx(matmul_ms + 5e-3)
    three = build_ledger(model_from_text(text), load_profile("a100").resolve(), throughput=base)
    elementwise_ms = 2 * 1e3 * 4096 * 4096 * 8 / 1e12
    assert three.get("fp32").estimated_ms == pytest.approx(matmul_ms + elementwise_ms + 15e-3)


def test_a_huge_rank1_input_is_costed_without_data_propagation_memory():
    # x[2^26] -> Mul(x, x) -> Shape -> Reshape -> Relu: data propagation took 9.7 GB here
    code = """
from npuprep.flops import tensor_shapes
from tests.conftest import model_from_text
m = model_from_text('''<ir_version: 8, opset_import: ["" : 17]>
g (float[n] x) => (float[n] out) { y = Mul(x, x)  s = Shape(y)  z = Reshape(y, s)  out = Relu(z) }''')
tensor_shapes(m, {"x": (2 ** 26,)})
# VmHWM is this process's own peak: ru_maxrss keeps the forking parent's (pytest's) across exec
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) // 1024)
"""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.split()[-1]) < 1000  # MB
