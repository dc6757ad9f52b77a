"""The real-model corpus through `npuprep` and through onnxconverter-common, as a user runs them.

Run: python bench/bench_corpus.py [--only NAME ...] [--target a2000] [--out bench/_work/corpus]
     python bench/bench_corpus.py --extra2 DIR [--out ...]   the ten models that
       ../shared/corpus/extra2_models.sh DIR builds (calib/ and holdout/ samples per model)
     [--autocast]   also NVIDIA ModelOpt's AutoCast on each model (slow; off by default)

Per corpus model (bench/corpus.py builds them; this script builds what is missing):
- `npuprep check/calibrate/convert/compare --emulate` as subprocesses (the CLI a user types),
  each with its exit code and, when it fails, the exact error line (for a traceback: the
  exception line and the innermost frame);
- `convert` judges outputs a model's user reads by their argmax (corpus.Spec.decided_by: a
  class) by their top-1 decisions too (`--top-k OUTPUT:1`), a CTC recogniser's
  (Spec.read_as_ctc) by its text (`--top-k OUTPUT:ctc`);
- what `convert` did (actions by kind, FP32 share of FLOPs and of Conv/MatMul/Gemm
  multiply-adds, from `--json`) and its wall time;
- onnxconverter-common's `convert_float_to_float16(keep_io_types=True)`: whether its model
  loads in onnxruntime as produced (or the exact error);
- both converted models judged on the held-out samples under emulated FP16: the converted
  graph widened to FP32 with an explicit Cast(FP16)->Cast(FP32) pair after every tensor it
  types FP16 (the runtime keeps such pairs, so they round and overflow like the target),
  against the original FP32 model: worst relative L2 error over samples, max abs error
  where both are finite, and the count of Inf/NaN where the FP32 output is finite.
The judge is written here, independent of npuprep's own emulation, and works at any opset.
- with `--autocast`, ModelOpt's AutoCast (`python -m modelopt.onnx.autocast --low_precision_type
  fp16 --keep_io_types --providers cpu --calibration_data calib/`, nvidia-modelopt in its own
  venv: $NPUPREP_MODELOPT_PYTHON, default ~/.cache/npuprep/e8goal/modelopt-venv) timed as a
  process (killed past --autocast-max-mb resident or --autocast-timeout s) and its model
  judged by the same held-out judge; clean means rel L2 <= 1e-2, no Inf/NaN and at most 10%
  of the Conv/MatMul/Gemm multiply-adds FP32, the gate npuprep's verdict applies.

Writes OUT.md (the table for BENCHMARKS.md) and OUT.json (every measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402 - the sibling script, run from anywhere
import corpus_new  # noqa: E402
from bench_convert_scale import _rss_mb  # noqa: E402 - one resident-memory reader

COMMANDS = ("check", "calibrate", "convert", "compare")
FP16 = TensorProto.FLOAT16
MODELOPT = Path(os.environ.get("NPUPREP_MODELOPT_PYTHON",
                               Path.home() / ".cache/npuprep/e8goal/modelopt-venv/bin/python"))
# The gate npuprep's verdict applies (held-out rel L2, FP32 share of the multiply-adds).
GATE_REL_L2, GATE_FP32_MACS = 1e-2, 0.10


@dataclass
class Outcome:
    """One CLI command on one model: exit code, wall time, the error a user sees."""

    rc: int
    seconds: float
    error: str = ""


@dataclass
class Judgement:
    """Converted model against the FP32 original on held-out samples, emulated FP16."""

    rel_l2: float
    max_abs: float
    nonfinite: int
    samples: int


@dataclass
class Row:
    name: str
    opset: int | None
    size_mb: float
    kind: str
    commands: dict[str, Outcome] = field(default_factory=dict)
    actions: dict[str, int] = field(default_factory=dict)
    flops_fp32_share: float | None = None
    macs_fp32_share: float | None = None
    npuprep_loads: str = ""
    npuprep_error: Judgement | str | None = None
    naive_seconds: float | None = None
    naive_loads: str = ""
    naive_error: Judgement | str | None = None
    decided_by: list[str] = field(default_factory=list)
    autocast: AutoCast | None = None


@dataclass
class AutoCast:
    """ModelOpt AutoCast on one model: its wall time and peak RSS, what went wrong (if it
    did), and its model under the held-out judge with its FP32 share of multiply-adds."""

    seconds: float
    peak_mb: float
    error: str = ""
    judged: Judgement | str | None = None
    macs_fp32_share: float | None = None

    @property
    def clean(self) -> bool:
        j = self.judged
        return (not self.error and isinstance(j, Judgement) and j.nonfinite == 0 and j.rel_l2 <= GATE_REL_L2
                and self.macs_fp32_share is not None and self.macs_fp32_share <= GATE_FP32_MACS)


def first_error(stderr: str) -> str:
    """The line a user reads: a traceback's exception and npuprep's innermost frame, else the
    last line."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    if not lines:
        return ""
    if any(ln.startswith("Traceback") for ln in lines):
        frames = [ln.strip() for ln in lines if ln.strip().startswith('File "')]
        ours = [f for f in frames if "/npuprep/" in f] or frames
        where = ""
        if ours:
            path, _, rest = ours[-1].removeprefix('File "').partition('", ')
            where = f" [{'/'.join(Path(path).parts[-2:])}, {rest}]"
        return f"traceback: {lines[-1].strip()}{where}"
    return lines[-1].strip()


