"""OpenVINO in the loop: its runtime report read by crosscheck, its real FP16/BF16 kernels.

Skipped where `openvino` is not installed (CI installs npuprep[openvino], so they run there).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import parser

from npuprep.crosscheck.check import crosscheck
from npuprep.crosscheck.names import NodeIndex
from npuprep.crosscheck.openvino import read_openvino
from npuprep.errors import NpuprepError
from npuprep.model_io import Model, fingerprint
from npuprep.profiles import load_profile
from npuprep.runtime.session import make_session, run

pytest.importorskip("openvino")

from npuprep.vendors.openvino import capabilities, run_openvino  # noqa: E402

# What this CPU has kernels for: without BF16 / FP16 ones (an AVX2-only CPU) OpenVINO runs
# those hints in FP32, and the tests check that npuprep says so instead of their overflow.
HAS_BF16, HAS_FP16 = "BF16" in capabilities(), "FP16" in capabilities()
from npuprep.verify.vendor_openvino import openvino_check  # noqa: E402


def _mlp() -> onnx.ModelProto:
    # x -> mm (MatMul, W) -> ex (Exp) -> sq (Mul ex*ex) -> z (Add sq+x)
    eye = ", ".join("1" if i == j else "0" for i in range(16) for j in range(16))
    m = parser.parse_model(f"""<ir_version: 8, opset_import: ["" : 17]>
    g (float[2,16] x) => (float[2,16] z) {{
      w = Constant<value = float[16,16] {{{eye}}}>()
      h = MatMul(x, w)
      e = Exp(h)
      s = Mul(e, e)
      z = Add(s, x)
    }}""")
    for node, name in zip(m.graph.node, ("w", "mm", "ex", "sq", "add"), strict=True):
        node.name = name
    return m


def _model(proto: onnx.ModelProto) -> Model:
    return Model(proto=proto, path="mlp.onnx", digest=fingerprint(proto))


def test_bf16_hint_crosscheck_reads_bf16_matmul_and_fp32_elementwise() -> None:
    proto = _mlp()
    x = np.full((2, 16), 0.5, np.float32)
    done = run_openvino(proto, [{"x": x}], "bf16")
    model = _model(proto)
    index = NodeIndex(model)
    report = read_openvino("runtime.json", json.loads(json.dumps(done.report())), index)
    result = crosscheck(model, report, load_profile("openvino-cpu").resolve("bf16"), index=index)
    runs = {v.node: v.runs_in for v in result.verdicts}
    # The CPU plugin runs the MatMul on its BF16 kernel and keeps the fused Exp/Mul/Add in FP32;
    # a CPU without BF16 kernels runs it in FP32 too, and the crosscheck says why.
    assert runs["mm"] == ("bf16" if HAS_BF16 else "fp32")
    assert runs["ex"] == runs["sq"] == runs["add"] == "fp32"
    assert any("has no BF16 kernels" in n for n in result.notes) is not HAS_BF16
    # BF16 rounding of 0.5 is exact: the outputs match FP32 onnxruntime to BF16's precision.
    expected = run(make_session(proto), {"x": x})["z"]
    np.testing.assert_allclose(done.outputs[0]["z"], expected, rtol=1e-2)


def test_f16_hint_overflows_loudly_and_crosscheck_names_the_ignored_pin() -> None:
    # x = 6: Exp gives 403, Exp^2 = 1.6e5 > 65504: Inf in FP16, finite in FP32.
    proto = _mlp()
    x = np.full((2, 16), 6.0, np.float32)
    target = load_profile("openvino-cpu").resolve("fp16")
    check = openvino_check(proto, proto, [{"x": x}], target, precision="fp16")
    assert np.isfinite(run(make_session(proto), {"x": x})["z"]).all()
    assert check.built and check.layers is not None
    if not HAS_FP16:
        # No FP16 kernels: it ran in FP32, finite, and the check says it shows no FP16 overflow
        # (not that OpenVINO chose to run the layers wider).
        assert check and check.outputs["z"]["nonfinite"] == 0
        assert any("has no FP16 kernels" in n and "neither FP16's rounding nor its overflow" in n
                   for n in check.layers.notes)
        assert not any("own choice" in n for n in check.layers.notes)
        return
    assert not check
    assert check.outputs["z"]["nonfinite"] == 32
    model = _model(proto)
    report = read_openvino("r.json", json.loads(check.accuracy_report), NodeIndex(model))
    pinned = crosscheck(model, report, target, pinned_nodes=("sq",))
    assert [v.node for v in pinned.of("pin-ignored")] == ["sq"]


def test_report_that_is_not_openvinos_is_one_clear_error() -> None:
    model = _model(_mlp())
    with pytest.raises(NpuprepError, match=r"r\.json: top level: not an OpenVINO runtime report"):
        read_openvino("r.json", {"format": "openvino_runtime"}, NodeIndex(model))


def test_unnamed_graph_output_node_maps_by_its_tensor() -> None:
    # OpenVINO names the node that writes a graph output after the output (`z`, `z.0`).
    proto = _mlp()
    proto.graph.node[-1].name = ""
    model = _model(proto)
    index = NodeIndex(model)
    data = {"format": "openvino_runtime", "layers": [
        {"name": "z.0", "type": "Subgraph", "runtime_precision": "f16",
         "output_precisions": ["f32"], "original_names": ["ex", "sq", "z", "z.0"]}]}
    record = read_openvino("r.json", data, index).records[0]
    assert record.onnx_nodes == ("ex", "sq", index.producer["z"])


def test_probe_through_openvino_fp16_is_loud_and_bf16_keeps_fp32_range() -> None:
    from npuprep.numerics import get_format
    from npuprep.probe.openvino_backend import OpenvinoBackend
    from npuprep.probe.runner import run_micro_probes

    # The Mul probe's product is 1.3e5: past FP16's 65504, well inside BF16's range.
    fp16 = run_micro_probes(OpenvinoBackend("fp16"), get_format("fp16"), ("mul",))
    bf16 = run_micro_probes(OpenvinoBackend("bf16"), get_format("bf16"), ("mul",))
    # Without FP16 kernels the product comes back exactly: computed wider, said as such.
    assert [r.verdict for r in fp16.results] == ["inf" if HAS_FP16 else "no-overflow"]
    assert fp16.results[0].classification.wider is not HAS_FP16
    assert [r.verdict for r in bf16.results] == ["no-overflow"]


def test_probe_of_a_format_openvino_has_no_hint_for_is_one_line_exit_2() -> None:
    # probe --backend openvino --precision fp8_e4m3: the hint would fall back to bf16 and
    # measure that instead, so it is refused
    from tests.conftest import run_cli

    done = run_cli("probe", "--target", "openvino-cpu", "--backend", "openvino",
                   "--precision", "fp8_e4m3")
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr.strip().splitlines() == [
        "npuprep: error: --backend openvino has no precision hint for fp8_e4m3 (it runs fp32, "
        "bf16, fp16); it cannot probe fp8_e4m3"]


def test_int8_clip_probe_on_openvinos_int8_path_saturates() -> None:
    from npuprep.probe.int8_clip import run_clip_probe

    assert run_clip_probe("openvino").verdict == "saturate"


def test_crosscheck_cli_vendor_report_saved_and_read_back(tmp_path) -> None:
    from conftest import run_cli

    path = tmp_path / "mlp.onnx"
    onnx.save(_mlp(), str(path))
    saved = tmp_path / "rt.json"
    made = run_cli("crosscheck", path, "--vendor", "openvino", "--target", "openvino-cpu",
                   "--save-report", saved, "--json")
    again = run_cli("crosscheck", path, "--report", saved, "--target", "openvino-cpu", "--json")
    assert made.returncode == again.returncode == 0, made.stderr + again.stderr
    first, second = json.loads(made.stdout), json.loads(again.stdout)
    assert second["report_format"] == "openvino"
    runs = {v["node"]: v["runs_in"] for v in second["verdicts"]}
    assert runs["mm"] == ("bf16" if HAS_BF16 else "fp32") and runs["ex"] == "fp32"
    assert first["counts"] == second["counts"]
    assert json.loads(saved.read_text())["capabilities"] == list(capabilities())
    both = run_cli("crosscheck", path, "--report", saved, "--vendor", "openvino",
                   "--target", "openvino-cpu")
    assert both.returncode == 2 and "not both" in both.stderr


def test_convert_verify_with_openvino_gives_its_outputs_verdict_and_runtime_precisions() -> None:
    from npuprep.convert import convert
    from npuprep.pipeline import CALIBRATE

    rng = np.random.default_rng(0)
    samples = [{"x": rng.uniform(-1, 1, (2, 16)).astype(np.float32)} for _ in range(4)]
    result = convert(_model(_mlp()), load_profile("openvino-cpu"), samples, stats=CALIBRATE,
                     verify_with="openvino")
    check = result.vendor
    assert check is not None and check.built and check
    assert check.target_platform == "CPU, hint bf16"
    # Its error is BF16's: at most a few BF16 ulps (2^-8 relative), never zero, never large;
    # without BF16 kernels it ran in FP32 (float rounding only).
    assert (0 if HAS_BF16 else -1) < check.outputs["z"]["rel_l2"] < (2 ** -6 if HAS_BF16 else 1e-6)
    assert check.layers is not None and bool(check.layers)
    assert {v.node: v.runs_in for v in check.layers.verdicts}["mm"] == ("bf16" if HAS_BF16
                                                                        else "fp32")
    assert json.loads(check.accuracy_report)["hint"] == "bf16"


def test_fullyconnected_named_after_its_bias_carries_the_matmul_not_the_weight_transpose() -> None:
    # OpenVINO: `mm/transpose_b` (f32) is the weight's transpose; the FullyConnected that ran
    # mm keeps only the name of the node it absorbed after it (`ex` here).
    model = _model(_mlp())
    index = NodeIndex(model)
    data = {"format": "openvino_runtime", "layers": [
        {"name": "mm/transpose_b", "type": "Transpose", "runtime_precision": "f32",
         "output_precisions": ["f32"], "original_names": ["mm/transpose_b"]},
        {"name": "ex", "type": "FullyConnected", "runtime_precision": "bf16",
         "output_precisions": ["bf16"], "original_names": ["ex"]}]}
    report = read_openvino("r.json", data, index)
    result = crosscheck(model, report, load_profile("openvino-cpu").resolve("bf16"), index=index)
    assert {v.node: v.runs_in for v in result.verdicts}["mm"] == "bf16"


def test_a_report_from_a_cpu_without_the_hints_kernels_says_it_shows_no_such_rounding() -> None:
    # The same runtime layers, read as a CPU listing BF16, an AVX2-only one and an older
    # report without capabilities would give them.
    model = _model(_mlp())
    layers = [{"name": "mm", "type": "FullyConnected", "runtime_precision": "f32",
               "output_precisions": ["f32"], "original_names": ["mm"]}]

    def notes(caps: list[str] | None) -> tuple[str, ...]:
        data = {"format": "openvino_runtime", "device": "CPU", "hint": "bf16", "layers": layers}
        if caps is not None:
            data["capabilities"] = caps
        return read_openvino("r.json", data, NodeIndex(model)).notes

    assert not any("kernels" in n for n in notes(["FP32", "BF16", "INT8", "BIN"]))
    assert not any("kernels" in n for n in notes(None))
    assert ("this CPU has no BF16 kernels (OPTIMIZATION_CAPABILITIES: FP32, INT8): OpenVINO ran "
            "the bf16 hint in FP32") in notes(["FP32", "INT8", "BIN", "EXPORT_IMPORT"])[-1]
