"""The zoo on a real NPU toolchain: rknn-toolkit2 2.5.0 (rk3588, FP16 build, x86 simulator).

Run: python bench/bench_rknn.py [--keep DIR] [--samples N] [NAME ...]   (needs the rknn venv:
bash npuprep/vendors/make_rknn_venv.sh)

Per zoo model: the vendor path alone on the FP32 model (load_onnx, build(do_quantization=
False), simulator) and `npuprep convert --target rk3588` then the same vendor path, each
output's relative L2 error against FP32 (a host-scaled output multiplied back first), the
Inf/NaN count, and the toolkit's own message where it refuses a model.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.data import load_samples
from npuprep.examples import example_data_dir, example_model_path
from npuprep.examples.zoo import ZOO
from npuprep.model_io import load_model
from npuprep.profiles import load_profile
from npuprep.verify.vendor import vendor_check


def cell(check) -> str:
    if not check.built:
        # `onnx.onnx_cpp2py_export.checker.ValidationError: ...` -> `ValidationError: ...`
        head, _, rest = check.refusal.partition(": ")
        return f"refused in {check.stage}: `{head.rsplit('.', 1)[-1]}: {rest[:80]}`"
    bad = sum(o["nonfinite"] for o in check.outputs.values())
    values = sum(o.get("values", 0) for o in check.outputs.values())
    if bad:
        return f"**{bad} Inf/NaN**" + (f" of {values}" if values else "")
    return f"finite, rel L2 {max(o['rel_l2'] for o in check.outputs.values()):.2g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="zoo models or planner (default: all)")
    parser.add_argument("--keep", help="keep the vendor's work folders here")
    parser.add_argument("--samples", type=int, default=4, help="samples per model (default 4)")
    args = parser.parse_args()
    profile = load_profile("rk3588")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        for name in args.names or [*ZOO, "planner"]:
            if name == "planner":  # the bundled README example and its samples
                model = load_model(example_model_path())
                all_samples = load_samples(example_data_dir(), model.proto)
            else:
                zoo = ZOO[name]()
                (work / name / "data").mkdir(parents=True, exist_ok=True)
                onnx.save(zoo.model, str(work / name / "model.onnx"))
                for i, feed in enumerate(zoo.samples):
                    np.savez(work / name / "data" / f"s{i}.npz", **feed)
                model = load_model(work / name / "model.onnx")
                all_samples = load_samples(work / name / "data", model.proto)
            samples = list(all_samples)[: args.samples]
            t0 = time.perf_counter()
            alone = vendor_check(model.proto, model.proto, samples, work_dir=work / name / "fp32")
            stats = calibrate(model, all_samples)
            result = convert(model, profile, list(all_samples), stats=stats)
            after = vendor_check(model.proto, result.lowered.model, samples,
                                 host_scales=result.host_scales, work_dir=work / name / "converted")
            emulated = max(o["rel_l2"] for o in result.output_check.outputs.values())
            done = {a.action for a in result.plan.actions}
            # Control flow removed before planning is a note of the plan, not an action.
            removed = ["If removed" for n in result.plan.notes if n.startswith("If node ")]
            actions = ", ".join([*removed[:1], *sorted(done)]) or "none"
            host = ", ".join(f"{k} x{v:g}" for k, v in result.host_scales.items()) or "-"
            rows.append((name, cell(alone), actions, host, f"{emulated:.2g}",
                         "PASSED" if result.passed else "FAILED", cell(after),
                         f"{time.perf_counter() - t0:.0f} s"))
            print(f"{name}: done", flush=True)
    head = ("model", "vendor alone (FP32 model)", "npuprep actions", "host scale",
            "emulated rel L2", "convert", "vendor after convert", "time")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