def npuprep(args: list[str], log: Path) -> tuple[Outcome, str]:
    t0 = time.perf_counter()
    exe = Path(sys.executable).parent / "npuprep"
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    log.write_text(f"$ npuprep {' '.join(args)}\nrc={proc.returncode}\n{proc.stderr}")
    # An uncaught exception exits 1, like a failed check: the traceback tells them apart.
    failed = proc.returncode not in (0, 1) or "Traceback" in proc.stderr
    error = first_error(proc.stderr).replace(str(corpus.corpus_dir()), "$CORPUS") if failed else ""
    return Outcome(proc.returncode, seconds, error), proc.stdout


# ---------------------------------------------------------------- emulated FP16 judge


def graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                yield from graphs(sub)


def fp16_tensors(model: onnx.ModelProto) -> set[str]:
    """Names the model types FP16, in every scope (shape inference fills the gaps)."""
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # an uninferable model: declared types only
        pass
    names: set[str] = set()
    for g in graphs(model.graph):
        for vi in [*g.input, *g.output, *g.value_info]:
            if vi.type.tensor_type.elem_type == FP16:
                names.add(vi.name)
        for node in g.node:
            if node.op_type == "Cast" and any(a.name == "to" and a.i == FP16 for a in node.attribute):
                names.update(node.output)
    return names


def widen(model: onnx.ModelProto) -> onnx.ModelProto:
    """FP16-typed model -> FP32 graph that rounds through FP16 after every FP16 tensor."""
    low = fp16_tensors(model)
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    for g in graphs(wide.graph):
        for init in g.initializer:
            if init.data_type == FP16:
                init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float32), init.name))
        for vi in [*g.input, *g.output, *g.value_info]:
            if vi.type.tensor_type.elem_type == FP16:
                vi.type.tensor_type.elem_type = TensorProto.FLOAT
        nodes: list[onnx.NodeProto] = []
        for node in g.node:
            for attr in node.attribute:
                if node.op_type == "Cast" and attr.name == "to" and attr.i == FP16:
                    attr.i = TensorProto.FLOAT
                if attr.name == "value" and attr.t.data_type == FP16:
                    attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float32)))
            rounded = [o for o in node.output if o and o in low]
            node.output[:] = [f"{o}__wide" if o in rounded else o for o in node.output]
            nodes.append(node)
            for o in rounded:
                nodes.append(helper.make_node("Cast", [f"{o}__wide"], [f"{o}__fp16"], to=FP16))
                nodes.append(helper.make_node("Cast", [f"{o}__fp16"], [o], to=TensorProto.FLOAT))
        del g.node[:]
        g.node.extend(nodes)
    return wide


def session(model: onnx.ModelProto | str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    src = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])


