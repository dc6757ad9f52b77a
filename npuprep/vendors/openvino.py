"""OpenVINO in process: ONNX -> compiled model on a device -> outputs and its runtime report.

    run_openvino(model, samples, precision="bf16") -> OpenvinoRun(outputs, layers, hint)

The compiled model's runtime graph (`compiled.get_runtime_model()`) says, per executed
layer, the precision the plugin really ran it in (rt_info `runtimePrecision`) and which
ONNX nodes it came from (`originalLayersNames`, the ONNX node names; a node that writes a
graph output is named after that output). `runtime_report` serialises that; crosscheck
reads it back (npuprep/crosscheck/openvino.py). The only home of the `openvino` import.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from npuprep.errors import NpuprepError
from npuprep.graph import with_values

REPORT_FORMAT = "openvino_runtime"
INSTALL_HINT = "install it with: pip install 'npuprep[openvino]'"
# npuprep's format -> OpenVINO's INFERENCE_PRECISION_HINT. The hint is global: the CPU
# plugin runs what it can in the hinted type and keeps the rest (most elementwise ops under
# bf16) in f32. 8-bit formats are not a hint: a QDQ model runs INT8 where OpenVINO's
# low-precision transformations take the pattern, in the hinted float type elsewhere.
HINTS = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}
# OpenVINO's element type names (rt_info runtimePrecision / outputPrecisions) -> npuprep's.
PRECISIONS = {"f64": "fp64", "f32": "fp32", "bf16": "bf16", "f16": "fp16", "i8": "int8",
              "u8": "uint8", "i4": "int4", "u4": "int4", "i16": "int16", "i32": "int32",
              "i64": "int64", "boolean": "bool", "f8e4m3": "fp8_e4m3", "f8e5m2": "fp8_e5m2"}


def available() -> bool:
    """Whether the `openvino` package imports."""
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def _ov() -> Any:
    try:
        import openvino
    except ImportError:
        raise NpuprepError(f"openvino is not installed; {INSTALL_HINT}") from None
    return openvino


def version() -> str:
    """The installed OpenVINO's version string."""
    return str(_ov().get_version())


def hint_for(precision: str, default: str = "bf16") -> str:
    """The precision hint for npuprep format `precision`; 8-bit formats take `default`'s."""
    if precision in HINTS:
        return HINTS[precision]
    if default in HINTS:
        return HINTS[default]
    raise NpuprepError(f"openvino: no precision hint for '{precision}' (known: "
                       f"{', '.join(HINTS)})")


@dataclass(frozen=True)
class RuntimeLayer:
    """One executed layer of the compiled model, as its runtime graph describes it."""

    name: str
    layer_type: str
    runtime_precision: str  # OpenVINO's element type name: f32, bf16, f16, u8, i8, ...
    output_precisions: tuple[str, ...]
    original_names: tuple[str, ...]  # the ONNX node (or output tensor) names it came from
    primitive: str  # the kernel: brgemm_avx512_bf16, jit_avx512_f32, ...

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.layer_type,
                "runtime_precision": self.runtime_precision,
                "output_precisions": list(self.output_precisions),
                "original_names": list(self.original_names), "primitive": self.primitive}


@dataclass(frozen=True)
class OpenvinoRun:
    """What one compile-and-run gave: outputs per sample and the runtime layers; the device's
    OPTIMIZATION_CAPABILITIES (FP32, BF16, FP16, INT8, ...: the types it has kernels for)."""

    device: str
    hint: str
    version: str
    layers: tuple[RuntimeLayer, ...]
    outputs: tuple[dict[str, np.ndarray], ...]
    capabilities: tuple[str, ...] = ()

    def report(self) -> dict[str, Any]:
        """The runtime report crosscheck reads (`--report-format openvino`)."""
        return runtime_report(self.layers, self.device, self.hint, self.version,
                              self.capabilities)


def runtime_report(layers: Sequence[RuntimeLayer], device: str, hint: str,
                   ov_version: str, capabilities: Sequence[str] = ()) -> dict[str, Any]:
    return {"format": REPORT_FORMAT, "openvino": ov_version, "device": device, "hint": hint,
            "capabilities": list(capabilities), "layers": [layer.to_dict() for layer in layers]}


