"""Runs one RKNN job spec (JSON) under the vendor's python: job.json -> outputs/*.npy + result.json.

    python rknn_job.py job.json

Runs where rknn-toolkit2 lives (its own venv on a PC: the x86 simulator) or on a board
with rknn-toolkit-lite2 (`RKNNLite`, from a `.rknn` file). It imports only the vendor API,
numpy and the standard library, so it never shares an environment with npuprep, and it
stays Python 3.8 compatible for board images.

Job spec keys (paths relative to the spec's folder):
  model            ONNX file to build (toolkit) or `.rknn` file to load (either API)
  target_platform  e.g. "rk3588"
  inputs           [{"name": ..., "shape": [...]}] in graph order (fixed sizes)
  samples          [[input .npy paths in `inputs` order], ...]
  output_dir       where sample i's output j goes as `s{i}_o{j}.npy`
  accuracy_dir     optional: run accuracy_analysis on sample 0 into this folder
  export_rknn      optional: write the built `.rknn` file here
  dataset          optional: dataset file; the build is then the toolkit's INT8
  hybrid_fp16      optional, with dataset: tensors whose producing layer stays FP16
                   (hybrid_quantization_step1/step2); an entry may be a list of
                   alternatives, the first its quantization.cfg lists is taken; entries with
                   none listed are reported in result["hybrid_unknown"]
result.json: {"ok", "stage", "api", "outputs": [[paths]], "shapes"}; on failure "stage"
names the step whose return code was not 0 (the vendor's log says why).
"""

import json
import os
import sys
import traceback

import numpy as np


def _api():
    try:
        from rknn.api import RKNN  # rknn-toolkit2: builds ONNX, runs the simulator

        return "rknn-toolkit2", RKNN
    except ImportError:
        from rknnlite.api import RKNNLite  # rknn-toolkit-lite2 on the board

        return "rknn-toolkit-lite2", RKNNLite


def _path(base, name):
    return name if os.path.isabs(name) else os.path.join(base, name)


STAGE = {"now": "import"}


def run(spec_path):
    base = os.path.dirname(os.path.abspath(spec_path))
    with open(spec_path) as f:
        spec = json.load(f)
    result = {"ok": False, "stage": "import", "api": "", "outputs": [], "shapes": []}
    out_file = _path(base, spec.get("result", "result.json"))

    def at(stage):
        STAGE["now"] = stage
        # On stderr as it happens: a crash inside the toolkit (SIGSEGV) writes no result.
        print(f"rknn_job: stage {stage}", file=sys.stderr, flush=True)

    def finish(stage, ok=False):
        result["stage"] = stage
        result["ok"] = ok
        with open(out_file, "w") as f:
            json.dump(result, f, indent=1)
        return 0 if ok else 1

    name, cls = _api()
    result["api"] = name
    rknn = cls(verbose=False) if name == "rknn-toolkit2" else cls()
    model = _path(base, spec["model"])
    inputs = spec.get("inputs", [])
    four_d = [len(i["shape"]) == 4 for i in inputs]
    if model.endswith(".rknn"):
        at("load_rknn")
        if rknn.load_rknn(model) != 0:
            return finish(STAGE["now"])
    else:
        at("config")
        if rknn.config(target_platform=spec["target_platform"]) != 0:
            return finish(STAGE["now"])
        at("load_onnx")
        # A rank-0 input (a bool flag) must be given as [1]: with [] the build drops its dims
        # and inference fails (IndexError in get_input_img, rknn-toolkit2 2.5.0).
        if rknn.load_onnx(model=model, inputs=[i["name"] for i in inputs],
                          input_size_list=[list(i["shape"]) or [1] for i in inputs]) != 0:
            return finish(STAGE["now"])
        # INT8: the toolkit's own quantisation, calibrated on the dataset file npuprep wrote
        # (one line per sample, its inputs' .npy files separated by spaces).
        dataset = _path(base, spec["dataset"]) if spec.get("dataset") else None
        if dataset is not None and spec.get("hybrid_fp16"):
            rknn = _hybrid(rknn, cls, spec, model, dataset, result, at)
            if rknn is None:
                return finish(STAGE["now"])
        else:
            at("build")
            if rknn.build(do_quantization=dataset is not None, dataset=dataset) != 0:
                return finish(STAGE["now"])
        at("export_rknn")
        if spec.get("export_rknn") and rknn.export_rknn(_path(base, spec["export_rknn"])) != 0:
            return finish(STAGE["now"])
    at("init_runtime")
    if rknn.init_runtime() != 0:
        return finish(STAGE["now"])
    out_dir = _path(base, spec.get("output_dir", "outputs"))
    os.makedirs(out_dir, exist_ok=True)
    for i, files in enumerate(spec.get("samples", [])):
        feeds = [np.atleast_1d(np.load(_path(base, p)).astype(np.float32)) for p in files]
        # 4-D inputs are NCHW in the ONNX graph; the API assumes NHWC unless told (and
        # takes no format for inputs of other ranks).
        formats = ["nchw"] * len(feeds) if any(four_d) else None
        at("inference")
        outs = rknn.inference(inputs=feeds, data_format=formats)
        if outs is None:
            return finish(STAGE["now"])
        paths = []
        for j, out in enumerate(outs):
            p = os.path.join(out_dir, f"s{i}_o{j}.npy")
            np.save(p, np.asarray(out, dtype=np.float32))
            paths.append(os.path.relpath(p, base))
        result["outputs"].append(paths)
        result["shapes"].append([list(np.shape(o)) for o in outs])
    if spec.get("accuracy_dir") and spec.get("samples"):
        acc = _path(base, spec["accuracy_dir"])
        files = [_path(base, p) for p in spec["samples"][0]]
        at("accuracy_analysis")
        if rknn.accuracy_analysis(inputs=files, output_dir=acc, target=None) != 0:
            return finish(STAGE["now"])
    rknn.release()
    return finish("done", ok=True)


