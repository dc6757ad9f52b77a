"""Rockchip rknn-toolkit2 as a subprocess: ONNX + .npy samples -> simulator outputs (+ error_analysis).

    run_rknn(model, samples, python=...) -> RknnRun(outputs, log, accuracy_report, warnings)

npuprep never imports the toolkit (it pins numpy<=1.26.4, onnx<=1.18, torch<=2.4.0): it
writes the model, the inputs and a JSON job spec into a work folder and runs
`rknn_job.py` with the vendor venv's python (`--vendor-python`, or NPUPREP_RKNN_PYTHON,
or the default venv that `make_rknn_venv.sh` builds).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from npuprep.errors import NpuprepError
from npuprep.graph import with_values

ENV_PYTHON = "NPUPREP_RKNN_PYTHON"
DEFAULT_VENV = Path.home() / ".cache" / "npuprep" / "rknn-venv"
JOB_SCRIPT = Path(__file__).with_name("rknn_job.py")
KIT_RUNNER = Path(__file__).with_name("rknn_kit_runner.py")
MAKE_VENV = Path(__file__).with_name("make_rknn_venv.sh")
SETUP_HINT = f"build it with: bash {MAKE_VENV} (then export {ENV_PYTHON}=DIR/bin/python)"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# `TypeError: ...`, `onnxruntime.capi.onnxruntime_pybind11_state.InvalidArgument: ...`
_RAISED = re.compile(r"^(?:[a-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Argument|Fail\w*|Exit): "
                     r"(?!Traceback \(most recent call last\))")
# rknn_job.py's `rknn_job: stage NAME` lines: the step a crash happened in.
_STAGE = re.compile(r"rknn_job: stage (\w+)")
# `W ... The range [0.0, inf] of 'r1' is out of the float16!`
_RANGE = re.compile(r"The range \[(?P<lo>[^,\]]+), (?P<hi>[^\]]+)\] of '(?P<tensor>[^']+)' "
                    r"is out of the float16")


def vendor_python(explicit: str | None = None) -> Path | None:
    """The vendor venv's python: `explicit`, else NPUPREP_RKNN_PYTHON, else the default venv."""
    chosen = explicit or os.environ.get(ENV_PYTHON)
    if chosen:
        # Absolute now: the job runs in its own folder, where a relative path means another file.
        path = Path(chosen).absolute()
        source = "--vendor-python" if explicit else ENV_PYTHON
        if not path.is_file():
            raise NpuprepError(f"{source}: '{chosen}' is not a file; {SETUP_HINT}")
        if not os.access(path, os.X_OK):
            raise NpuprepError(f"{source}: '{chosen}' is not executable; {SETUP_HINT}")
        return path
    default = DEFAULT_VENV / "bin" / "python"
    return default if default.is_file() else None


def require_python(explicit: str | None = None) -> Path:
    """vendor_python, or a one-line error saying how to build the venv."""
    found = vendor_python(explicit)
    if found is None:
        raise NpuprepError(f"no rknn-toolkit2 python found ({ENV_PYTHON} unset, "
                           f"{DEFAULT_VENV} missing); {SETUP_HINT}")
    return found


@dataclass(frozen=True)
class RknnRun:
    """What one vendor run gave: outputs per sample (graph output name -> array), its log."""

    ok: bool
    stage: str
    outputs: tuple[dict[str, np.ndarray], ...]
    log: str
    errors: tuple[str, ...] = ()
    range_warnings: tuple[dict[str, str], ...] = ()
    accuracy_report: str = ""
    rknn_file: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.ok

    @property
    def refusal(self) -> str:
        """The vendor's own words for why it stopped (its first error line), or ""."""
        if self.ok:
            return ""
        return self.errors[0] if self.errors else f"{self.stage} failed (no error line in the log)"


def _fixed_inputs(model: onnx.ModelProto, sample: dict[str, np.ndarray]) -> list[dict]:
    """Graph inputs (initialisers excluded) with the sample's shapes: the toolkit wants fixed sizes."""
    inits = {i.name for i in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if vi.name not in sample:
            raise NpuprepError(f"sample has no input '{vi.name}'")
        out.append({"name": vi.name, "shape": list(np.shape(sample[vi.name]))})
    return out


def run_rknn(
    model: onnx.ModelProto,
    samples: Sequence[dict[str, np.ndarray]],
    *,
    python: str | Path | None = None,
    target_platform: str = "rk3588",
    accuracy: bool = False,
    export_rknn: str | None = None,
    work_dir: str | Path | None = None,
    timeout: float = 600.0,
    quantize_on: Sequence[dict[str, np.ndarray]] | None = None,
    hybrid_fp16: Sequence[str | Sequence[str]] = (),
) -> RknnRun:
    """Build `model` in FP16 for `target_platform`, run the simulator on `samples`.

    With `quantize_on` (calibration samples) the build is the toolkit's INT8
    (`do_quantization=True` on a dataset file written from them); with `hybrid_fp16` too,
    the layers producing those tensors stay FP16 (its hybrid quantisation; an entry may
    list alternatives, first choice first; the run's `extra` lists, one a line, the names
    it took and those its graph does not have).

    With `accuracy`, sample 0 also goes through accuracy_analysis and the run carries the
    text of its error_analysis.txt. `work_dir` keeps the files (else a temporary folder).
    """
    exe = require_python(str(python) if python else None)
    if not samples:
        raise NpuprepError("rknn: no samples to run")
    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix="npuprep-rknn-") as tmp:
            return _run_in(Path(tmp), exe, model, samples, target_platform, accuracy,
                           export_rknn, timeout, quantize_on, hybrid_fp16)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    return _run_in(work, exe, model, samples, target_platform, accuracy, export_rknn, timeout,
                   quantize_on, hybrid_fp16)


