"""Time a compute-bound GEMM and a memory-bound elementwise chain per format on an NVIDIA GPU.

    python bench/gpu_roofline.py [--json OUT.json] [--n 8192] [--elements 268435456]
    python bench/gpu_roofline.py --estimate OUT.json [--target h200]   # off-device: beside the ledger

Needs torch with CUDA only. Formats: fp32 (TF32 off), tf32, fp16, bf16, and fp8_e4m3 through
torch._scaled_mm where the GPU has it (sm_89+). Each case: 10 warm-up runs, then the median and
p90 of 50 timed runs (CUDA events). The GEMM is C = A @ B with N x N operands; the chain is three
elementwise kernels (x * a, + b, relu), each reading and writing the whole tensor. `npuprep
ledger`'s estimate for the same shapes is computed off-device from the GPU's profile
with `--estimate`, which prints the Markdown table of BENCHMARKS.md: measured time and ratio to
FP32 beside `npuprep.ledger.roofline.roofline_ms` on the profile's published peaks, for the same
FLOPs and bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

WARMUP = 10
RUNS = 50
FORMATS = ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3")


def _timed(fn, torch) -> dict[str, float]:
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(RUNS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return {"median_ms": statistics.median(times), "p90_ms": times[int(0.9 * (len(times) - 1))]}


def _gemm(torch, fmt: str, n: int) -> dict[str, float] | str:
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = fmt == "tf32"
    if fmt in ("fp32", "tf32", "fp16", "bf16"):
        dtype = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
                 "bf16": torch.bfloat16}[fmt]
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        result = _timed(lambda: a @ b, torch)
    else:
        if not hasattr(torch, "float8_e4m3fn") or torch.cuda.get_device_capability() < (8, 9):
            return "no FP8 on this GPU/torch"
        a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
        # _scaled_mm wants the second operand column-major.
        b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.tensor(1.0, device=dev)
        result = _timed(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                 out_dtype=torch.bfloat16), torch)
    torch.backends.cuda.matmul.allow_tf32 = False
    result["tflops"] = 2 * n ** 3 / (result["median_ms"] * 1e-3) / 1e12
    return result


def _chain(torch, fmt: str, elements: int) -> dict[str, float] | str:
    if fmt == "fp8_e4m3":
        return "torch has no elementwise FP8 arithmetic"
    dtype = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
             "bf16": torch.bfloat16}[fmt]
    x = torch.randn(elements, device="cuda", dtype=dtype)
    y = torch.empty_like(x)

    def chain() -> None:
        torch.mul(x, 1.5, out=y)
        torch.add(y, 0.25, out=y)
        torch.relu_(y)

    result = _timed(chain, torch)
    moved = 3 * 2 * elements * x.element_size()
    result["gbs"] = moved / (result["median_ms"] * 1e-3) / 1e9
    result["bytes"] = moved
    return result


def estimate(path: str, target: str) -> int:
    """Measured beside the ledger's roofline for the same shapes (npuprep needed, no GPU)."""
    from npuprep.ledger.roofline import BYTES_PER_ELEMENT, roofline_ms
    from npuprep.profiles import load_profile

    doc = json.loads(Path(path).read_text())
    tp = load_profile(target).throughput
    n, elements = doc["n"], doc["elements"]
    print(f"{doc['device']} (sm_{''.join(map(str, doc['capability']))}), torch {doc['torch']}, "
          f"CUDA {doc['cuda']}; {doc['warmup']} warm-up, median of {doc['runs']}")
    print()
    print("| case | format | measured ms | measured vs FP32 | achieved | estimated ms | "
          "estimated vs FP32 | bound (est.) |")
    print("|---|---|---|---|---|---|---|---|")
    for case in ("gemm", "chain"):
        base_measured = doc[case]["fp32"]["median_ms"]
        base_est = None
        for fmt in FORMATS:
            m = doc[case][fmt]
            size = BYTES_PER_ELEMENT[fmt]
            if case == "gemm":
                flops, nbytes = 2 * n ** 3, 3 * n * n * size
            else:
                flops, nbytes = 3 * elements, 6 * elements * size
            est, bound = roofline_ms(flops, nbytes, fmt, tp)
            base_est = base_est or est
            if isinstance(m, str):
                print(f"| {case} | {fmt} | {m} | | | {est:.3g} | {base_est / est:.2g}x | {bound} |")
                continue
            achieved = (f"{m['tflops']:.0f} TFLOPS" if case == "gemm" else f"{m['gbs']:.0f} GB/s")
            print(f"| {case} | {fmt} | {m['median_ms']:.3g} (p90 {m['p90_ms']:.3g}) | "
                  f"{base_measured / m['median_ms']:.2g}x | {achieved} | {est:.3g} | "
                  f"{base_est / est:.2g}x | {bound} |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument("--n", type=int, default=8192, help="GEMM size N (N x N x N)")
    parser.add_argument("--elements", type=int, default=1 << 28, help="elements in the chain")
    parser.add_argument("--estimate", metavar="RESULTS.json",
                        help="off-device: print measured beside the ledger's estimate")
    parser.add_argument("--target", default="h200", help="profile for --estimate (default h200)")
    args = parser.parse_args()
    if args.estimate:
        return estimate(args.estimate, args.target)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device visible to torch", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0)
    props = torch.cuda.get_device_properties(0)
    doc = {"device": gpu, "capability": list(torch.cuda.get_device_capability()),
           "sms": props.multi_processor_count, "torch": torch.__version__,
           "cuda": torch.version.cuda, "n": args.n, "elements": args.elements,
           "warmup": WARMUP, "runs": RUNS, "gemm": {}, "chain": {}}
    print(f"device: {gpu}; torch {torch.__version__}; CUDA {torch.version.cuda}")
    for fmt in FORMATS:
        doc["gemm"][fmt] = _gemm(torch, fmt, args.n)
        doc["chain"][fmt] = _chain(torch, fmt, args.elements)
        print(fmt, "gemm", doc["gemm"][fmt], "chain", doc["chain"][fmt], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
