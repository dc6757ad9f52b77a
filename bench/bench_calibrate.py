"""Calibration speed and memory: npuprep's in-graph statistics vs plain inference and other tools.

Builds a transformer-like model (>= 100 MB, LayerNorm and GELU decomposed as exporters emit
them) and a conv net into bench/_work/, then runs each method in its own process over the
same synthetic samples and reads its peak RSS (ru_maxrss):

- plain: onnxruntime inference, default session options (all graph optimisations);
- plain streams: the same, one-thread session run from one thread per core at once (what
  npuprep's streams do, done to plain inference: shown so the comparison stays honest);
- npuprep auto / all: npuprep.calibrate as its default command runs it (one stream per core,
  one thread each, on one shared session), detail="auto" (default) and detail="all";
- npuprep auto s1: one stream, its session on every core (`--streams 1`);
- polygraphy mark-all: ModifyOutputs(MARK_ALL) + its onnxrt runner, min/max in numpy
  (what `polygraphy run --onnx-outputs mark all` does, plus the reduction);
- ort MinMaxCalibrater: onnxruntime.quantization.calibrate, every float tensor.

Rounds alternate the methods, so contention from other processes, and this VM's speed,
which drifts by 20-40% over minutes, hit them alike: each ratio to plain inference is taken
within one round, and the table shows its median over the rounds and its range. `--big` also calibrates a model over 2 GB (external
data) through the CLI and records its time and peak RSS.

The end-to-end table (`--e2e 8,32`) times whole processes over a directory of .npz samples
(the same synthetic samples, written once): process start, imports, model load, session(s),
every sample, statistics written. Methods: plain onnxruntime inference (numpy + onnxruntime
only, default session options: every core), the default `npuprep calibrate` (one stream
per core), `--streams 1` (one run at a time on every core) and `--jobs 2` (forked workers). Peak memory there is the largest sum of PSS
(/proc/PID/smaps_rollup, shared pages split between the processes sharing them) over the
process and its children, sampled every 20 ms.

    .venv/bin/python bench/bench_calibrate.py --samples 16 --rounds 5 --e2e 8,32,128 --big
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnx

# onnx is imported where models are built or read, not at the top: the end-to-end "plain"
# child imports only numpy and onnxruntime, as a plain inference script would.

WORK = Path(__file__).resolve().parent / "_work"
METHODS = ("plain", "plain-streams", "npuprep-auto", "npuprep-auto-s1", "npuprep-all", "polygraphy-markall",
           "ort-minmax")
E2E_METHODS = ("plain", "npuprep", "npuprep-s1", "npuprep-j2")


def build_transformer(d: int = 768, layers: int = 4, seq: int = 128, heads: int = 12, seed: int = 0) -> onnx.ModelProto:
    """Pre-LN encoder; LayerNorm and GELU decomposed, attention as MatMul/Softmax."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def weight(name: str, shape: list[int], scale: float) -> str:
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value, name))
        return name

    def node(op: str, ins: list[str], out: str, **attrs: object) -> str:
        nodes.append(helper.make_node(op, ins, [out], name=f"{op}_{len(nodes)}", **attrs))
        return out

    const("ax", np.array([-1], np.int64))
    const("two", np.float32(2))
    const("eps", np.float32(1e-5))
    const("half", np.float32(0.5))
    const("one", np.float32(1))
    const("rsqrt2", np.float32(1 / np.sqrt(2)))
    const("scale", np.float32(1 / np.sqrt(d // heads)))
    const("split_heads", np.array([1, seq, heads, d // heads], np.int64))
    const("join_heads", np.array([1, seq, d], np.int64))

    def layer_norm(x: str, p: str) -> str:
        mean = node("ReduceMean", [x, "ax"], p + ".mean")
        c = node("Sub", [x, mean], p + ".centered")
        var = node("ReduceMean", [node("Pow", [c, "two"], p + ".sq"), "ax"], p + ".var")
        std = node("Sqrt", [node("Add", [var, "eps"], p + ".var_eps")], p + ".std")
        y = node("Mul", [node("Div", [c, std], p + ".norm"), weight(p + ".g", [d], 0.1)], p + ".scaled")
        return node("Add", [y, weight(p + ".b", [d], 0.1)], p + ".out")

    def linear(x: str, p: str, din: int, dout: int) -> str:
        y = node("MatMul", [x, weight(p + ".w", [din, dout], 1 / np.sqrt(din))], p + ".mm")
        return node("Add", [y, weight(p + ".b", [dout], 0.02)], p + ".out")

    x = "x"
    for i in range(layers):
        p = f"l{i}"
        h = layer_norm(x, p + ".ln1")
        qkv = []
        for name in "qkv":
            t = node("Reshape", [linear(h, f"{p}.{name}", d, d), "split_heads"], f"{p}.{name}.heads")
            perm = [0, 2, 3, 1] if name == "k" else [0, 2, 1, 3]
            qkv.append(node("Transpose", [t], f"{p}.{name}.t", perm=perm))
        s = node("Mul", [node("MatMul", qkv[:2], p + ".scores"), "scale"], p + ".scores_scaled")
        ctx = node("MatMul", [node("Softmax", [s], p + ".probs", axis=-1), qkv[2]], p + ".ctx")
        ctx = node("Reshape", [node("Transpose", [ctx], p + ".ctx_t", perm=[0, 2, 1, 3]), "join_heads"], p + ".ctx_flat")
        x = node("Add", [x, linear(ctx, p + ".proj", d, d)], p + ".res1")
        u = linear(layer_norm(x, p + ".ln2"), p + ".fc1", d, 4 * d)
        g = node("Add", [node("Erf", [node("Mul", [u, "rsqrt2"], p + ".gelu_a")], p + ".gelu_erf"), "one"], p + ".gelu_b")
        g = node("Mul", [node("Mul", [u, g], p + ".gelu_c"), "half"], p + ".gelu")
        x = node("Add", [x, linear(g, p + ".fc2", 4 * d, d)], p + ".res2")
    y = layer_norm(x, "final")
    graph = helper.make_graph(nodes, "transformer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, d])],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, [1, seq, d])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def build_convnet(channels: tuple[int, ...] = (32, 64, 128, 256), hw: int = 128, seed: int = 0) -> onnx.ModelProto:
    """Conv-BN-Relu stages, stride 2 between them, global pool and a classifier."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def weight(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value.astype(np.float32), name))
        return name

    def node(op: str, ins: list[str], out: str, **attrs: object) -> str:
        nodes.append(helper.make_node(op, ins, [out], name=f"{op}_{len(nodes)}", **attrs))
        return out

    x, cin = "image", 3
    for i, c in enumerate(channels):
        for j in range(2):
            p = f"s{i}.c{j}"
            w = weight(p + ".w", rng.standard_normal([c, cin, 3, 3]) * np.sqrt(2 / (cin * 9)))
            y = node("Conv", [x, w], p + ".conv", pads=[1, 1, 1, 1], strides=[2, 2] if j == 0 and i else [1, 1])
            bn = [weight(f"{p}.bn{k}", v) for k, v in enumerate(
                [rng.uniform(0.5, 1.5, c), rng.standard_normal(c) * 0.1, rng.standard_normal(c) * 0.1, rng.uniform(0.5, 2, c)])]
            x = node("Relu", [node("BatchNormalization", [y, *bn], p + ".bn")], p + ".relu")
            cin = c
    x = node("Flatten", [node("GlobalAveragePool", [x], "pool")], "flat")
    x = node("Gemm", [x, weight("fc.w", rng.standard_normal([10, cin]) * 0.05), weight("fc.b", np.zeros(10))], "logits", transB=1)
    graph = helper.make_graph(nodes, "convnet", [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, hw, hw])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def build_big(width: int = 16384, layers: int = 2) -> onnx.ModelProto:
    """Over 2 GB of weights: a chain of width x width MatMuls (weights as external data)."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = np.full((width, width), 1.0 / width, np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"]))
        nodes.append(helper.make_node("Relu", [f"h{i}"], [f"r{i}"]))
        x = f"r{i}"
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [4, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def ensure_models(counts: str = "") -> dict[str, Path]:
    """Build the models (and sample folders) once, in a child process: Linux carries a
    parent's peak RSS into the ru_maxrss of children it forks, so the parent must stay small."""
    paths = {"transformer": WORK / "transformer.onnx", "convnet": WORK / "convnet.onnx"}
    folders = [sample_dir(name, int(n)) for name in paths for n in counts.split(",") if n]
    if not all(p.exists() for p in [*paths.values(), *folders]):
        subprocess.run([sys.executable, __file__, "--build", "--e2e", counts], check=True)
    return paths


def build_models(counts: str) -> None:
    import onnx

    WORK.mkdir(parents=True, exist_ok=True)
    for name, build in (("transformer", build_transformer), ("convnet", build_convnet)):
        path = WORK / f"{name}.onnx"
        if not path.exists():
            onnx.save_model(build(), str(path))
    for name in ("transformer", "convnet"):
        for n in (int(v) for v in counts.split(",") if v):
            write_samples(name, n)
    big = WORK / "big" / "big.onnx"
    if not big.exists():
        big.parent.mkdir(parents=True, exist_ok=True)
        onnx.save_model(build_big(), str(big), save_as_external_data=True, location="big.onnx.data")


def sample_dir(name: str, n: int) -> Path:
    return WORK / "samples" / name / f"n{n}"


def write_samples(name: str, n: int) -> None:
    """The first n synthetic samples (seed 0, as the steady-state table uses) as .npz files."""
    import onnx

    from npuprep.data import synthetic_samples

    model = onnx.load(str(WORK / f"{name}.onnx"), load_external_data=False)
    folder = sample_dir(name, n)
    if folder.exists():
        return
    folder.mkdir(parents=True)
    for i, feed in enumerate(synthetic_samples(model, n, seed=0)):
        np.savez(folder / f"{i:04d}.npz", **feed)


def e2e_child(method: str, path: Path, folder: Path) -> dict[str, float]:
    """One whole run in this process (and its workers), memory sampled from a thread."""
    import threading

    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], _tree_pss_mb(os.getpid()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if method == "plain":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        for f in sorted(folder.glob("*.npz")):
            with np.load(f) as z:
                session.run(None, dict(z))
    else:
        from npuprep.cli.main import main as cli

        # The default command, one stream on every core, or forked processes.
        extra = {"npuprep": [], "npuprep-s1": ["--streams", "1"], "npuprep-j2": ["--jobs", "2"]}[method]
        rc = cli(["calibrate", str(path), "--data", str(folder), *extra,
                  "-o", str(WORK / f"e2e_stats_{os.getpid()}.json")])
        (WORK / f"e2e_stats_{os.getpid()}.json").unlink(missing_ok=True)
        if rc != 0:
            raise SystemExit(rc)
    done.set()
    sampler.join()
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"pss_peak_mb": max(peak[0], _tree_pss_mb(os.getpid())), "rss_self_mb": own.ru_maxrss / 1024,
            "rss_child_max_mb": kids.ru_maxrss / 1024,
            "cpu_s": own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime}


def _tree_pss_mb(pid: int) -> float:
    """PSS of a process and its descendants, MB (0 for any that ended meanwhile)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def run_e2e(method: str, path: Path, n: int) -> dict[str, float]:
    """Wall clock of the whole child process (interpreter start included)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--e2e-child", method, str(path), str(sample_dir(path.stem, n))],
                         capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r | {"wall_s": wall, "per_sample_s": wall / n, "cpu_per_sample_s": r["cpu_s"] / n}


def feeds(path: Path, n: int) -> list[dict[str, np.ndarray]]:
    import onnx

    from npuprep.data import synthetic_samples

    model = onnx.load(str(path), load_external_data=False)
    return list(synthetic_samples(model, n, seed=0))


def child(method: str, path: Path, n: int) -> dict[str, float]:
    """Run one method over n samples in this process; seconds for setup and per sample."""
    samples = feeds(path, n)
    t0 = time.perf_counter()
    c0 = time.process_time()
    if method == "plain":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        session.run(None, samples[0])
        t1 = time.perf_counter()
        c1 = time.process_time()
        for f in samples:
            session.run(None, f)
    elif method == "plain-streams":
        import threading

        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.intra_op_num_threads = 1
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        session.run(None, samples[0])
        t1 = time.perf_counter()
        c1 = time.process_time()
        streams = os.cpu_count() or 1
        runs = [threading.Thread(target=lambda k=k: [session.run(None, f) for f in samples[k::streams]])
                for k in range(streams)]
        for t in runs:
            t.start()
        for t in runs:
            t.join()
    elif method.startswith("npuprep"):
        from npuprep.calibrate.run import (
            Folding,
            fold_streams,
            plan_streams,
            prepare,
            session_threads,
        )
        from npuprep.model_io import load_model

        _, detail, *one = method.split("-")
        streams = 1 if one == ["s1"] else plan_streams(0, n)
        folding = Folding(prepare(load_model(path), detail), session_threads(streams))
        # Warm-up: the first sample settles which tensors get the detail (see Folding).
        folding.add(samples[0], 0)
        t1 = time.perf_counter()
        c1 = time.process_time()
        fold_streams(folding, _Listed(samples), 0, n, streams, lambda: None)
    elif method == "polygraphy-markall":
        from polygraphy.backend.onnx import BytesFromOnnx, ModifyOutputs, OnnxFromPath
        from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
        from polygraphy.constants import MARK_ALL

        loader = SessionFromOnnx(BytesFromOnnx(ModifyOutputs(OnnxFromPath(str(path)), outputs=MARK_ALL)))
        with OnnxrtRunner(loader) as runner:
            t1 = time.perf_counter()
            c1 = time.process_time()
            ranges: dict[str, tuple[float, float]] = {}
            for f in samples:
                for name, value in runner.infer(f).items():
                    if value.dtype.kind == "f" and value.size:
                        lo, hi = float(np.nanmin(value)), float(np.nanmax(value))
                        old = ranges.get(name, (lo, hi))
                        ranges[name] = (min(old[0], lo), max(old[1], hi))
    elif method == "ort-minmax":
        import tempfile

        from onnxruntime.quantization.calibrate import (
            CalibrationDataReader,
            CalibrationMethod,
            create_calibrator,
        )

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self.it = iter(samples)

            def get_next(self) -> dict[str, np.ndarray] | None:
                return next(self.it, None)

        with tempfile.TemporaryDirectory() as tmp:
            calibrator = create_calibrator(str(path), [], augmented_model_path=str(Path(tmp) / "aug.onnx"),
                                           calibrate_method=CalibrationMethod.MinMax)
            t1 = time.perf_counter()
            c1 = time.process_time()
            calibrator.collect_data(Reader())
            calibrator.compute_data()
    else:
        raise SystemExit(f"unknown method {method}")
    t2 = time.perf_counter()
    c2 = time.process_time()
    return {"setup_s": t1 - t0, "per_sample_s": (t2 - t1) / n, "cpu_per_sample_s": (c2 - c1) / n,
            "rss_mb": _rss_mb(), "setup_cpu_s": c1 - c0}


class _Listed:
    """Samples held in memory, read as npuprep reads a SampleSet."""

    def __init__(self, samples: list[dict[str, np.ndarray]]) -> None:
        self.samples = samples

    def iter_range(self, start: int, stop: int):  # noqa: ANN201 - an iterator of feeds
        return iter(self.samples[start:stop])


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_child(method: str, path: Path, n: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", method, str(path), "--samples", str(n)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_big(n: int) -> dict[str, object]:
    """Calibrate a >2 GB external-data model through the CLI; wall time and peak RSS."""
    folder = WORK / "big"
    model = folder / "big.onnx"
    if not model.exists():
        subprocess.run([sys.executable, __file__, "--build"], check=True)
    size = sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("big.onnx"))
    stats = WORK / "big_stats.json"
    code = ("import resource, sys; from npuprep.cli.main import main; rc = main(sys.argv[1:]); "
            "print('RSS_MB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024); sys.exit(rc)")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, "calibrate", str(model), "--synthetic", str(n), "-o", str(stats)],
                         capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    rss = next((float(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("RSS_MB")), None)
    return {"model_bytes": size, "samples": n, "wall_s": wall, "rss_mb": rss, "exit": out.returncode,
            "stderr": out.stderr.strip()[-300:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, metavar=("METHOD", "MODEL"))
    ap.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--big", action="store_true", help="also calibrate a >2 GB external-data model")
    ap.add_argument("--e2e", default="", help="sample counts for the end-to-end table, e.g. 8,32")
    ap.add_argument("--e2e-child", nargs=3, metavar=("METHOD", "MODEL", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=WORK / "bench_calibrate.json")
    args = ap.parse_args()
    if args.build:
        build_models(args.e2e)
        return
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]), args.samples)))
        return
    if args.e2e_child:
        method, model, folder = args.e2e_child
        print(json.dumps(e2e_child(method, Path(model), Path(folder))))
        return
    paths = ensure_models(args.e2e)
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for name, path in paths.items():
        results[name] = {method: [] for method in args.methods.split(",")}
        for _ in range(args.rounds):
            for method in args.methods.split(","):
                results[name][method].append(run_child(method, path, args.samples))
    e2e: dict[str, list[dict[str, float]]] = {}
    if args.e2e:
        # npuprep's bytecode, as a regular install has it (pip compiles a package's modules
        # when it installs them): an editable install run with PYTHONDONTWRITEBYTECODE, as on
        # the build VM, would compile every module in every process.
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(WORK.parent.parent / "npuprep")], check=True)
    for n in (int(v) for v in args.e2e.split(",") if v):
        for name, path in paths.items():
            for _ in range(args.rounds):
                for method in E2E_METHODS:
                    e2e.setdefault(f"{name}|{n}|{method}", []).append(run_e2e(method, path, n))
    report: dict[str, object] = {"samples": args.samples, "rounds": args.rounds, "cpus": os.cpu_count(),
                                 "model_mb": {name: path.stat().st_size / 1e6 for name, path in paths.items()},
                                 "load_average": os.getloadavg(), "results": results, "e2e": e2e}
    if args.big:
        report["big"] = bench_big(2)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print_table(report)


