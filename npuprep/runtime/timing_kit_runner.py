"""Times the models of an `npuprep ledger --export-kit` kit on the board; results for `--measured`.

    onnxruntime (any EP):  python time_models.py [--providers CUDAExecutionProvider,CPUExecutionProvider]
    Rockchip board:        python time_models.py --backend rknnlite     # models/<name>.rknn
    torch only (CUDA):     python time_models.py --backend torch        # needs onnx; the ops below
    Jetson Orin:           run the trtexec lines of README.md, then
                           python time_models.py --from-trtexec fp32=fp32_times.json ...
    host:                  npuprep ledger MODEL --target T [CONVERTED] --measured results.json

Each model runs in its own process. It is warmed first, so an idle clock does not time its
first runs: at least 50 runs (--warmup) and 0.3 s of work, then batches of runs until two
consecutive batch medians agree within 5% (at most 10 s, --warm-max-s). Then the median and p90 of 200
timed runs (--runs), and its peak memory by the runtime's own counter (the process's peak
resident set, ru_maxrss, for onnxruntime on CPU and for RKNNLite; trtexec's own figures for
TensorRT). The device's state (load, governor, temperatures, clocks) is recorded before the
runs, and each model's clocks before its warm-up and after its timed runs, where the device
lets them be read. Python 3.8 compatible; needs only numpy and the backend.
"""

import argparse
import glob
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# Where IO binding puts the inputs and outputs for each execution provider.
DEVICE_OF_PROVIDER = {"CUDAExecutionProvider": "cuda", "TensorrtExecutionProvider": "cuda",
                      "CPUExecutionProvider": "cpu"}


