"""The format is resolved once: `--precision bf16` is BF16 in findings, emulation, plan and ledger.

BF16 has FP32's range and 8 significant bits: nothing overflows at 1e5, 257 rounds to 256,
and its hazard is precision (a cancellation, a softmax's logits too coarse for exp).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper, parser

import npuprep
from npuprep.analyse import findings_for, static_findings
from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.data import load_samples
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import get_format
from npuprep.plan.planner import make_plan
from npuprep.profiles import TargetProfile, load_profile
from npuprep.rewrite.lower import lower
from npuprep.verify.emulate import emulate

A100 = load_profile("a100")  # FP16 by default, BF16 a fast path
BF16, FP16 = A100.resolve("bf16"), A100.resolve()


def _model(text: str, **weights: float | list[float] | np.ndarray) -> Model:
    proto = parser.parse_model(text)
    for name, value in weights.items():
        array = np.asarray(value)
        array = array.astype(np.float32) if array.dtype.kind == "f" else array
        proto.graph.initializer.append(numpy_helper.from_array(array, name))
    onnx.checker.check_model(proto, full_check=True)
    return Model(proto, "model.onnx", fingerprint(proto))


def _samples(tmp_path: Path, model: Model, xs: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    folder = tmp_path / f"data_{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    for i, x in enumerate(xs):
        np.savez(folder / f"sample_{i:03d}.npz", x=x.astype(np.float32))
    return list(load_samples(str(folder), model.proto))


def _run(proto: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, f)[0].ravel() for f in feeds])


def _rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_no_profile_accessor_reads_a_default_format():
    # The profile offers no format, limit or overflow mode: only a ResolvedTarget does.
    for name in ("format", "saturates", "limit"):
        assert not hasattr(TargetProfile, name), name
    root = Path(npuprep.__file__).parent
    # The YAML field is read where the format is resolved and where profiles are listed only.
    allowed = {root / "profiles.py", root / "cli" / "targets.py"}
    readers = [str(p.relative_to(root)) for p in sorted(root.rglob("*.py")) if p not in allowed
               and re.search(r"\.default_precision\b|\.saturates\b|profile\.format\b|\.limit\(\)",
                             p.read_text())]
    assert readers == []


def test_bf16_limits_in_static_and_measured_findings(tmp_path: Path):
    # x -> Mul(x, x) -> y ; w = 1e5 (a constant) -> Add(x, w) -> z
    model = _model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x) => (float[4] y, float[4] z) { y = Mul(x, x)  z = Add(x, w) }
        """, w=[1e5, 0, 0, 0])
    stats = calibrate(model, _samples(tmp_path, model, [np.array([316.0, 1, 2, 3])]))
    assert stats.tensors["y"].absmax > 9.9e4
    fp16 = {(f.rule, f.tensor) for f in findings_for(model, FP16, stats)}
    bf16 = list(findings_for(model, BF16, stats))
    assert {("range.overflow", "y"), ("init.out_of_range", "w")} <= fp16
    # 1e5 is no overflow in BF16 (max 3.39e38), and the square's limit is BF16's.
    assert not [f for f in bf16 if f.rule in ("range.overflow", "range.headroom",
                                               "init.out_of_range")]
    square = next(f for f in static_findings(model, BF16) if f.rule == "hazard.square")
    assert square.evidence["format"] == "bf16" and square.evidence["input_limit"] > 1e19