def capabilities(device: str = "CPU") -> tuple[str, ...]:
    """The number types `device` has kernels for (OPTIMIZATION_CAPABILITIES): a CPU without
    BF16 or FP16 ones (AVX2 only) runs those hints in FP32."""
    return tuple(str(c) for c in _ov().Core().get_property(device, "OPTIMIZATION_CAPABILITIES"))


def compile_onnx(model: onnx.ModelProto, hint: str, device: str = "CPU") -> Any:
    """`model` compiled for `device` with INFERENCE_PRECISION_HINT `hint`."""
    ov = _ov()
    core = ov.Core()
    with tempfile.TemporaryDirectory(prefix="npuprep-openvino-") as tmp:
        path = Path(tmp) / "model.onnx"
        # OpenVINO reads the file on its own: weights npuprep left in their source's files go
        # in, then beside this file when large (a model over 2 GB cannot be one protobuf).
        full = with_values(model)
        onnx.save(full, str(path), save_as_external_data=full.ByteSize() > 1 << 30)
        try:
            read = core.read_model(str(path))
        except RuntimeError as e:
            raise NpuprepError(f"openvino refused the model: {_first_line(e)}") from None
        try:
            return core.compile_model(read, device, {"INFERENCE_PRECISION_HINT": hint})
        except RuntimeError as e:
            raise NpuprepError(f"openvino could not compile the model for {device} with "
                               f"hint {hint}: {_first_line(e)}") from None


def runtime_layers(compiled: object) -> tuple[RuntimeLayer, ...]:
    """The executed layers of a compiled model, in execution order."""
    layers = []
    for op in compiled.get_runtime_model().get_ordered_ops():  # type: ignore[attr-defined]
        info = op.get_rt_info()

        def text(key: str, info: object = info) -> str:
            return str(info[key].astype(str)) if key in info else ""  # type: ignore[index,operator]

        layers.append(RuntimeLayer(
            name=op.get_friendly_name(), layer_type=text("layerType"),
            runtime_precision=text("runtimePrecision"),
            output_precisions=tuple(p for p in text("outputPrecisions").split(",") if p),
            original_names=tuple(n for n in text("originalLayersNames").split(",") if n),
            primitive=text("primitiveType")))
    return tuple(layers)


def report_of(model: onnx.ModelProto, precision: str, *, default: str = "bf16",
              device: str = "CPU") -> dict[str, Any]:
    """The runtime report of `model` compiled for `precision`, without running it."""
    hint = hint_for(precision, default)
    return runtime_report(runtime_layers(compile_onnx(model, hint, device)), device, hint, version(),
                          capabilities(device))


def run_openvino(model: onnx.ModelProto, samples: Sequence[Mapping[str, np.ndarray]],
                 precision: str, *, default: str = "bf16", device: str = "CPU") -> OpenvinoRun:
    """Compile `model` with the hint for `precision` and run it on every sample."""
    hint = hint_for(precision, default)
    compiled = compile_onnx(model, hint, device)
    inputs = {name for port in compiled.inputs for name in port.get_names()}
    request = compiled.create_infer_request()
    outputs = []
    for sample in samples:
        feed = {k: np.asarray(v) for k, v in sample.items() if k in inputs}
        try:
            result = request.infer(feed)
        except RuntimeError as e:
            raise NpuprepError(f"openvino failed to run the model: {_first_line(e)}") from None
        row: dict[str, np.ndarray] = {}
        for port, value in result.items():
            for name in port.get_names():
                row[name] = np.array(value)
        outputs.append(row)
    return OpenvinoRun(device=device, hint=hint, version=version(),
                       layers=runtime_layers(compiled), outputs=tuple(outputs),
                       capabilities=capabilities(device))


def _first_line(error: Exception) -> str:
    """OpenVINO's reason in one line: its summary of unconverted ops when it gives one, else
    its first line that is not a source location or a generic heading."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    if "Summary:" in lines:
        said = [ln.lstrip("- ") for ln in lines[lines.index("Summary:") + 1:]]
    else:
        said = [ln for ln in lines if not ln.startswith(_GENERIC)]
    return "; ".join(said or lines or ["no message"])[:300]


# Lines of OpenVINO's exceptions that say where, not why.
_GENERIC = ("Exception from", "Check ", "Loading input model", "FrontEnd API failed",
            "Model wasn't fully converted", "Failed operations detailed log", "While validating")
