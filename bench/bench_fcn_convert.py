"""Convert's time and peak memory on a fully convolutional U-Net at 1x1x512x416 (issue 37).

Run: python bench/bench_fcn_convert.py --out /tmp/fcn [--samples 3] [--pixels 255] [--build-only]
     [--autocast]   also ModelOpt's AutoCast on the same model and samples (bench_corpus's runner)

An unseen FCN at 512x416 inputs did not finish converting in 30 minutes. This builds a
plausible stand-in: a U-Net-ish encoder/decoder of 14 Conv+BatchNorm+ReLU layers (32-64
channels, two MaxPool downs, two Resize ups with skip Concats), one 1x1 head and a Sigmoid,
with `--samples` random images in `OUT/data/`. It then times `npuprep convert --target
a2000` on it in a child process and reports the child's wall time and peak RSS; with
`--autocast`, AutoCast's FP16 conversion of the same model with the same samples as its
calibration data, timed the same way and judged on the last sample (npuprep holds that one
out: 1 in 4 of --data) by bench_corpus's emulated-FP16 judge, beside npuprep's model.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HEIGHT, WIDTH = 512, 416


def build_unet(seed: int = 0) -> onnx.ModelProto:
    """x[1,1,512,416] -> conv blocks 32, 32 | pool | 48, 48 | pool | 64, 64, 64 | up + skip |
    48, 48 | up + skip | 32, 32, 32 -> 1x1 conv -> Sigmoid."""
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    count = [0]

    def conv_bn_relu(x: str, cin: int, cout: int) -> str:
        i = count[0] = count[0] + 1
        w = (rng.standard_normal((cout, cin, 3, 3)) * np.sqrt(2.0 / (9 * cin))).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        inits.append(numpy_helper.from_array(np.zeros(cout, np.float32), f"b{i}"))
        for k, v in (("g", 1 + 0.1 * rng.standard_normal(cout)), ("be", 0.1 * rng.standard_normal(cout)),
                     ("m", 0.1 * rng.standard_normal(cout)), ("v", 1 + 0.2 * rng.random(cout))):
            inits.append(numpy_helper.from_array(v.astype(np.float32), f"{k}{i}"))
        nodes.append(helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], name=f"Conv_{i}",
                                      pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("BatchNormalization", [f"c{i}", f"g{i}", f"be{i}", f"m{i}", f"v{i}"],
                                      [f"n{i}"], name=f"BN_{i}"))
        nodes.append(helper.make_node("Relu", [f"n{i}"], [f"r{i}"], name=f"Relu_{i}"))
        return f"r{i}"

    def pool(x: str, name: str) -> str:
        nodes.append(helper.make_node("MaxPool", [x], [name], name=name, kernel_shape=[2, 2], strides=[2, 2]))
        return name

    def up_cat(x: str, skip: str, name: str) -> str:
        inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), f"{name}_scales"))
        nodes.append(helper.make_node("Resize", [x, "", f"{name}_scales"], [f"{name}_up"], name=f"{name}_up",
                                      mode="nearest"))
        nodes.append(helper.make_node("Concat", [f"{name}_up", skip], [name], name=name, axis=1))
        return name

    e1 = conv_bn_relu(conv_bn_relu("x", 1, 32), 32, 32)
    e2 = conv_bn_relu(conv_bn_relu(pool(e1, "pool1"), 32, 48), 48, 48)
    mid = conv_bn_relu(conv_bn_relu(conv_bn_relu(pool(e2, "pool2"), 48, 64), 64, 64), 64, 64)
    d2 = conv_bn_relu(conv_bn_relu(up_cat(mid, e2, "up2"), 64 + 48, 48), 48, 48)
    d1 = conv_bn_relu(conv_bn_relu(conv_bn_relu(up_cat(d2, e1, "up1"), 48 + 32, 32), 32, 32), 32, 32)
    inits.append(numpy_helper.from_array((rng.standard_normal((1, 32, 1, 1)) * 0.2).astype(np.float32), "wh"))
    nodes.append(helper.make_node("Conv", [d1, "wh"], ["logits"], name="Conv_head"))
    nodes.append(helper.make_node("Sigmoid", ["logits"], ["y"], name="Sigmoid_out"))
    graph = helper.make_graph(
        nodes, "unet_512x416",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, HEIGHT, WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, HEIGHT, WIDTH])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def write_inputs(out: Path, samples: int, pixels: float) -> tuple[Path, Path]:
    """The model and `samples` smooth random images (a blurred field, values in 0..`pixels`:
    255 for raw 8-bit pixels, as a fingerprint or document model takes them)."""
    out.mkdir(parents=True, exist_ok=True)
    model = out / "unet_512x416.onnx"
    onnx.save(build_unet(), model)
    data = out / "data"
    data.mkdir(exist_ok=True)
    rng = np.random.default_rng(1)
    for i in range(samples):
        coarse = rng.random((1, 1, HEIGHT // 16, WIDTH // 16)).astype(np.float32)
        image = np.kron(coarse, np.ones((16, 16), np.float32)) + 0.05 * rng.standard_normal(
            (1, 1, HEIGHT, WIDTH)).astype(np.float32)
        np.savez(data / f"sample_{i}.npz", x=(pixels * image).astype(np.float32))
    return model, data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--pixels", type=float, default=255.0, help="input range 0..PIXELS")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--autocast", action="store_true", help="also time and judge ModelOpt's AutoCast")
    args = ap.parse_args()
    model, data = write_inputs(args.out, args.samples, args.pixels)
    if args.build_only:
        print(model)
        return
    cmd = [sys.executable, "-c", "from npuprep.cli.start import entry; entry()", "convert", str(model), "--target", "a2000",
           "--data", str(data), "-o", str(args.out / "converted.onnx")]
    start = time.perf_counter()
    rc = subprocess.run(cmd, check=False).returncode
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(f"convert exit {rc}: {wall:.1f} s wall, peak RSS {peak:.2f} GB")
    if args.autocast:
        autocast(model, data, args.out)


def autocast(model: Path, data: Path, out: Path) -> None:
    """AutoCast on the same model and samples, and both conversions under the same judge."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_corpus  # the sibling script: its AutoCast runner and emulated-FP16 judge

    held = out / "judged"
    held.mkdir(exist_ok=True)
    last = sorted(data.glob("*.npz"))[-1]
    (held / last.name).write_bytes(last.read_bytes())
    ran = bench_corpus.run_autocast(model, data, held, out / "autocast.onnx", 32000, 3600)
    print(f"AutoCast: {ran.seconds:.1f} s wall, peak RSS {ran.peak_mb / 1024:.2f} GB{', ' + ran.error if ran.error else ''}; "
          f"emulated FP16 on {last.name}: {bench_corpus.fmt_judgement(ran.judged)} (rel L2 / max abs / Inf-NaN), "
          f"FP32 MACs {bench_corpus._percent(ran.macs_fp32_share)}")
    converted = out / "converted.onnx"
    if converted.exists():
        import onnx

        judged = bench_corpus.try_judge(bench_corpus.session(str(model)), onnx.load(str(converted)),
                                        bench_corpus.load_samples(held))
        print(f"npuprep: emulated FP16 on {last.name}: {bench_corpus.fmt_judgement(judged)}")


if __name__ == "__main__":
    main()
