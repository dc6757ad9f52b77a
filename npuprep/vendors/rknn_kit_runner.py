"""Runs every probe of an npuprep probe kit with Rockchip's API; outputs for `probe --classify`.

    PC (rknn-toolkit2 venv):   python run_rknn_kit.py --target rk3588   # build, simulate, .rknn
    board (rknn-toolkit-lite2): python run_rknn_kit.py --board          # load models/*.rknn
    host: npuprep probe --classify KIT --outputs KIT/outputs            # (outputs_board on a board)

On the PC each FP32 `models/<probe>.onnx` is built in FP16 (`build(do_quantization=False)`),
exported as `models/<probe>.rknn` and run in the simulator; on the board RKNNLite runs the
`.rknn` files (copy the kit with them). Outputs are written, unmodified, as
`<outputs>/<probe>/<file_stem>.npy`. Python 3.8 compatible; needs only numpy and the API.
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rknn_job  # noqa: E402  (shipped next to this script)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="rk3588", help="target_platform for the PC build")
    parser.add_argument("--board", action="store_true", help="run models/*.rknn with RKNNLite")
    parser.add_argument("--outputs", help="output folder (default outputs, or outputs_board)")
    args = parser.parse_args()
    kit = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(kit, "manifest.json")) as f:
        manifest = json.load(f)
    out_root = os.path.join(kit, args.outputs or ("outputs_board" if args.board else "outputs"))
    failed = []
    for probe in manifest["probes"]:
        name = probe["name"]
        work = os.path.join(kit, "work", name)
        os.makedirs(work, exist_ok=True)
        rknn_file = os.path.join(kit, "models", name + ".rknn")
        spec = {
            "model": rknn_file if args.board else os.path.join(kit, probe["model"]),
            "target_platform": args.target,
            "inputs": [{"name": i["name"], "shape": i["shape"]} for i in probe["inputs"]],
            "samples": [[os.path.join(kit, i["npy"]) for i in probe["inputs"]]],
            "output_dir": "out",
        }
        if not args.board:
            spec["export_rknn"] = rknn_file
        with open(os.path.join(work, "job.json"), "w") as f:
            json.dump(spec, f, indent=1)
        if rknn_job.run(os.path.join(work, "job.json")) != 0:
            with open(os.path.join(work, "result.json")) as f:
                failed.append(f"{name} ({json.load(f)['stage']})")
            continue
        os.makedirs(os.path.join(out_root, name), exist_ok=True)
        for j, spec_out in enumerate(probe["outputs"]):
            value = np.load(os.path.join(work, "out", f"s0_o{j}.npy"))
            np.save(os.path.join(out_root, name, spec_out["file_stem"] + ".npy"), value)
    print(f"outputs in {out_root}")
    if failed:
        print("failed (job files and result.json in work/): " + ", ".join(failed))
        return 1
    shutil.rmtree(os.path.join(kit, "work"), ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