def test_bf16_emulation_rounds_what_fp16_keeps():
    # x -> Add(x, 0) -> y: 257 needs 9 significant bits (FP16 has 11, BF16 8).
    model = _model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3] x) => (float[3] y) { y = Add(x, zero) }
        """, zero=0.0)
    feed = [{"x": np.array([257.0, 1.00390625, 1e5], np.float32)}]
    in_fp16 = _run(emulate(model.proto, get_format("fp16"), saturate=False).model, feed)
    in_bf16 = _run(emulate(model.proto, BF16.fmt, saturate=BF16.saturate).model, feed)
    assert in_fp16[:2].tolist() == [257.0, 1.00390625] and np.isinf(in_fp16[2])
    assert in_bf16.tolist() == [256.0, 1.0, 99840.0]


def test_a_cancellation_in_bf16_is_kept_fp32(tmp_path: Path):
    # x in [0, 4] -> Add(x, 30) -> a -> Sub(a, 30) -> y: y inherits a's rounding 8.5x.
    model = _model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[64] x) => (float[64] y) {
            a = Add(x, thirty)
            y = Sub(a, thirty)
        }
        """, thirty=30.0)
    rng = np.random.default_rng(0)
    feeds = _samples(tmp_path, model, [rng.uniform(0, 4, 64) for _ in range(4)])
    stats = calibrate(model, feeds)
    assert not [f for f in findings_for(model, FP16, stats) if f.rule.startswith("precision.")]
    (found,) = [f for f in findings_for(model, BF16, stats) if f.rule == "precision.cancellation"]
    assert found.node == "y" or found.tensor == "y"
    assert 8 < found.evidence["gain"] < 9
    plan = make_plan(model, BF16, stats, findings_for(model, BF16, stats))
    pinned = set(plan.pinned_nodes())
    assert len(pinned) == 2 and plan.precision == "bf16"
    want = _run(model.proto, feeds)
    kept = _run(emulate(model.proto, BF16.fmt, saturate=False, pinned_nodes=pinned).model, feeds)
    rounded = _run(emulate(model.proto, BF16.fmt, saturate=False).model, feeds)
    assert _rel_l2(rounded, want) > 1e-2 > 1e-6 > _rel_l2(kept, want)


def test_convert_in_bf16_says_bf16_and_shifts_coarse_logits(tmp_path: Path):
    # x in [24, 40] -> Exp -> e -> ReduceSum -> s ; Div(e, s) -> p: a written-out softmax
    # that fits BF16's range, but whose logits BF16 rounds in steps of 0.125 (exp: 6%).
    model = _model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,16] x) => (float[1,16] p) {
            e = Exp(x)
            s = ReduceSum<keepdims = 1>(e, axes)
            p = Div(e, s)
        }
        """, axes=np.array([-1], np.int64))
    rng = np.random.default_rng(1)
    feeds = _samples(tmp_path, model, [rng.uniform(24, 40, (1, 16)) for _ in range(6)])
    want = _run(model.proto, feeds)
    plain = _run(emulate(model.proto, BF16.fmt, saturate=False).model, feeds)
    assert _rel_l2(plain, want) > 2e-2  # the hazard is real in BF16
    result = convert(model, A100, feeds, stats=calibrate(model, feeds), precision="bf16",
                     max_fp32_share=1.0)
    assert result, result.output_check.to_dict()
    assert [a.action for a in result.plan.actions] == ["softmax_shift"]
    assert result.plan.actions[0].fp32_shift
    doc = result.to_dict()
    assert doc["precision"] == "bf16" and result.plan.precision == "bf16"
    assert any(n.startswith("emulated bf16 on target 'a100'") for n in result.notes)
    assert result.ledger is not None and result.ledger["precision"] == "bf16"
    assert "fp16" not in {row["format"] for row in result.ledger["formats"]}


def test_lowering_to_bf16_declares_the_opset_its_ops_need():
    # x -> Pow(x, 2) -> y at opset 14: Pow's exponent takes BF16 from opset 15 on.
    model = _model("""
        <ir_version: 8, opset_import: ["" : 14]>
        g (float[4] x) => (float[4] y) { y = Pow(x, two) }
        """, two=2.0)
    lowered = lower(model.proto, "bf16").model
    assert lowered.opset_import[0].version == 15
    onnx.checker.check_model(lowered, full_check=True)
    assert lower(model.proto, "fp16").model.opset_import[0].version == 14
