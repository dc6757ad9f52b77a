"""Board timing kit: FP32 and converted models + one input + runner -> results.json -> `--measured`.

`export_kit` stages the kit in an OutputSet (written as a set or not at all); `read_results`
reads what the runner wrote; `measured_rows` puts each measured median beside the ledger's
estimate and flags a gap of more than 2x either way; `read_kit` reads the models and input
sizes of the kit a further results.json sits in, checked against its fingerprint (fit.py fits
them all at once).
"""

from __future__ import annotations

import hashlib
import io
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from npuprep.errors import NpuprepError
from npuprep.json_io import loads
from npuprep.ledger.ledger import CONVERTED, Ledger
from npuprep.model_io import anchored, fingerprint, load_model
from npuprep.output_files import OutputSet

KIND = "ledger-kit"
RESULTS_KIND = "ledger-results"
# Shipped to the board as time_models.py; never imported here (it imports onnxruntime).
RUNNER = Path(__file__).parents[1] / "runtime" / "timing_kit_runner.py"
GAP = 2.0  # measured / estimated beyond this (or below its inverse) is flagged
WARMUP, RUNS = 50, 200


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _stem(name: str) -> str:
    """A tensor name as a file name (`input:0` -> `input_0`)."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name) or "_"


def kit_fingerprint(models: Mapping[str, onnx.ModelProto]) -> str:
    """What ties a results.json to the models it timed: their fingerprints, in kit order."""
    digest = hashlib.sha256()
    for proto in models.values():
        digest.update(fingerprint(proto).encode())
    return digest.hexdigest()[:16]


def kit_files(directory: str | Path, models: Sequence[str], inputs: Sequence[str]) -> list[Path]:
    """The files `export_kit` writes for these model and input names (declare them first; a
    model's `<name>.onnx.data` comes with it, see OutputPlan.writes_model)."""
    d = Path(directory)
    return [d / "manifest.json", d / "time_models.py", d / "README.md",
            *(d / "models" / f"{name}.onnx" for name in models),
            *(d / "inputs" / f"{_stem(name)}.npy" for name in inputs)]


def export_kit(files: OutputSet, directory: str | Path, models: Mapping[str, onnx.ModelProto],
               feeds: Mapping[str, np.ndarray], ledger: Ledger,
               converted_trt: Sequence[str] = ("--fp16",)) -> dict[str, Any]:
    """Stage the kit: `models` by name ('fp32', 'converted'), one input sample, the runner,
    a README with every backend's steps, a manifest with the ledger's estimates.
    `converted_trt`: the trtexec flags convert wrote for the converted model (its FP32 pins
    obeyed); the FP32 model gets `--noTF32` (TensorRT runs FP32 as TF32 unless told)."""
    d = Path(directory)
    estimates = {e.label: e.estimated_ms for e in ledger.estimates}
    entries = []
    for name, proto in models.items():
        # Weights left in the user's files are copied into the kit (external data past 2 GB).
        files.model(proto, d / "models" / f"{name}.onnx")
        entries.append({"name": name, "model": f"models/{name}.onnx",
                        "estimated_ms": estimates.get(CONVERTED if name == CONVERTED else "fp32"),
                        "trtexec_flags": ["--noTF32"] if name == "fp32" else list(converted_trt)})
    inputs = []
    for name, arr in feeds.items():
        stem = _stem(name)
        files.bytes(d / "inputs" / f"{stem}.npy", _npy(np.asarray(arr)))
        inputs.append({"name": name, "file": f"inputs/{stem}.npy", "shape": list(np.shape(arr)),
                       "dtype": str(np.asarray(arr).dtype)})
    manifest = {"kind": KIND, "schema_version": 1, "fingerprint": kit_fingerprint(models),
                "target": ledger.target, "model": ledger.model, "warmup": WARMUP, "runs": RUNS,
                "models": entries, "inputs": inputs}
    files.text(d / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    files.text(d / "time_models.py", RUNNER.read_text(encoding="utf-8"))
    files.text(d / "README.md", _readme(manifest))
    return manifest


def _readme(manifest: Mapping[str, Any]) -> str:
    shapes = ",".join(f"{i['name']}:{'x'.join(str(s) for s in i['shape'])}" for i in manifest["inputs"])
    trt = []
    for m in manifest["models"]:
        flags = "".join(f" {shlex.quote(a)}" for a in m["trtexec_flags"])
        trt.append(f"trtexec --onnx={m['model']}{flags} --shapes={shapes} --warmUp=500 "
                   f"--duration=0 --iterations={manifest['runs'] + manifest['warmup']} --avgRuns=1 "
                   f"--percentile=50,90 --useSpinWait --exportTimes={m['name']}_times.json")
    return "\n".join([
        f"# Timing kit for {manifest['model']} on {manifest['target']}",
        "",
        "Times the FP32 and converted models the way the ledger's estimate must be checked:",
        f"at least {manifest['warmup']} warm-up runs and until the clock has ramped up (two batch",
        f"medians agree), then the median and p90 of {manifest['runs']}, each model in its own",
        "process, peak memory by the runtime's own counter, the device state and clocks noted.",
        "Let the board settle first (no other load, fixed clocks where the board allows).",
        "",
        "## onnxruntime (any execution provider)",
        "",
        "    python time_models.py --providers CUDAExecutionProvider,CPUExecutionProvider",
        "",
        "Inputs and outputs are bound on the provider's device (IO binding): the timing is the",
        "model's, not the copies. A provider this onnxruntime lacks is refused, never replaced.",
        "",
        "## torch only (CUDA, no onnxruntime-gpu)",
        "",
        "Eager torch kernels, one per node (no fusion), for the ops of GEMM, conv and transformer",
        "blocks; any other op is refused by name. Needs torch and onnx:",
        "",
        "    python time_models.py --backend torch",
        "",
        "## Rockchip board (RKNNLite)",
        "",
        "Build each `models/<name>.onnx` on the PC with rknn-toolkit2 (`build(do_quantization=False)`,",
        "`export_rknn('models/<name>.rknn')`), copy the kit to the board, then:",
        "",
        "    python time_models.py --backend rknnlite",
        "",
        "## Jetson Orin (TensorRT)",
        "",
        f"Each line warms the GPU for 500 ms, then runs {manifest['warmup'] + manifest['runs']} "
        f"timed iterations; `--from-trtexec` drops the first {manifest['warmup']} too. Lock the clocks first (`sudo nvpmodel -m 0 && sudo jetson_clocks`); trtexec's",
        "log gives the engine's device memory.",
        "",
        *(f"    {line}" for line in trt),
        "    python time_models.py --from-trtexec " + " ".join(
            f"{m['name']}={m['name']}_times.json" for m in manifest["models"]),
        "",
        "## Back on the host",
        "",
        "    npuprep ledger MODEL --target T [CONVERTED.onnx] --measured results.json",
        "",
        "Kits of other models timed on the same board fit the profile together (efficiency per",
        "format, launch cost per op class, cost per run); each results.json stays in its kit:",
        "",
        "    npuprep ledger MODEL --target T [CONVERTED.onnx] --measured results.json \\",
        "        --measured ../kit_other/results.json --fitted-profile fitted.yaml",
        "",
    ])


@dataclass(frozen=True)
class MeasuredRow:
    """One model: the ledger's estimate beside the board's median."""

    name: str
    estimated_ms: float | None
    median_ms: float
    p90_ms: float | None
    peak_memory_mb: float | None

    @property
    def ratio(self) -> float | None:
        return self.median_ms / self.estimated_ms if self.estimated_ms else None

    @property
    def gap(self) -> bool:
        r = self.ratio
        return r is not None and (r > GAP or r < 1 / GAP)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.name, "estimated_ms": self.estimated_ms, "median_ms": self.median_ms,
                "p90_ms": self.p90_ms, "peak_memory_mb": self.peak_memory_mb,
                "measured_vs_estimated": self.ratio, "gap_over_2x": self.gap}


def read_results(path: str | Path) -> dict[str, Any]:
    """The runner's results.json; a wrong file is one line naming it and the key."""
    try:
        data = loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise NpuprepError(f"--measured {path}: cannot read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise NpuprepError(f"--measured {path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("kind") != RESULTS_KIND:
        raise NpuprepError(f"{path}: key 'kind': expected '{RESULTS_KIND}' (the timing kit's "
                           "results.json)")
    models = data.get("models")
    if not isinstance(models, dict) or not models:
        raise NpuprepError(f"{path}: key 'models': expected a mapping of model name -> timings")
    for name, m in models.items():
        if not isinstance(m, dict) or not isinstance(m.get("median_ms"), int | float):
            raise NpuprepError(f"{path}: key 'models.{name}.median_ms': expected a number")
    return data


def measured_rows(ledger: Ledger, results: Mapping[str, Any]) -> list[MeasuredRow]:
    rows = []
    for name, m in results["models"].items():
        estimate = ledger.get(CONVERTED if name == CONVERTED else "fp32" if name == "fp32" else name)
        rows.append(MeasuredRow(name, estimate.estimated_ms if estimate else None,
                                float(m["median_ms"]), m.get("p90_ms"), m.get("peak_memory_mb")))
    return rows


def check_results(results: Mapping[str, Any], path: str | Path,
                  models: Mapping[str, onnx.ModelProto]) -> None:
    """Refuse a results.json timed on other models than these (another model's kit)."""
    expected, found = kit_fingerprint(models), results.get("kit")
    if found != expected:
        raise NpuprepError(f"{path}: key 'kit': fingerprint {found!r} is not this model's "
                           f"{expected!r} (results of another model or conversion)")


def measured_on(results: Mapping[str, Any]) -> str:
    """The backend and machine the timings come from, for the line that states them."""
    backends = sorted({str(m.get("backend") or "unknown backend") for m in results["models"].values()})
    device = results.get("device") or {}
    machine = ", ".join(str(device[k]) for k in ("gpu", "machine", "platform") if device.get(k))
    return f"{'; '.join(backends)} on {machine or 'an unnamed machine'}"


@dataclass(frozen=True)
class Kit:
    """A kit folder read back: its models by name and its input sizes."""

    model: str  # the model it was exported for (manifest `model`)
    models: dict[str, onnx.ModelProto]
    input_shapes: dict[str, tuple[int, ...]]


def read_kit(results_path: str | Path, results: Mapping[str, Any]) -> Kit:
    """The kit `results_path` sits in, its models checked against the results' fingerprint:
    a results.json copied into another model's kit is refused (exit 2, one line)."""
    folder = Path(results_path).parent
    manifest_path = folder / "manifest.json"
    try:
        manifest = loads(manifest_path.read_text(encoding="utf-8"))
    except OSError:
        raise NpuprepError(f"{results_path}: no kit beside it ({manifest_path} missing): a further "
                           "--measured must sit in the kit folder it timed") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise NpuprepError(f"{manifest_path}: not JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND:
        raise NpuprepError(f"{manifest_path}: key 'kind': expected '{KIND}'")
    models = {}
    for entry in manifest.get("models") or []:
        path = folder / str(entry["model"])
        models[str(entry["name"])] = anchored(load_model(path, weights="file")).proto
    found = results.get("kit")
    if found != kit_fingerprint(models):
        raise NpuprepError(f"{results_path}: key 'kit': fingerprint {found!r} is not its kit's "
                           f"models' {kit_fingerprint(models)!r} (results of another model)")
    shapes = {str(i["name"]): tuple(int(d) for d in i["shape"]) for i in manifest.get("inputs") or []}
    return Kit(str(manifest.get("model") or folder.name), models, shapes)
