"""Board kit: probe models + inputs (.npy, raw .bin) + FP32 references + manifest -> board -> outputs -> verdicts.

`export_kit` writes the kit; `classify_kit` reads what the engineer brought back (.npy, .bin
or .npz), names every missing or mis-shaped output, and classifies the rest;
`profile_with_measurement` records the measured overflow mode in a copy of the profile.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import yaml
from onnx import helper

from npuprep import json_io
from npuprep.errors import NpuprepError
from npuprep.numerics import NumberFormat, get_format
from npuprep.output_files import WriteError, save_model, write_text_atomic
from npuprep.probe.classify import Verdict, classify
from npuprep.probe.micro import ProbeModel, target_elem_type
from npuprep.probe.runner import ProbeReport, ProbeResult, reference_outputs
from npuprep.profiles import OverflowMode, TargetProfile, parse_profile

SCHEMA_VERSION = 1
KIND = "probe-kit"


def file_stem(name: str) -> str:
    """A tensor name as a file name (`output:0` -> `output_0`)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "_"


def kit_model(probe: ProbeModel, fmt: NumberFormat) -> onnx.ModelProto:
    """The probe model the board runs: in the target precision, observed outputs stored in it."""
    from npuprep.probe.backends import lower_model, store_outputs

    if probe.target is not None:
        return probe.target
    if target_elem_type(fmt) == onnx.TensorProto.FLOAT:
        return probe.reference
    return store_outputs(lower_model(probe.reference, fmt, probe.scratch), fmt)


def _le_bytes(arr: np.ndarray) -> bytes:
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.byteswap().view(arr.dtype.newbyteorder("<"))
    return arr.tobytes()


def _npy_bytes(arr: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@dataclass(frozen=True)
class KitEntry:
    probe: ProbeModel
    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    references: dict[str, np.ndarray]


def export_kit(directory: str | Path, probes: list[ProbeModel], fmt: NumberFormat, *,
               target: str, fingerprint: str = "", runner: str = "") -> dict[str, Any]:
    """Write the kit for `probes` into `directory`; returns the manifest.

    `runner="rknn"`: FP32 models (the toolkit lowers them itself) and a runner script that
    uses rknn-toolkit2's simulator on a PC and RKNNLite on the board.
    """
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise NpuprepError(f"{out}: kit path exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "manifest.json").is_file():
        raise NpuprepError(f"{out}: directory is not empty and holds no probe kit; choose another")
    entries = []
    for probe in probes:
        model = probe.reference if runner == "rknn" else kit_model(probe, fmt)
        in_types = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.input}
        feeds = {k: np.asarray(v).astype(helper.tensor_dtype_to_np_dtype(in_types[k]))
                 for k, v in probe.feeds.items()}
        refs = reference_outputs(probe)
        entries.append(KitEntry(probe, model, feeds, {o: refs[o].astype(np.float32) for o in probe.outputs}))

    manifest_probes = []
    for e in entries:
        name = e.probe.name
        out_types = {vo.name: vo.type.tensor_type.elem_type for vo in e.model.graph.output}
        inputs = []
        for k, v in e.feeds.items():
            stem = file_stem(k)
            inputs.append({"name": k, "shape": list(v.shape), "dtype": str(v.dtype),
                           "npy": f"inputs/{name}/{stem}.npy", "bin": f"inputs/{name}/{stem}.bin"})
        outputs = []
        for o, ref in e.references.items():
            outputs.append({"name": o, "shape": list(ref.shape),
                            "dtype": str(np.dtype(helper.tensor_dtype_to_np_dtype(out_types[o]))),
                            "file_stem": file_stem(o), "reference": f"reference/{name}/{file_stem(o)}.npy"})
        manifest_probes.append({"name": name, "unit": e.probe.unit, "model": f"models/{name}.onnx",
                                "inputs": inputs, "outputs": outputs})
    manifest = {
        "schema_version": SCHEMA_VERSION, "kind": KIND, "fingerprint": fingerprint,
        "target": target, "format": fmt.name, "max": fmt.max, "threshold": fmt.overflow_threshold,
        "probes": manifest_probes,
    }
    # Written in a folder beside the kit and put in place whole: a full disk or a signal
    # leaves the folder as it was, never half a kit.
    final = out
    final.parent.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f".{final.name}.npuprep-{os.getpid()}-", suffix=".tmp", dir=final.parent))
    try:
        _write_files(out, entries, manifest_probes, manifest, target, runner)
        _put_in_place(out, final)
    except (OSError, WriteError) as exc:
        raise NpuprepError(f"{final}: cannot write the kit ({exc.strerror or exc}); the folder is as it "
                           "was") from None
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return manifest


