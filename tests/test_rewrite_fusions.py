"""Fusions a compiler makes anyway, done before planning: an affine after a Conv folded into its
weights (`rewrite/fold_affine.py`) and a written-out hard-swish as one op
(`rewrite/hardswish.py`). Both outcomes each, checked with onnxruntime; the FP16 gain under
emulation; and `convert` on a model that has both."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper, parser

from npuprep.convert import convert
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import get_format
from npuprep.profiles import load_profile
from npuprep.rewrite.fold_affine import fold_affines
from npuprep.rewrite.hardswish import fuse_hardswish
from npuprep.runtime.session import make_session, run
from npuprep.verify.emulate import emulate

FP16 = get_format("fp16")
RNG = np.random.default_rng(7)


def _conv_model(after: str, extra_inits: list[onnx.TensorProto], *, opset: int = 17,
                weights: np.ndarray | None = None, out_channels: int = 8,
                check: bool = True) -> onnx.ModelProto:
    """x[1,4,6,6] -> Conv(3x3, pads 1) -> c -> `after` -> y[1,out_channels,6,6]"""
    w = weights if weights is not None else RNG.standard_normal((8, 4, 3, 3)).astype(np.float32) * 0.3
    text = f"""
    <ir_version: 8, opset_import: ["" : {opset}]>
    g (float[1, 4, 6, 6] x) => (float[1, {out_channels}, 6, 6] y) {{
        [conv] c = Conv <pads = [1, 1, 1, 1]> (x, w, b)
        {after}
    }}
    """
    proto = parser.parse_model(text)
    proto.graph.initializer.extend([
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(RNG.standard_normal(8).astype(np.float32), "b"),
        *extra_inits])
    if check:
        onnx.checker.check_model(proto, full_check=True)
    return proto


def _same(a: onnx.ModelProto, b: onnx.ModelProto, feed: dict[str, np.ndarray], rtol: float = 1e-5) -> None:
    ra, rb = run(make_session(a), feed), run(make_session(b), feed)
    for name, value in ra.items():
        np.testing.assert_allclose(rb[name], value, rtol=rtol, atol=1e-5)


def _x(scale: float = 1.0) -> dict[str, np.ndarray]:
    return {"x": (RNG.standard_normal((1, 4, 6, 6)) * scale).astype(np.float32)}


def _init(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)


def test_batchnorm_then_scale_and_shift_fold_into_the_conv():
    # x -> Conv -> c -> BatchNormalization -> n -> Mul(scalar) -> m -> Add([1,8,1,1]) -> y
    bn = [_init("gamma", RNG.uniform(0.5, 2, 8)), _init("beta", RNG.standard_normal(8)),
          _init("mean", RNG.standard_normal(8)), _init("var", RNG.uniform(0.1, 3, 8)),
          _init("s", 1.7), _init("t", RNG.standard_normal((1, 8, 1, 1)))]
    proto = _conv_model("""[bn] n = BatchNormalization (c, gamma, beta, mean, var)
        [scale] m = Mul (s, n)
        [shift] y = Add (m, t)""", bn)
    result = fold_affines(proto, FP16, largest=32752)
    assert result
    assert [(n.name, n.op_type) for n in result.model.graph.node] == [("conv", "Conv")]
    assert result.model.graph.node[0].output[0] == "y"  # the last folded node's tensor
    assert "BatchNormalization bn, Mul scale, Add shift" in result.details["replaced"]["conv"]
    _same(proto, result.model, _x())


def test_a_conv_without_a_bias_gets_one_and_sub_div_fold_too():
    # x -> Conv(no bias) -> c -> Sub(0.5) -> d -> Div(4) -> y
    proto = _conv_model("[sub] d = Sub (c, half)\n        [div] y = Div (d, four)",
                        [_init("half", 0.5), _init("four", 4.0)])
    conv = proto.graph.node[0]
    del conv.input[2]
    result = fold_affines(proto)
    assert result and len(result.model.graph.node[0].input) == 3
    _same(proto, result.model, _x())


def test_declines_what_is_no_per_channel_affine_or_would_store_worse():
    # x -> Conv -> c -> Add(Tile(x)) -> y : a residual, not an affine: nothing folds or declines
    residual = _conv_model("[copy] xx = Tile (x, reps)\n        [res] y = Add (c, xx)",
                           [numpy_helper.from_array(np.array([1, 2, 1, 1], np.int64), "reps")])
    result = fold_affines(residual)
    assert not result and result.model is residual and result.details["declined"] == {}
    # x -> Conv -> c -> Mul([1,8,6,6]) -> y : the constant varies over positions
    spatial = _conv_model("[scale] y = Mul (c, s)", [_init("s", RNG.standard_normal((1, 8, 6, 6)))])
    result = fold_affines(spatial)
    assert not result and "varies along more than the channels" in result.details["declined"]["conv"]
    # x -> Conv -> c -> Mul(1e-6) -> y : weights ~0.3 would land at ~3e-7, deep in FP16 subnormals
    tiny = _conv_model("[scale] y = Mul (c, s)", [_init("s", 1e-6)])
    result = fold_affines(tiny, FP16, largest=32752)
    assert not result and "below fp16's smallest normal" in result.details["declined"]["conv"]
    assert fold_affines(tiny)  # no format given: nothing to store worse
    # x -> Conv -> c -> Mul(1e6) -> y : weights past FP16's range
    huge = _conv_model("[scale] y = Mul (c, s)", [_init("s", 1e6)])
    result = fold_affines(huge, FP16, largest=32752)
    assert not result and "would reach" in result.details["declined"]["conv"]
    # x -> Conv(8 channels) -> c -> BatchNormalization(4 values each): a broken model, declined
    short = _conv_model("[bn] y = BatchNormalization (c, g, b, m, v)",
                        [_init(n, np.ones(4)) for n in ("g", "b", "m", "v")], check=False)
    result = fold_affines(short, FP16, largest=32752)
    assert not result and "parameters do not hold one value per channel (8)" in result.reason
    # x -> Conv -> c -> [Mul(2) -> y1, Relu -> y2] : c is read twice
    shared = _conv_model("[scale] y = Mul (c, s)", [_init("s", 2.0)])
    shared.graph.output.append(helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, [1, 8, 6, 6]))
    assert not fold_affines(shared)


def test_a_batchnorm_that_would_push_the_weights_subnormal_becomes_one_mul_and_add():
    # x -> Conv(W ~0.3) -> c -> BatchNormalization(var ~1e8: over FP16's max; W/1e4 subnormal) -> y
    bn = [_init("gamma", RNG.uniform(1, 2, 8)), _init("beta", np.zeros(8)),
          _init("mean", np.zeros(8)), _init("var", RNG.uniform(1e8, 2e8, 8))]
    proto = _conv_model("[bn] y = BatchNormalization (c, gamma, beta, mean, var)", bn)
    result = fold_affines(proto, FP16, largest=32752)
    how = result.details["partial"]["conv"]
    assert result and how.startswith("BatchNormalization bn as one Mul and Add after it (not folded: ")
    assert re.search(r"its variance reaches 1\.\d+e\+08, beyond fp16.s max 65504: the scale is stored instead", how)
    assert sorted(n.op_type for n in result.model.graph.node) == ["Add", "Conv", "Mul"]
    feed = _x()
    _same(proto, result.model, feed)
    emulated = run(make_session(emulate(result.model, FP16, saturate=False).model), feed)["y"]
    exact = run(make_session(proto), feed)["y"]
    assert np.isfinite(emulated).all()
    assert np.linalg.norm(emulated - exact) / np.linalg.norm(exact) < 1e-2
    # The BatchNormalization itself does not survive FP16: its variance is Inf, its output 0.
    unfused = run(make_session(emulate(proto, FP16, saturate=False).model), feed)["y"]
    assert np.linalg.norm(unfused - exact) / np.linalg.norm(exact) > 0.99


def test_folding_removes_roundings_under_fp16_emulation():
    # x -> Conv -> c -> Mul(0.37) -> m -> Add(0.1) -> y ; 2 stored tensors fewer in FP16
    proto = _conv_model("[scale] m = Mul (c, s)\n        [shift] y = Add (m, t)",
                        [_init("s", 0.37), _init("t", 0.1)])
    folded = fold_affines(proto, FP16, largest=32752).model
    feeds = [_x(3.0) for _ in range(8)]
    errors = []
    for model in (proto, folded):
        session = make_session(emulate(model, FP16, saturate=False).model)
        reference = make_session(proto)
        errors.append(max(
            float(np.linalg.norm(run(session, f)["y"] - run(reference, f)["y"])
                  / np.linalg.norm(run(reference, f)["y"])) for f in feeds))
    assert errors[1] < 0.8 * errors[0], errors


# x -> Mul(2) -> a -> [Add(3) -> Clip(0, 6) -> Mul(a, .) -> Div(6)] -> y
HARDSWISH = """
<ir_version: 8, opset_import: ["" : {opset}]>
g (float[2, 16] x) => (float[2, 16] y) <float two = {{2.0}}, float three = {{3.0}}, float zero = {{0.0}},
                                        float six = {{6.0}}, float sixth = {{0.16666667}}> {{
    [pre] a = Mul (x, two)
    [plus3] p = Add (three, a)
    [relu6] r = Clip (p, zero, six)
    {tail}
}}
"""
DIV_LAST = "[times] m = Mul (a, r)\n    [hswish] y = Div (m, six)"
GATE_FIRST = "[gate] h = Mul (r, sixth)\n    [hswish] y = Mul (a, h)"


def test_a_written_out_hardswish_is_one_op_from_opset_14():
    for tail in (DIV_LAST, GATE_FIRST):
        proto = parser.parse_model(HARDSWISH.format(opset=17, tail=tail))
        result = fuse_hardswish(proto)
        assert result, tail
        ops = [(n.name, n.op_type) for n in result.model.graph.node]
        assert ops == [("pre", "Mul"), ("hswish", "HardSwish")]
        _same(proto, result.model, {"x": np.linspace(-5, 5, 32, dtype=np.float32).reshape(2, 16)})


def test_before_opset_14_it_is_x_times_hardsigmoid_with_clip_bounds_as_attributes():
    text = HARDSWISH.format(opset=12, tail=DIV_LAST)
    proto = parser.parse_model(text)
    result = fuse_hardswish(proto)
    assert result and "opset 12 has no HardSwish" in result.reason
    ops = sorted(n.op_type for n in result.model.graph.node)
    assert ops == ["HardSigmoid", "Mul", "Mul"]
    feed = {"x": np.linspace(-5, 5, 32, dtype=np.float32).reshape(2, 16)}
    _same(proto, result.model, feed, rtol=1e-6)
    # opset 10: Clip's bounds are attributes
    old = parser.parse_model(text.replace('"" : 12', '"" : 10').replace(
        "Clip (p, zero, six)", "Clip <min = 0.0, max = 6.0> (p)"))
    assert fuse_hardswish(old)


def test_declines_a_hardswish_whose_inner_tensor_is_read_elsewhere_or_other_bounds():
    shared = parser.parse_model(HARDSWISH.format(opset=17, tail=DIV_LAST).replace(
        "=> (float[2, 16] y)", "=> (float[2, 16] y, float[2, 16] m)"))
    result = fuse_hardswish(shared)
    assert not result and result.model is shared
    assert "m (of times) is read elsewhere too" in result.details["declined"]["hswish"]
    relu6_only = parser.parse_model(HARDSWISH.format(opset=17, tail=DIV_LAST).replace(
        "float six = {6.0}", "float six = {5.0}"))
    result = fuse_hardswish(relu6_only)
    assert not result and result.reason == "no written-out hard-swish"


@pytest.mark.parametrize("opset", [17, 12])
def test_convert_plans_and_verifies_the_fused_graph(tmp_path, opset):
    # x -> Conv -> Mul(1.4) -> Add(0.6) -> hard-swish (4 nodes) -> Conv -> y
    w2 = RNG.standard_normal((3, 8, 1, 1)).astype(np.float32) * 0.3
    proto = _conv_model("""[scale] m = Mul (c, s)
        [shift] a = Add (m, t)
        [plus3] p = Add (a, three)
        [relu6] r = Clip (p, zero, six)
        [times] q = Mul (a, r)
        [hswish] h = Div (q, six)
        [head] y = Conv (h, w2)""", [_init("s", 1.4), _init("t", 0.6), _init("three", 3.0),
                                     _init("zero", 0.0), _init("six", 6.0), _init("w2", w2)],
                        out_channels=3, opset=opset)
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    model = Model(proto=proto, path=str(path), digest=fingerprint(proto))
    samples = [_x() for _ in range(4)]
    from npuprep.calibrate import calibrate

    result = convert(model, load_profile("generic"), samples, stats=calibrate(model, samples))
    lowered = result.lowered.model
    ops = sorted(n.op_type for n in lowered.graph.node if n.op_type != "Cast")
    hard_swish = ["HardSwish"] if opset >= 14 else ["HardSigmoid", "Mul"]
    assert ops == sorted(["Conv", "Conv", *hard_swish])
    assert result.passed, result.notes
    assert any("fused before planning: 1 Conv(s) took the scale and shift" in n for n in result.notes)
    assert any(f"fused before planning: 1 written-out hard-swish(es) as {'HardSwish' if opset >= 14 else 'x * HardSigmoid(x)'}"
               in n for n in result.notes)
    # The HardSigmoid gate lies in [0, 1]: no second calibration pass to measure it.
    assert not any(n.startswith("measured") for n in result.notes), result.notes
    feed = samples[0]
    np.testing.assert_allclose(run(make_session(result.rewritten), feed)["y"],
                               run(make_session(proto), feed)["y"], rtol=1e-4, atol=1e-4)


def test_a_bf16_weighted_conv_folds_and_json_stays_clean(tmp_path):
    # x -> Conv(Cast32(W_bf16)) -> c -> BatchNormalization -> y ; graph surgeon cannot type BF16
    import json

    import ml_dtypes

    from tests.conftest import run_cli

    w = np.asarray(RNG.standard_normal((8, 4, 3, 3)) * 0.3, ml_dtypes.bfloat16)
    bn = [_init("gamma", RNG.uniform(0.5, 2, 8)), _init("beta", RNG.standard_normal(8)),
          _init("mean", RNG.standard_normal(8)), _init("var", RNG.uniform(0.1, 3, 8))]
    proto = _conv_model("[bn] y = BatchNormalization (c, gamma, beta, mean, var)", bn)
    proto.graph.node[0].input[1] = "w32"
    proto.graph.node.insert(0, helper.make_node("Cast", ["w_bf16"], ["w32"], name="cast_w",
                                                to=onnx.TensorProto.FLOAT))
    proto.graph.initializer.remove(next(i for i in proto.graph.initializer if i.name == "w"))
    proto.graph.initializer.append(helper.make_tensor("w_bf16", onnx.TensorProto.BFLOAT16, w.shape,
                                                      w.view(np.uint16).tobytes(), raw=True))
    onnx.checker.check_model(proto, full_check=True)
    path, data = tmp_path / "bf.onnx", tmp_path / "data"
    onnx.save(proto, path)
    data.mkdir()
    for i in range(3):
        np.savez(data / f"{i}.npz", **_x())
    done = run_cli("convert", path, "--target", "a2000", "--data", data, "-o", tmp_path / "o.onnx",
                   "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert any("fused before planning: 1 Conv(s)" in n for n in report["notes"])
    converted = onnx.load(tmp_path / "o.onnx")
    assert [n.op_type for n in converted.graph.node if n.op_type not in ("Cast",)] == ["Conv"]


def test_check_and_compare_say_what_convert_fuses_before_planning(tmp_path):
    # x -> Conv -> c -> BatchNormalization -> y : check finds on the fused graph and says so
    from tests.conftest import run_cli

    bn = [_init("gamma", RNG.uniform(0.5, 2, 8)), _init("beta", RNG.standard_normal(8)),
          _init("mean", RNG.standard_normal(8)), _init("var", RNG.uniform(0.1, 3, 8))]
    path = tmp_path / "bn.onnx"
    onnx.save(_conv_model("[bn] y = BatchNormalization (c, gamma, beta, mean, var)", bn), path)
    done = run_cli("check", path, "--target", "generic")
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stdout.split())
    assert "note: fused before planning: 1 Conv(s) took the scale and shift after them (conv)" in said
    assert max(map(len, done.stdout.splitlines())) <= 100
    # compare --emulate emulates the model as exported, and says convert does not
    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "0.npz", **_x())
    done = run_cli("compare", path, "--emulate", "--target", "generic", "--data", data)
    assert done.returncode in (0, 1), done.stderr
    said = " ".join(done.stdout.split())
    assert ("note: this emulates the model as exported; convert plans and verifies it after the "
            "changes a compiler makes (1: fused before planning: 1 Conv(s)") in said


def test_the_tensor_a_partial_fusion_makes_is_measured_when_samples_are_given():
    # x -> Conv -> c -> BatchNormalization(var ~1e8) -> y ; becomes Conv -> Mul -> y.scaled -> Add -> y
    from npuprep.calibrate import calibrate
    from npuprep.rewrite.passes import prepare_for_target

    bn = [_init("gamma", RNG.uniform(1, 2, 8)), _init("beta", np.zeros(8)),
          _init("mean", np.zeros(8)), _init("var", RNG.uniform(1e8, 2e8, 8))]
    proto = _conv_model("[bn] y = BatchNormalization (c, gamma, beta, mean, var)", bn)
    model = Model(proto=proto, path="bn.onnx", digest=fingerprint(proto))
    samples = [_x() for _ in range(3)]
    stats = calibrate(model, samples)
    generic = load_profile("generic").resolve()
    first = prepare_for_target(model, generic, stats)
    work, unmeasured, notes = first.model, first.stats, first.notes
    assert "y.scaled" in {t for n in work.proto.graph.node for t in n.output}
    assert "y.scaled" not in unmeasured.tensors
    assert any("have no measured range yet (y.scaled); convert, or check with --data, measures "
               "them" in n for n in notes), notes
    second = prepare_for_target(model, generic, stats, samples)
    measured, notes = second.stats, second.notes
    assert measured.tensors["y.scaled"].count == 3 * 8 * 36
    assert any(n.startswith("measured 1 tensor(s)") for n in notes), notes