def judge(reference: ort.InferenceSession, candidate: ort.InferenceSession,
          samples: list[dict[str, np.ndarray]]) -> Judgement:
    floats = [o.name for o in reference.get_outputs() if o.type == "tensor(float)"]
    rel, mx, bad = 0.0, 0.0, 0
    for feed in samples:
        ref = dict(zip(floats, reference.run(floats, feed), strict=True))
        cand = dict(zip(floats, candidate.run(floats, feed), strict=True))
        num = den = 0.0
        for name in floats:
            r, c = np.asarray(ref[name], np.float64), np.asarray(cand[name], np.float64)
            ok = np.isfinite(r)
            bad += int((ok & ~np.isfinite(c)).sum())
            both = ok & np.isfinite(c)
            if both.any():
                diff = np.abs(c[both] - r[both])
                mx = max(mx, float(diff.max()))
                num += float((diff**2).sum())
                den += float((r[both] ** 2).sum())
        rel = max(rel, (num / den) ** 0.5 if den > 0 else (0.0 if num == 0 else float("inf")))
    return Judgement(rel, mx, bad, len(samples))


def try_judge(reference: ort.InferenceSession, model: onnx.ModelProto,
              samples: list[dict[str, np.ndarray]]) -> Judgement | str:
    try:
        return judge(reference, session(widen(model)), samples)
    except Exception as exc:  # a judge failure is a result, shown in the table
        return f"emulation failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


def loads(model: onnx.ModelProto | str) -> str:
    """'loads' when onnxruntime accepts the model as produced, else its exact error line. In
    a forked child, as npuprep's user-load check: a model that crashes onnxruntime's default
    session (AECMOS in FP16, onnxruntime 1.32) ends the child, not the bench."""
    from npuprep.runtime.user_load import load_as_users_do

    said = load_as_users_do(onnx.load(model) if isinstance(model, str) else model, None).refused
    if said is None:
        return "loads"
    text = re.sub(r"\[ONNXRuntimeError\] : \d+ : \w+ : |Load model from \S+ failed:", "", said)
    return text[:200]


def checker(path: Path) -> str:
    try:
        onnx.checker.check_model(str(path))
        return ""
    except Exception as exc:  # the checker's complaint is the measurement
        return f"; checker: {str(exc).strip().splitlines()[0][:120]}"


def opset_change(original: str, converted: Path) -> str:
    """'' when the converted model declares the original's opset, else what changed."""
    def opset(path: str | Path) -> int:
        proto = onnx.load(str(path), load_external_data=False)
        return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))

    before, after = opset(original), opset(converted)
    return "" if before == after else f"; opset {before} -> {after}"


# ---------------------------------------------------------------- one model


def load_samples(folder: Path) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(p)) for p in sorted(folder.glob("*.npz"))]


def run_autocast(model: Path, calib: Path, heldout: Path, out: Path, max_mb: int, timeout: float) -> AutoCast:
    """AutoCast FP16 on `model` as its user runs it, timed as a whole process, killed past
    `max_mb` resident or `timeout` s; its model judged on `heldout` like npuprep's."""
    if not MODELOPT.is_file():
        return AutoCast(0.0, 0.0, f"not run: no modelopt venv at {MODELOPT}")
    out.unlink(missing_ok=True)
    cmd = [str(MODELOPT), "-m", "modelopt.onnx.autocast", "--onnx_path", str(model), "--output_path",
           str(out), "--low_precision_type", "fp16", "--calibration_data", str(calib), "--keep_io_types",
           "--providers", "cpu"]
    t0, peak, killed = time.perf_counter(), 0.0, ""
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(0.2)
            peak = max(peak, _rss_mb(proc.pid))
            if peak > max_mb or time.perf_counter() - t0 > timeout:
                proc.kill()
                killed = (f"killed past {max_mb} MB resident" if peak > max_mb
                          else f"killed after {timeout:g} s")
        proc.wait()
    seconds = time.perf_counter() - t0
    if killed or proc.returncode or not out.exists():
        tail = [ln for ln in out.with_suffix(".log").read_text(errors="replace").splitlines() if ln.strip()]
        return AutoCast(seconds, peak, killed or f"exit {proc.returncode}: {(tail or ['?'])[-1].strip()[:140]}")
    converted = onnx.load(str(out))
    samples = load_samples(heldout)
    said = loads(converted)
    if said != "loads":  # judged only as it loads: onnxruntime may crash on it (AECMOS)
        return AutoCast(seconds, peak, f"written, does not load as produced: {said}")
    return AutoCast(seconds, peak, "", try_judge(session(str(model)), converted, samples),
                    _fp32_mac_share(converted, samples[0] if samples else {}))