def _write_files(out: Path, entries: list[KitEntry], manifest_probes: list[dict[str, Any]],
                 manifest: dict[str, Any], target: str, runner: str) -> None:
    for e, entry in zip(entries, manifest_probes, strict=True):
        save_model(e.model, out / entry["model"])
        for spec in entry["inputs"]:
            value = e.feeds[spec["name"]]
            _write_bytes_atomic(out / spec["npy"], _npy_bytes(value))
            _write_bytes_atomic(out / spec["bin"], _le_bytes(value))
        for spec in entry["outputs"]:
            _write_bytes_atomic(out / spec["reference"], _npy_bytes(e.references[spec["name"]]))
    readme = _readme(manifest)
    if runner == "rknn":
        from npuprep.vendors.rockchip import JOB_SCRIPT, KIT_RUNNER

        write_text_atomic(out / "rknn_job.py", JOB_SCRIPT.read_text())
        write_text_atomic(out / "run_rknn_kit.py", KIT_RUNNER.read_text())
        readme += _RKNN_STEPS.format(target=target)
    write_text_atomic(out / "README.md", readme)
    write_text_atomic(out / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _put_in_place(staged: Path, final: Path) -> None:
    """`staged` renamed to `final`; an older kit there is moved aside first, then removed."""
    if not final.exists():
        os.replace(staged, final)
        return
    older = Path(tempfile.mkdtemp(prefix=f".{final.name}.npuprep-{os.getpid()}-", suffix=".old", dir=final.parent))
    os.replace(final, older / "kit")
    try:
        os.replace(staged, final)
    except OSError:
        os.replace(older / "kit", final)
        raise
    finally:
        shutil.rmtree(older, ignore_errors=True)


def _readme(manifest: dict[str, Any]) -> str:
    fmt = manifest["format"]
    lines = [
        f"# npuprep probe kit ({manifest['target']}, {fmt})",
        "",
        "Each probe makes one unit of the target overflow on purpose, so you can see what the",
        f"board does with values beyond the {fmt} max ({manifest['max']:g}): Inf, NaN, clamp to",
        "+-max (silent), or something else. Run every probe on the board and bring the outputs back.",
        "",
        "## Steps on the board",
        "",
        "1. Compile each `models/<probe>.onnx` with the board's toolchain in "
        + (f"{fmt} (these graphs are FP32: enable the compiler's {fmt} mode)." if fmt.startswith("fp8")
           else f"{fmt}. Do not let the compiler clamp, fold or re-range anything."),
        "2. Feed the inputs from `inputs/<probe>/<input>.npy` (or the raw little-endian",
        "   `inputs/<probe>/<input>.bin`, dtype and shape in `manifest.json`).",
        "3. Save each output as `outputs/<probe>/<file_stem>.npy`, or raw little-endian",
        "   `outputs/<probe>/<file_stem>.bin` (float16 or float32, shape as in the manifest),",
        "   or all outputs of one probe in `outputs/<probe>.npz` keyed by output name.",
        "   Do not post-process them (no clipping, no NaN replacement).",
        "4. Back on the host:",
        "",
        "       npuprep probe --classify KIT --outputs outputs/ [--write-profile measured.yaml]",
        "",
        "## Probes",
        "",
        "| probe | unit | model | inputs | outputs |",
        "|---|---|---|---|---|",
    ]
    for p in manifest["probes"]:
        ins = ", ".join(f"{i['name']} {i['dtype']}{i['shape']}" for i in p["inputs"])
        outs = ", ".join(f"{o['name']} -> {o['file_stem']} {o['dtype']}{o['shape']}" for o in p["outputs"])
        lines.append(f"| {p['name']} | {p['unit']} | {p['model']} | {ins} | {outs} |")
    lines += [
        "",
        "## Reading the verdicts",
        "",
        "- `inf` / `nan`: loud; you will notice. `saturate`: silent clamp to +-max; outputs look",
        "  plausible and are wrong. `other-finite`: flushed, wrapped or compressed; also silent.",
        "- `no-overflow` with \"computed wider\": values beyond the max came back exactly, so that",
        "  unit did not run in the declared format (check the compiler's per-layer precision report).",
        "- A `saturate` verdict may come from the compiler (an inserted Clip) rather than the",
        "  hardware: look for Clip/Clamp layers in the compiled model or its report.",
        "",
        "The FP32 references are in `reference/`; `manifest.json` is the machine-readable index.",
        "",
    ]
    return "\n".join(lines)


_RKNN_STEPS = """
## Rockchip (rknn-toolkit2 / rknn-toolkit-lite2)

The models here are FP32: the toolkit builds them in FP16 itself (`build(do_quantization=False)`).

1. PC, in the rknn-toolkit2 venv: `python run_rknn_kit.py --target {target}` builds every
   probe, writes `models/<probe>.rknn` and runs it in the x86 simulator into `outputs/`.
2. Board, with rknn-toolkit-lite2: copy the kit (with the `.rknn` files) and run
   `python run_rknn_kit.py --board`; outputs land in `outputs_board/`.
3. Host: `npuprep probe --classify KIT --outputs KIT/outputs_board` (or `KIT/outputs`).
"""


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "manifest.json"
    manifest = json_io.read_json(path, "probe kit manifest")
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND:
        raise NpuprepError(f"{path}: key 'kind': not a probe kit (expected '{KIND}')")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise NpuprepError(f"{path}: key 'schema_version': {manifest.get('schema_version')!r} is not "
                           f"supported (expected {SCHEMA_VERSION})")
    return manifest


def _bin_dtypes(fmt: NumberFormat) -> dict[int, np.dtype]:
    """Raw .bin files carry no dtype: infer it from the bytes per value."""
    dtypes = {4: np.dtype("<f4"), 2: np.dtype("<f2")}
    if fmt.name == "bf16":
        dtypes[2] = fmt.np_dtype
    if fmt.np_dtype.itemsize == 1:
        dtypes[1] = fmt.np_dtype
    return dtypes


def _load_output(outputs: Path, probe: dict[str, Any], spec: dict[str, Any], fmt: NumberFormat,
                 problems: list[str]) -> np.ndarray | None:
    name, stem = probe["name"], spec["file_stem"]
    shape = tuple(spec["shape"])
    where = f"{name}/{spec['name']}"
    npy, raw, npz = outputs / name / f"{stem}.npy", outputs / name / f"{stem}.bin", outputs / f"{name}.npz"
    if npy.is_file():
        try:
            value = np.load(npy, allow_pickle=False)
        except (ValueError, OSError) as exc:
            problems.append(f"{where}: {npy} is not a readable .npy ({exc})")
            return None
    elif raw.is_file():
        data = raw.read_bytes()
        count = int(np.prod(shape))
        dtype = _bin_dtypes(fmt).get(len(data) // count) if count and len(data) % count == 0 else None
        if dtype is None:
            problems.append(f"{where}: {raw} holds {len(data)} bytes, not {count} values of 1, 2 or 4 bytes")
            return None
        value = np.frombuffer(data, dtype=dtype).reshape(shape)
    elif npz.is_file():
        try:
            with np.load(npz, allow_pickle=False) as z:
                if spec["name"] not in z.files:
                    problems.append(f"{where}: {npz} has no array '{spec['name']}' (has {', '.join(z.files)})")
                    return None
                value = z[spec["name"]]
        except (ValueError, OSError) as exc:
            problems.append(f"{where}: {npz} is not a readable .npz ({exc})")
            return None
    else:
        problems.append(f"{where}: missing (looked for {npy.name} or {raw.name} in "
                        f"{outputs / name}, or {npz.name})")
        return None
    if value.shape != shape:
        if value.size == int(np.prod(shape)) and tuple(d for d in value.shape if d != 1) == \
                tuple(d for d in shape if d != 1):
            return value.reshape(shape)
        problems.append(f"{where}: shape {tuple(value.shape)} does not match the expected {shape}")
        return None
    return value


def classify_kit(directory: str | Path, outputs: str | Path) -> tuple[dict[str, Any], ProbeReport]:
    """Classify the board outputs in `outputs` against the kit in `directory`."""
    kit = Path(directory)
    manifest = read_manifest(kit)
    fmt = get_format(manifest["format"])
    out = Path(outputs)
    if not out.is_dir():
        raise NpuprepError(f"{out}: outputs directory not found")
    problems: list[str] = []
    loaded = []
    for probe in manifest["probes"]:
        for spec in probe["outputs"]:
            loaded.append((probe, spec, _load_output(out, probe, spec, fmt, problems)))
    if problems:
        raise NpuprepError("board outputs missing or mis-shaped: " + "; ".join(problems))
    results = []
    for probe, spec, value in loaded:
        ref_path = kit / spec["reference"]
        if not ref_path.is_file():
            raise NpuprepError(f"{ref_path}: reference of {probe['name']}/{spec['name']} missing from the kit")
        reference = np.load(ref_path, allow_pickle=False)
        results.append(ProbeResult(probe["name"], probe["unit"], spec["name"],
                                   classify(reference, value, fmt)))
    return manifest, ProbeReport(fmt, f"board ({out})", tuple(results))


def measured_mode(results: list[ProbeResult]) -> str:
    """The overflow mode to record: the commonest of inf/nan/saturate among the probes.

    A tie goes to the silent mode (saturate, then nan), so planning never assumes a loud
    board that is not. Raises when no probe gave one of the three.
    """
    counts = {v: sum(1 for r in results if r.classification.verdict is v)
              for v in (Verdict.SATURATE, Verdict.NAN, Verdict.INF)}
    best = max(counts, key=lambda v: counts[v])
    if counts[best] == 0:
        seen = ", ".join(f"{r.name}={r.verdict}" for r in results)
        raise NpuprepError(f"cannot record an overflow mode: no probe gave inf, nan or saturate ({seen})")
    return str(best)


def profile_with_measurement(profile: TargetProfile, results: list[ProbeResult], backend: str,
                             fmt: NumberFormat, name: str = "", basis: str = "measured") -> dict[str, Any]:
    """The profile's data with the overflow mode measured in `fmt` and a source line saying so.

    FP8 measurements go to `fp8_saturate`, FP16 ones to `overflow`. The copy has its own
    `name` (default: `<name>-measured`), so it never passes for the built-in profile.
    `basis` is `measured` (a board, onnxruntime's kernels) or `emulated` (the declared mode replayed).
    """
    mode = measured_mode(results)
    data = profile.to_dict()
    data["name"] = name or f"{profile.name}-measured"
    data["description"] = (f"{profile.name} with the {fmt.name} overflow {basis} by npuprep probe on "
                           f"{backend}. {data.get('description') or ''}").strip()
    per_unit = ", ".join(f"{r.name}={r.verdict}" for r in results)
    source = f"{basis} by npuprep probe on {backend} in {fmt.name}: {mode} ({per_unit})"
    sources = dict(data["sources"])
    if fmt.name.startswith("fp8"):
        data["fp8_saturate"] = mode == str(Verdict.SATURATE)
        sources["fp8_saturate"] = source
    else:
        data["overflow"] = str(OverflowMode(mode))
        sources["overflow"] = source
    data["sources"] = sources
    return data


def write_profile(path: str | Path, profile: TargetProfile, results: list[ProbeResult],
                  backend: str, fmt: NumberFormat, basis: str = "measured") -> Path:
    """Write the measured profile as YAML that load_profile accepts (checked before writing).

    Its name is the file's stem (`board1.yaml` -> `board1`), or `<profile>-measured` where the
    stem is the source profile's own name.
    """
    stem = Path(path).stem
    data = profile_with_measurement(profile, results, backend, fmt,
                                    name=stem if stem and stem != profile.name else "", basis=basis)
    parse_profile(data, str(path))
    text = yaml.safe_dump(data, sort_keys=False, width=100, allow_unicode=True)
    return write_text_atomic(path, text)