def _paired(rounds: list[dict[str, float]], plain: list[dict[str, float]], key: str) -> tuple[float, float, float]:
    """Median, min and max over the rounds of a method's `key` over plain's in the same round."""
    ratios = [r[key] / p[key] for r, p in zip(rounds, plain, strict=False) if key in r and key in p]
    if not ratios:
        return math.nan, math.nan, math.nan
    return statistics.median(ratios), min(ratios), max(ratios)


def _median(rounds: list[dict[str, float]], key: str) -> float:
    values = [r[key] for r in rounds if key in r]
    return statistics.median(values) if values else math.nan


def print_table(report: dict) -> None:
    print(f"samples per method: {report['samples']}, rounds: {report['rounds']}, load average: "
          f"{', '.join(f'{v:.1f}' for v in report['load_average'])}; models: "
          f"{', '.join(f'{k} {v:.0f} MB' for k, v in report['model_mb'].items())}")
    print("| model | method | wall s / sample | x plain (range) | CPU s / sample | x plain (CPU) | setup s "
          "| peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, methods in report["results"].items():
        plain = methods.get("plain", [])
        for method in METHODS:
            rounds = methods.get(method)
            if not rounds:
                continue
            errors = [r["error"] for r in rounds if "error" in r]
            if errors:
                print(f"| {name} | {method} | failed: {errors[0]} | | | | | |")
                continue
            ratio, low, high = _paired(rounds, plain, "per_sample_s")
            cpu = _paired(rounds, plain, "cpu_per_sample_s")[0]
            print(f"| {name} | {method} | {_median(rounds, 'per_sample_s'):.4f} | {ratio:.2f} ({low:.2f}-{high:.2f}) "
                  f"| {_median(rounds, 'cpu_per_sample_s'):.4f} | {cpu:.2f} | {_median(rounds, 'setup_s'):.2f} "
                  f"| {max(r['rss_mb'] for r in rounds):.0f} |")
    if report.get("e2e"):
        print("\nEnd to end (whole process, samples from .npz files; medians over the rounds, ratios within a round)")
        print("| model | samples | method | wall s | wall s / sample | x plain (range) | CPU s / sample "
              "| x plain (CPU) | peak PSS MB (sum) | max RSS MB (self / largest child) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        e2e = report["e2e"]
        for key, rounds in e2e.items():
            name, n, method = key.split("|")
            errors = [r["error"] for r in rounds if "error" in r]
            if errors:
                print(f"| {name} | {n} | {method} | failed: {errors[0]} | | | | | | |")
                continue
            plain = e2e.get(f"{name}|{n}|plain", [])
            ratio, low, high = _paired(rounds, plain, "wall_s")
            cpu = _paired(rounds, plain, "cpu_s")[0]
            print(f"| {name} | {n} | {method} | {_median(rounds, 'wall_s'):.2f} | {_median(rounds, 'per_sample_s'):.4f} "
                  f"| {ratio:.2f} ({low:.2f}-{high:.2f}) | {_median(rounds, 'cpu_per_sample_s'):.4f} | {cpu:.2f} "
                  f"| {max(r['pss_peak_mb'] for r in rounds):.0f} "
                  f"| {max(r['rss_self_mb'] for r in rounds):.0f} / {max(r['rss_child_max_mb'] for r in rounds):.0f} |")
    if "big" in report:
        b = report["big"]
        print(f"\n>2 GB model: {b['model_bytes'] / 2**30:.2f} GiB, {b['samples']} samples, exit {b['exit']}, "
              f"wall {b['wall_s']:.1f} s, peak RSS {b['rss_mb']} MB")


if __name__ == "__main__":
    main()