def _hybrid(rknn, cls, spec, model, dataset, result, at):
    """The toolkit's INT8 with the named tensors' layers in FP16: step1 writes the
    quantization.cfg, whose `custom_quantize_layers` takes `tensor: float16`; step2 builds."""
    at("hybrid_quantization_step1")
    if rknn.hybrid_quantization_step1(dataset=dataset) != 0:
        return None
    # step1 writes <model stem>.{model,data,quantization.cfg} into the working folder.
    stem = os.path.splitext(os.path.basename(model))[0]
    cfg_path = stem + ".quantization.cfg"
    from ruamel.yaml import YAML  # the toolkit's own YAML library (it writes this file with it)

    yaml = YAML(typ="safe")
    with open(cfg_path) as f:
        cfg = yaml.load(f)
    listed = set(cfg.get("quantize_parameters") or {})
    wanted, unknown = [], []
    for entry in spec["hybrid_fp16"]:
        # A list holds alternatives, first choice first: a layer the toolkit fused into the
        # next one (Conv + BatchNormalization) is known by the fused layer's output.
        names = [entry] if isinstance(entry, str) else entry
        found = [t for t in names if t in listed]
        if found:
            wanted.append(found[0])
        else:
            unknown.append(names[0])
    wanted = list(dict.fromkeys(wanted))
    result["hybrid_fp16"] = wanted
    result["hybrid_unknown"] = unknown
    cfg["custom_quantize_layers"] = dict((t, "float16") for t in wanted)
    with open(cfg_path, "w") as f:
        yaml.dump(cfg, f)
    rknn.release()
    rknn = cls(verbose=False)
    at("config")
    if rknn.config(target_platform=spec["target_platform"]) != 0:
        return None
    at("hybrid_quantization_step2")
    if rknn.hybrid_quantization_step2(model_input=stem + ".model", data_input=stem + ".data",
                                      model_quantization_cfg=cfg_path) != 0:
        return None
    return rknn


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python rknn_job.py job.json")
    try:
        sys.exit(run(sys.argv[1]))
    except Exception:
        traceback.print_exc()
        print(f"rknn_job: failed in {STAGE['now']}", file=sys.stderr)
        sys.exit(3)