def _fp32_mac_share(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> float | None:
    """Share of the Conv/MatMul/Gemm multiply-adds of `model` whose output it types FP32 (an
    FP16 model's nodes left wide), at `feed`'s input shapes."""
    from npuprep.flops import node_flops
    from npuprep.graph import node_label

    try:
        flops = node_flops(model, {k: tuple(v.shape) for k, v in feed.items()})
        low = fp16_tensors(model)
    except Exception:  # a model shape inference refuses: no share, said as '-'
        return None
    total = wide = 0
    for g in graphs(model.graph):
        for node in g.node:
            if node.op_type in ("Conv", "ConvTranspose", "MatMul", "Gemm") and node.output:
                n = flops.get(node_label(node), 0)
                total += n
                wide += 0 if node.output[0] in low else n
    return wide / total if total else 0.0


def bench_model(entry: dict, root: Path, out: Path, target: str, autocast: tuple[int, float] | None = None) -> Row:
    name = entry["name"]
    model_path = root / entry["path"]
    calib, heldout = root / name / "calib", root / name / entry.get("heldout_dir", "heldout")
    work = out / name
    work.mkdir(parents=True, exist_ok=True)
    decided_by = entry["decided_by"] if "decided_by" in entry else corpus.SPECS[name].decided_by
    row = Row(name, entry["opset"], entry["size_bytes"] / 1e6, entry["kind"],
              decided_by=list(decided_by))
    m = str(model_path)
    converted = work / "converted.onnx"
    converted.unlink(missing_ok=True)
    converted.with_suffix(".FAILED.onnx").unlink(missing_ok=True)
    argv = {
        "check": ["check", m, "--target", target, "--data", str(calib)],
        "calibrate": ["calibrate", m, "--data", str(calib), "-o", str(work / "stats.json")],
        "convert": ["convert", m, "--target", target, "--data", str(calib), "--holdout", str(heldout),
                    "-o", str(converted), "--json",
                    *(a for out in row.decided_by for a in (
                        "--top-k", f"{out}:{'ctc' if out in entry.get('read_as_ctc', ()) else 1}"))],
        "compare": ["compare", m, "--emulate", "--target", target, "--data", str(heldout)],
    }
    for cmd in COMMANDS:
        outcome, stdout = npuprep(argv[cmd], work / f"{cmd}.log")
        row.commands[cmd] = outcome
        if cmd == "convert" and not outcome.error:
            try:
                report = json.loads(stdout)
            except json.JSONDecodeError:  # --json must print JSON only: a finding, not a crash
                first = (stdout.splitlines() or ["(nothing)"])[0][:100]
                outcome.error = f"--json printed more than JSON: `{first}`"
                continue
            row.actions = dict(Counter(a["action"] for a in report.get("actions", [])))
            row.flops_fp32_share = report.get("flops_fp32_share")
            row.macs_fp32_share = (report.get("fp32_share") or {}).get("macs")
    reference = session(m)
    samples = load_samples(heldout)
    # A FAILED conversion is written under a name that says so: judged all the same.
    if not converted.exists() and converted.with_suffix(".FAILED.onnx").exists():
        converted = converted.with_suffix(".FAILED.onnx")
    if converted.exists():
        row.npuprep_loads = loads(str(converted)) + checker(converted) + opset_change(m, converted)
        row.npuprep_error = try_judge(reference, onnx.load(str(converted)), samples)
    if autocast is not None:
        row.autocast = run_autocast(model_path, calib, heldout, work / "autocast.onnx", *autocast)

    from onnxconverter_common.float16 import convert_float_to_float16

    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            naive = convert_float_to_float16(onnx.load(m), keep_io_types=True)
    except Exception as exc:  # a crash of the naive converter is what its user sees
        row.naive_loads = f"convert failed: {type(exc).__name__}: {str(exc).splitlines()[0][:140]}"
        return row
    row.naive_seconds = time.perf_counter() - t0
    naive_path = work / "naive_fp16.onnx"
    onnx.save(naive, str(naive_path),
              save_as_external_data=naive.ByteSize() > 1_900_000_000)
    row.naive_loads = loads(str(naive_path)) + opset_change(m, naive_path)
    row.naive_error = try_judge(reference, naive, samples)
    return row


# ---------------------------------------------------------------- table


def fmt_judgement(j: Judgement | str | None) -> str:
    if j is None:
        return "-"
    if isinstance(j, str):
        return j
    return f"{j.rel_l2:.2g} / {j.max_abs:.2g} / {j.nonfinite}"


def fmt_convert(row: Row) -> str:
    c = row.commands.get("convert")
    if c is None:
        return "-"
    if c.error:
        return f"exit {c.rc}: `{c.error}`"
    did = ", ".join(f"{n} {k}" for k, n in sorted(row.actions.items())) or "no actions"
    return f"exit {c.rc}: {did}" + (", judged by its decisions too" if row.decided_by else "")


def rc_cell(outcome: Outcome | None) -> str:
    if outcome is None:
        return "-"
    return f"{outcome.rc} (traceback)" if outcome.error.startswith("traceback") else str(outcome.rc)


def row_from_json(d: dict) -> Row:
    """A Row back from OUT.json, to re-render the table without re-running anything."""
    def judgement(v: dict | str | None) -> Judgement | str | None:
        return Judgement(**v) if isinstance(v, dict) else v

    row = Row(**{k: v for k, v in d.items() if k not in ("commands", "npuprep_error", "naive_error", "autocast")})
    row.commands = {k: Outcome(**v) for k, v in d["commands"].items()}
    row.npuprep_error, row.naive_error = judgement(d["npuprep_error"]), judgement(d["naive_error"])
    if d.get("autocast"):
        row.autocast = AutoCast(**{**d["autocast"], "judged": judgement(d["autocast"]["judged"])})
    return row


def table(rows: list[Row], target: str) -> str:
    head = (
        f"| model | opset | MB | `convert --target {target}` | loads as produced | emulated FP16 "
        "rel L2 / max abs / Inf-NaN | FP32 FLOPs / MACs | convert s | check / calibrate / compare "
        "| naive FP16: loads as produced | naive emulated FP16 rel L2 / max abs / Inf-NaN |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        share = "-" if r.flops_fp32_share is None else f"{100 * r.flops_fp32_share:.1f}%"
        if r.macs_fp32_share is not None:
            share += f" / {100 * r.macs_fp32_share:.1f}%"
        conv = r.commands.get("convert")
        others = " / ".join(rc_cell(r.commands.get(c)) for c in ("check", "calibrate", "compare"))
        lines.append(
            f"| {r.name} | {r.opset} | {r.size_mb:.1f} | {fmt_convert(r)} | {r.npuprep_loads or '-'} | "
            f"{fmt_judgement(r.npuprep_error)} | {share} | {conv.seconds:.1f} | {others} | "
            f"{r.naive_loads} | {fmt_judgement(r.naive_error)} |"
        )
    return "\n".join(lines)


def judged_clean(j: Judgement | str | None, macs: float | None) -> bool:
    """The gate on the bench's own judge: held-out rel L2, no Inf/NaN, FP32 multiply-adds."""
    return (isinstance(j, Judgement) and j.nonfinite == 0 and j.rel_l2 <= GATE_REL_L2
            and macs is not None and macs <= GATE_FP32_MACS)


def autocast_table(rows: list[Row]) -> str:
    """npuprep's convert beside AutoCast's, per model: time, held-out judge, FP32 MACs, clean."""
    lines = ["| model | npuprep convert s (exit) | npuprep rel L2 / Inf-NaN | npuprep FP32 MACs | clean "
             "| AutoCast s | AutoCast peak MB | AutoCast rel L2 / Inf-NaN | AutoCast FP32 MACs | clean |",
             "|" + "---|" * 10]
    for r in rows:
        a, conv = r.autocast, r.commands.get("convert")
        if a is None or conv is None:
            continue
        mine = r.npuprep_error
        theirs = a.error or (a.judged if isinstance(a.judged, str) else
                             "-" if a.judged is None else f"{a.judged.rel_l2:.2g} / {a.judged.nonfinite}")
        lines.append(
            f"| {r.name} | {conv.seconds:.1f} ({conv.rc}) | "
            f"{mine if isinstance(mine, str) or mine is None else f'{mine.rel_l2:.2g} / {mine.nonfinite}'} | "
            f"{_percent(r.macs_fp32_share)} | {'yes' if judged_clean(mine, r.macs_fp32_share) else 'no'} | "
            f"{a.seconds:.1f} | {a.peak_mb:.0f} | {theirs} | {_percent(a.macs_fp32_share)} | "
            f"{'yes' if a.clean else 'no'} |")
    counted = [r for r in rows if r.autocast is not None]
    ours = sum(judged_clean(r.npuprep_error, r.macs_fp32_share) for r in counted)
    theirs = sum(r.autocast.clean for r in counted if r.autocast is not None)
    lines.append(f"\nClean (held-out rel L2 <= {GATE_REL_L2:g}, no Inf/NaN, FP32 multiply-adds <= "
                 f"{100 * GATE_FP32_MACS:g}%): npuprep {ours} of {len(counted)}, AutoCast {theirs} of {len(counted)}.")
    return "\n".join(lines)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def failures(rows: list[Row]) -> str:
    out = []
    for r in rows:
        for cmd, o in r.commands.items():
            if o.error:
                out.append(f"- {r.name} `{cmd}` exit {o.rc}: `{o.error}`")
    return "\n".join(out) or "- none"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME")
    ap.add_argument("--target", default="a2000")
    ap.add_argument("--out", type=Path, default=Path("bench/_work/corpus"))
    ap.add_argument("--render", action="store_true", help="only re-render OUT.md from OUT.json")
    ap.add_argument("--extra2", type=Path, metavar="DIR",
                    help="the models extra2_models.sh built in DIR instead of bench/corpus.py's")
    ap.add_argument("--new", action="store_true", help="bench/corpus_new.py's models instead")
    ap.add_argument("--autocast", action="store_true",
                    help="also ModelOpt's AutoCast FP16 on each model, timed and judged alike")
    ap.add_argument("--autocast-max-mb", type=int, default=8000,
                    help="kill AutoCast past this resident memory (default 8000)")
    ap.add_argument("--autocast-timeout", type=float, default=1800, help="kill AutoCast after this many s")
    args = ap.parse_args()
    if args.render:
        rows = [row_from_json(d) for d in json.loads(args.out.with_suffix(".json").read_text())]
        write_table(rows, args.out, args.target)
        return 0
    if args.extra2:
        root, entries = args.extra2, extra2_entries(args.extra2, args.only)
        names = []
    else:
        root = corpus_new.corpus_new_dir() if args.new else corpus.corpus_dir()
        specs = corpus_new.SPECS if args.new else corpus.SPECS
        names = args.only or list(specs)
        entries = []
    for name in names:
        try:
            entries.append({**corpus.build_one(specs[name], root),
                            "decided_by": list(specs[name].decided_by),
                            "read_as_ctc": list(specs[name].read_as_ctc)})
        except Exception as exc:  # an unbuildable model is reported, not fatal
            print(f"{name}: not built: {exc}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for entry in entries:
        row = bench_model(entry, root, args.out, args.target,
                          (args.autocast_max_mb, args.autocast_timeout) if args.autocast else None)
        rows.append(row)
        print(table([row], args.target).splitlines()[-1], flush=True)
    (args.out.with_suffix(".json")).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    write_table(rows, args.out, args.target)
    return 0


def extra2_entries(folder: Path, only: list[str] | None) -> list[dict]:
    """bench_model's entries for the models extra2_models.sh wrote: NAME.onnx, NAME/calib,
    NAME/holdout; no output is judged by its decisions (none is a classifier's argmax)."""
    manifest = json.loads((folder / "extra2_manifest.json").read_text())
    return [{"name": name, "path": e["file"], "opset": e["opsets"].get("ai.onnx", 0),
             "size_bytes": e["size_bytes"], "kind": e["kind"], "decided_by": [],
             "heldout_dir": "holdout"}
            for name, e in manifest.items() if not only or name in only]


def write_table(rows: list[Row], out: Path, target: str) -> None:
    md = table(rows, target) + "\n\nCommands that failed (exit 2, or a traceback):\n\n" + failures(rows) + "\n"
    if any(r.autocast is not None for r in rows):
        md += "\nnpuprep beside AutoCast (same held-out judge):\n\n" + autocast_table(rows) + "\n"
    out.with_suffix(".md").write_text(md)
    print(f"\nwritten {out.with_suffix('.md')} and .json")


if __name__ == "__main__":
    sys.exit(main())
