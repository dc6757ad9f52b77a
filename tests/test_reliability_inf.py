"""Issue 30, Inf at the boundary: a `-inf` mask before an Exp that overflows FP16, in FP32 and in
FP16 graphs, is planned (never `OverflowError: cannot convert float infinity to integer`), and
a FAILED verdict with finite outputs and no divergent layer still says why."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx import numpy_helper as nh

from npuprep.calibrate.stats import RangeStats
from tests.conftest import run_cli


def masked_softmax(elem: int) -> onnx.ModelProto:
    """x -> MatMul(w) -> Add(Where(mask == 0, -inf, 0)) -> Exp -> ReduceSum -> Div -> y,
    written out without the max shift, in `elem` (FLOAT or FLOAT16) throughout."""
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    inits = [nh.from_array(np.full((4, 4), 3.0, dtype), "w"), nh.from_array(np.array(-np.inf, dtype), "neginf"),
             nh.from_array(np.array(0.0, dtype), "zero_f"), nh.from_array(np.array(0, np.int64), "zero_i")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["s"], name="scores"),
             helper.make_node("Equal", ["mask", "zero_i"], ["off"], name="off"),
             helper.make_node("Where", ["off", "neginf", "zero_f"], ["madd"], name="mask_add"),
             helper.make_node("Add", ["s", "madd"], ["sm"], name="masked"),
             helper.make_node("Exp", ["sm"], ["e"], name="exp"),
             helper.make_node("ReduceSum", ["e"], ["den"], keepdims=1, name="den"),
             helper.make_node("Div", ["e", "den"], ["y"], name="probs")]
    graph = helper.make_graph(nodes, "masked_softmax",
                              [helper.make_tensor_value_info("x", elem, [1, 4]),
                               helper.make_tensor_value_info("mask", TensorProto.INT64, [1, 4])],
                              [helper.make_tensor_value_info("y", elem, [1, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["fp32", "fp16"])
def test_a_minus_inf_mask_before_an_overflowing_exp_is_planned_not_a_bug(tmp_path: Path, elem: int) -> None:
    onnx.save(masked_softmax(elem), tmp_path / "m.onnx")
    # x in [0, 5): scores up to 60, exp past FP16's 65504; the mask makes the Exp input -inf.
    check = run_cli("check", "m.onnx", "-t", "a2000", "--synthetic", "4", "--input-range", "x:0:5",
                    cwd=tmp_path)
    assert check.returncode in (0, 1) and "bug" not in check.stderr, check.stderr
    assert "softmax_shift" in check.stdout
    done = run_cli("convert", "m.onnx", "-t", "a2000", "--synthetic", "4", "--input-range", "x:0:5",
                   "--no-holdout", "-o", "out.onnx", cwd=tmp_path)
    assert "bug" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    report = json.loads((tmp_path / "out.report.json").read_text())
    shift = next(a for a in report["plan"]["actions"] if a["action"] == "softmax_shift")
    assert "absmax inf" not in shift["why"] and "below 2^6, and -inf" in shift["why"]
    if elem == TensorProto.FLOAT:
        # The shifted softmax under emulated FP16 is the FP32 one within rtol.
        assert done.returncode == 0 and report["verification"]["outputs"]["y"]["rel_l2"] < 0.01


def test_a_mask_s_largest_finite_exponent_is_read_past_its_inf() -> None:
    # Values up to 60 (2^5) and -inf: the rounding step is that of 2^5, not of infinity.
    r = RangeStats(tensor="sm", scope="main", node="masked", min=-math.inf, max=60.0, absmax=math.inf,
                   count=8, nan_count=0, inf_count=2, zero_count=0, exp_hist={1: 3, 5: 3}, over={},
                   under={}, per_sample_absmax=(math.inf,), detailed_count=8)
    assert r.top_exponent() == 5
    assert RangeStats(**{**r.__dict__, "absmax": 48.0, "min": 0.0}).top_exponent() == 5
    assert RangeStats(**{**r.__dict__, "absmax": 0.0, "exp_hist": {}}).top_exponent() is None


def test_a_precision_failure_no_single_layer_shows_says_so(tmp_path: Path) -> None:
    # x (fp16) -> Div(3) -> Mul(self) -> Div(3) -> y (fp16): every layer stores FP16 already,
    # so no layer diverges, while the outputs miss a tight rtol against FP32 arithmetic.
    w = nh.from_array(np.array(3.0, np.float16), "w")
    nodes = [helper.make_node("Div", ["x", "w"], ["d"]), helper.make_node("Mul", ["d", "d"], ["m"]),
             helper.make_node("Div", ["m", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 64])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "d.onnx")
    done = run_cli("convert", "d.onnx", "-t", "a2000", "--synthetic", "4", "--rtol", "1e-4", "-o", "o.onnx",
                   cwd=tmp_path)
    said = " ".join(done.stdout.split())
    assert done.returncode == 1 and "FAILED: outputs off by rel L2" in said, done.stdout
    assert "no single layer is over the tolerance" in said