def _run_in(work: Path, exe: Path, model: onnx.ModelProto, samples: Sequence[dict[str, np.ndarray]],
            target_platform: str, accuracy: bool, export_rknn: str | None,
            timeout: float, quantize_on: Sequence[dict[str, np.ndarray]] | None = None,
            hybrid_fp16: Sequence[str | Sequence[str]] = ()) -> RknnRun:
    inputs = _fixed_inputs(model, samples[0])
    # The toolkit reads the file on its own: weights npuprep left in their files go inline.
    onnx.save(with_values(model), str(work / "model.onnx"))
    files = []
    for i, sample in enumerate(samples):
        row = []
        for j, spec in enumerate(inputs):
            name = f"in/s{i}_i{j}.npy"
            (work / "in").mkdir(exist_ok=True)
            np.save(work / name, np.asarray(sample[spec["name"]], dtype=np.float32))
            row.append(name)
        files.append(row)
    spec = {"model": "model.onnx", "target_platform": target_platform, "inputs": inputs,
            "samples": files, "output_dir": "out", "result": "result.json"}
    if accuracy:
        spec["accuracy_dir"] = "accuracy"
    if quantize_on:
        lines = []
        (work / "calib").mkdir(exist_ok=True)
        for i, sample in enumerate(quantize_on):
            row = [f"calib/c{i}_i{j}.npy" for j in range(len(inputs))]
            for name, spec_in in zip(row, inputs, strict=True):
                np.save(work / name, np.asarray(sample[spec_in["name"]], dtype=np.float32))
            lines.append(" ".join(str((work / r).resolve()) for r in row))
        (work / "dataset.txt").write_text("\n".join(lines) + "\n")
        spec["dataset"] = "dataset.txt"
        if hybrid_fp16:
            spec["hybrid_fp16"] = [t if isinstance(t, str) else list(t) for t in hybrid_fp16]
    if export_rknn:
        spec["export_rknn"] = str(Path(export_rknn).resolve())
    (work / "job.json").write_text(json.dumps(spec, indent=1))
    (work / "result.json").unlink(missing_ok=True)
    try:
        proc = subprocess.run([str(exe), str(JOB_SCRIPT), str(work / "job.json")], cwd=work,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise NpuprepError(f"rknn: the vendor run took longer than {timeout:g} s "
                           f"(files in {work})") from None
    except OSError as e:
        raise NpuprepError(f"rknn: cannot run '{exe}': {e.strerror}") from None
    log = _ANSI.sub("", proc.stdout + proc.stderr)
    (work / "vendor.log").write_text(log)
    result_file = work / "result.json"
    result = json.loads(result_file.read_text()) if result_file.is_file() else {}
    names = [o.name for o in model.graph.output]
    outputs = tuple(
        {names[j] if j < len(names) else f"output{j}": np.load(work / p) for j, p in enumerate(row)}
        for row in result.get("outputs", [])
    )
    report = work / "accuracy" / "error_analysis.txt"
    failed_in = re.search(r"rknn_job: failed in (\w+)", log)
    stages = _STAGE.findall(log)
    stage = result.get("stage") or (failed_in.group(1) if failed_in else
                                    stages[-1] if stages else "import")
    errors = error_lines(log)
    if not result_file.is_file() and not stages and proc.returncode >= 0:
        # The job script reports a stage as soon as the toolkit's API imported: this
        # interpreter is not the toolkit's (/bin/false, a python without it, another program).
        said = next((ln.strip() for ln in reversed(log.splitlines()) if ln.strip()), "no output")
        raise NpuprepError(f"{exe}: this is not an rknn-toolkit2 python (exit {proc.returncode}: "
                           f"{said[:120]}); {SETUP_HINT}")
    if proc.returncode < 0:
        # A crash (SIGSEGV inside the toolkit) leaves no result and often no error line.
        crash = f"the vendor process crashed (signal {-proc.returncode}) in {stage}"
        errors = [*errors, crash] if errors else [crash]
        stage = f"{stage} (crashed)"
    return RknnRun(
        ok=bool(result.get("ok")) and proc.returncode == 0,
        stage=stage,
        outputs=outputs,
        log=log,
        errors=tuple(errors),
        range_warnings=tuple(range_warnings(log)),
        accuracy_report=report.read_text() if report.is_file() else "",
        rknn_file=str(export_rknn or ""),
        extra={k: "\n".join(result[k]) for k in ("hybrid_fp16", "hybrid_unknown") if k in result},
    )


def error_lines(log: str) -> list[str]:
    """The vendor's `E ...` lines and a Python exception's last line, ANSI codes removed."""
    lines = [ln.strip() for ln in _ANSI.sub("", log).splitlines()]
    found = [ln[2:].strip() for ln in lines if ln.startswith("E ")
             and "Traceback" not in ln and "toolkit2 version" not in ln]
    # The toolkit re-raises every error as `ValueError: Traceback ...` around the real one,
    # whose class need not end in Error (onnxruntime's `...pybind11_state.InvalidArgument`).
    raised = [ln for ln in lines if _RAISED.match(ln)]
    return list(dict.fromkeys(found + raised[-1:]))


def range_warnings(log: str) -> list[dict[str, str]]:
    """`The range [lo, hi] of 'T' is out of the float16!` warnings: tensor and range."""
    return [{"tensor": m.group("tensor"), "lo": m.group("lo"), "hi": m.group("hi")}
            for m in _RANGE.finditer(_ANSI.sub("", log))]