def _read(path):
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def device_state():
    """What may move a timing: load, CPU governor and clocks, temperatures, NPU/GPU clocks."""
    state = {"platform": platform.platform(), "machine": platform.machine(),
             "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        state["loadavg"] = list(os.getloadavg())
    except OSError:
        pass
    state["governor"] = _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
    state["cpu0_khz"] = _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq")
    temps = {}
    for zone in sorted(glob.glob("/sys/class/thermal/thermal_zone*")):
        kind, temp = _read(zone + "/type"), _read(zone + "/temp")
        if kind and temp and temp.lstrip("-").isdigit():
            temps[kind] = int(temp) / 1000.0
    state["temperatures_c"] = temps
    devfreq = {}
    for dev in sorted(glob.glob("/sys/class/devfreq/*")):
        freq = _read(dev + "/cur_freq")
        if freq:
            devfreq[os.path.basename(dev)] = freq  # Rockchip NPU, Jetson GPU clocks
    state["devfreq_hz"] = devfreq
    if shutil.which("nvidia-smi"):  # the GPU a CUDA provider runs on
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm",
                                "--format=csv,noheader"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        state["gpu"] = query.stdout.decode(errors="replace").strip()
    if shutil.which("nvpmodel"):  # Jetson power mode
        query = subprocess.run(["nvpmodel", "-q"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        state["nvpmodel"] = query.stdout.decode(errors="replace").strip()
    return state


def clocks():
    """The clocks a timing depends on, where they can be read: the GPU's SM clock
    (nvidia-smi), devfreq devices (Rockchip NPU, Jetson GPU), CPU 0's frequency."""
    state = {}
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        state["gpu_sm"] = query.stdout.decode(errors="replace").strip()
    for dev in sorted(glob.glob("/sys/class/devfreq/*")):
        freq = _read(dev + "/cur_freq")
        if freq:
            state[os.path.basename(dev) + "_hz"] = freq
    khz = _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq")
    if khz:
        state["cpu0_khz"] = khz
    return state


def _inputs(manifest):
    return {i["name"]: np.load(os.path.join(HERE, i["file"])) for i in manifest["inputs"]}


WARM_S, WARM_BATCH, WARM_AGREE = 0.3, 20, 0.05


def _timed(run, n):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        run()
        times.append(1e3 * (time.perf_counter() - start))
    return times


def _warm(run, warmup, most_s):
    """At least `warmup` runs and WARM_S seconds of work, then batches until two consecutive
    batch medians agree within WARM_AGREE (the clock has ramped up), at most `most_s`."""
    start = time.perf_counter()
    done = len(_timed(run, warmup))
    while time.perf_counter() - start < WARM_S:
        done += len(_timed(run, WARM_BATCH))
    previous = statistics.median(_timed(run, WARM_BATCH))
    done += WARM_BATCH
    settled = False
    while time.perf_counter() - start < most_s:
        median = statistics.median(_timed(run, WARM_BATCH))
        done += WARM_BATCH
        if abs(median - previous) <= WARM_AGREE * max(median, previous):
            settled = True
            break
        previous = median
    return {"warmup": done, "warmup_s": time.perf_counter() - start, "warmup_settled": settled}


def _time(run, args):
    before = clocks()
    warm = _warm(run, args.warmup, args.warm_max_s)
    runs = args.runs
    times = sorted(_timed(run, runs))
    return dict(warm, median_ms=statistics.median(times), p90_ms=times[int(0.9 * (len(times) - 1))],
                min_ms=times[0], runs=runs, clock_before=before, clock_after=clocks())


def _peak_rss_mb():
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024.0 if sys.platform != "darwin" else peak / 2 ** 20  # kB on Linux


def _time_ort(entry, feeds, args):
    """onnxruntime with inputs and outputs bound on the provider's device (IO binding), so the
    timing is the model's, not the copies over PCIe; the asked-for provider or a refusal."""
    import onnxruntime as ort

    providers = args.providers.split(",") if args.providers else ["CPUExecutionProvider"]
    available = ort.get_available_providers()
    if providers[0] not in available:
        raise SystemExit("refused: {} is not in this onnxruntime ({} has {}); install the build "
                         "that has it".format(providers[0], ort.__version__, ", ".join(available)))
    session = ort.InferenceSession(os.path.join(HERE, entry["model"]), providers=providers)
    if session.get_providers()[0] != providers[0]:
        raise SystemExit(f"refused: {providers[0]} did not load (onnxruntime fell back to {session.get_providers()[0]}); its libraries "
                         "(CUDA, cuDNN, TensorRT) are missing or mismatched")
    device = DEVICE_OF_PROVIDER.get(providers[0], "cpu")
    binding = session.io_binding()
    for name, arr in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr, device, 0))
    for out in session.get_outputs():
        binding.bind_output(out.name, device, 0)

    def run():
        session.run_with_iobinding(binding)
        if device != "cpu":
            binding.synchronize_outputs()

    result = _time(run, args)
    result["backend"] = "onnxruntime " + ort.__version__ + " " + ",".join(session.get_providers())
    result["provider"], result["device"] = providers[0], device
    result["io_binding"] = "inputs and outputs on " + device
    result["versions"] = {"onnxruntime": ort.__version__, "numpy": np.__version__,
                          "python": platform.python_version()}
    return result


TORCH_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32"}


def _torch_op(torch, node, args, attrs):
    """One ONNX node as eager torch kernels (the handful a GEMM chain, a conv net and a
    transformer block use); anything else is refused by name."""
    f = torch.nn.functional
    op = node.op_type
    if op == "MatMul":
        return torch.matmul(*args)
    if op in ("Add", "Mul", "Sub", "Div"):
        return {"Add": torch.add, "Mul": torch.mul, "Sub": torch.sub, "Div": torch.div}[op](*args)
    if op == "Relu":
        return torch.relu(args[0])
    if op == "Gelu":
        return f.gelu(args[0])
    if op == "Softmax":
        return torch.softmax(args[0], dim=attrs.get("axis", -1))
    if op == "Cast":
        return args[0].to(getattr(torch, TORCH_DTYPES[attrs["to"]]))
    if op == "Reshape":
        return args[0].reshape([int(d) for d in args[1].tolist()])
    if op == "Transpose":
        return args[0].permute(*attrs["perm"])
    if op == "GlobalAveragePool":
        return args[0].mean(dim=(2, 3), keepdim=True)
    if op == "LayerNormalization":
        shape = args[0].shape[attrs.get("axis", -1):]
        return f.layer_norm(args[0], shape, args[1], args[2] if len(args) > 2 else None,
                            attrs.get("epsilon", 1e-5))
    if op == "Conv":
        pads = attrs.get("pads", [0, 0, 0, 0])
        return f.conv2d(args[0], args[1], args[2] if len(args) > 2 else None,
                        stride=attrs.get("strides", 1), padding=pads[:2],
                        dilation=attrs.get("dilations", 1), groups=attrs.get("group", 1))
    raise SystemExit(f"refused: the torch backend has no kernel for {op} ({node.name}); use onnxruntime, "
                     "RKNNLite or trtexec")


def _time_torch(entry, feeds, args):
    """Eager torch on CUDA, inputs and weights on the device, outputs left there; one kernel
    (or a few) per node, no fusion: what the ledger estimates without fusion."""
    import onnx
    import torch
    from onnx import helper, numpy_helper

    if not torch.cuda.is_available():
        raise SystemExit("refused: torch sees no CUDA device")
    # FP32 is FP32, as trtexec --noTF32 (cuDNN runs FP32 convolutions as TF32 by default).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = onnx.load(os.path.join(HERE, entry["model"]))
    dev = torch.device("cuda")
    # Integer initialisers (Reshape's shapes) stay on the host: reading one back from the
    # device would synchronise in the middle of the run.
    values = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in model.graph.initializer}
    values = {k: v.to(dev) if v.is_floating_point() else v for k, v in values.items()}
    inputs = {k: torch.from_numpy(v).to(dev) for k, v in feeds.items()}
    nodes = [(n, {a.name: helper.get_attribute_value(a) for a in n.attribute}) for n in model.graph.node]
    outputs = [o.name for o in model.graph.output]

    def run():
        env = dict(values, **inputs)
        for node, attrs in nodes:
            env[node.output[0]] = _torch_op(torch, node, [env[i] for i in node.input if i], attrs)
        torch.cuda.synchronize()
        return [env[o] for o in outputs]

    with torch.inference_mode():
        result = _time(run, args)
    result["backend"] = "torch " + torch.__version__ + " eager CUDA " + str(torch.version.cuda)
    result["provider"], result["device"] = "torch eager", torch.cuda.get_device_name(0)
    result["io_binding"] = "inputs, weights and outputs on cuda"
    result["peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
    result["versions"] = {"torch": torch.__version__, "cuda": str(torch.version.cuda),
                          "onnx": onnx.__version__, "numpy": np.__version__}
    return result


def _rknn_version(rknn):
    try:
        return str(rknn.get_sdk_version())
    except Exception:  # noqa: BLE001 - older RKNNLite builds lack it; the timing still stands
        return "unknown"


def time_one(name, args):
    """Time one model in this process and print its JSON line."""
    with open(os.path.join(HERE, "manifest.json")) as fh:
        manifest = json.load(fh)
    entry = next(m for m in manifest["models"] if m["name"] == name)
    feeds = _inputs(manifest)
    if args.backend == "ort":
        result = _time_ort(entry, feeds, args)
    elif args.backend == "torch":
        result = _time_torch(entry, feeds, args)
    else:
        from rknnlite.api import RKNNLite

        rknn = RKNNLite()
        if rknn.load_rknn(os.path.join(HERE, entry["model"][:-5] + ".rknn")) != 0:
            raise SystemExit("load_rknn failed for " + name)
        if rknn.init_runtime() != 0:
            raise SystemExit("init_runtime failed")
        data = [feeds[i["name"]] for i in manifest["inputs"]]
        result = _time(lambda: rknn.inference(inputs=data, data_format="nchw"), args)
        result["backend"] = "RKNNLite"
        result["provider"], result["device"] = "RKNNLite", "NPU"
        result["versions"] = {"rknn_runtime": _rknn_version(rknn), "numpy": np.__version__}
    if "peak_memory_mb" not in result:
        result["peak_memory_mb"] = _peak_rss_mb()
        result["memory_counter"] = "process peak resident set (ru_maxrss)"
    else:
        result["memory_counter"] = "torch.cuda.max_memory_allocated"
    print(json.dumps(result))


def from_trtexec(pairs, warmup):
    """trtexec --exportTimes files (one list of per-run records) -> the same result records;
    the first `warmup` runs are dropped."""
    models = {}
    for pair in pairs:
        name, _, path = pair.partition("=")
        with open(path) as fh:
            runs = json.load(fh)[warmup:]
        times = sorted(float(r["computeMs"] if "computeMs" in r else r["latencyMs"]) for r in runs)
        models[name] = {"median_ms": statistics.median(times),
                        "p90_ms": times[int(0.9 * (len(times) - 1))], "min_ms": times[0],
                        "runs": len(times), "backend": "trtexec (GPU compute time)",
                        "provider": "TensorRT", "device": "cuda",
                        "versions": {"trtexec": "see trtexec's log ('TensorRT version')"},
                        "peak_memory_mb": None,
                        "memory_counter": "see trtexec's log: 'Total GPU memory' / engine size"}
    return models


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("ort", "rknnlite", "torch"), default="ort")
    parser.add_argument("--providers", help="onnxruntime execution providers, comma-separated")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--warm-max-s", type=float, default=10.0,
                        help="the longest warm-up waits for two batch medians to agree")
    parser.add_argument("--out", default=os.path.join(HERE, "results.json"))
    parser.add_argument("--from-trtexec", nargs="+", metavar="NAME=TIMES.json",
                        help="turn trtexec --exportTimes files into results.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        time_one(args.one, args)
        return 0
    with open(os.path.join(HERE, "manifest.json")) as fh:
        manifest = json.load(fh)
    results = {"kind": "ledger-results", "schema_version": 1, "kit": manifest["fingerprint"],
               "device": device_state(), "models": {}}
    if args.from_trtexec:
        results["models"] = from_trtexec(args.from_trtexec, args.warmup)
    else:
        for entry in manifest["models"]:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", entry["name"],
                   "--backend", args.backend, "--warmup", str(args.warmup), "--runs", str(args.runs),
                   "--warm-max-s", str(args.warm_max_s)]
            if args.providers:
                cmd += ["--providers", args.providers]
            done = subprocess.run(cmd, stdout=subprocess.PIPE)
            if done.returncode != 0:
                return 2  # the child said why (a refused provider) on stderr
            line = done.stdout.decode().strip()
            results["models"][entry["name"]] = json.loads(line.splitlines()[-1])
            print(entry["name"], results["models"][entry["name"]])
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2, sort_keys=True)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
