"""The zoo and the real-model corpus on a real NPU toolchain: rknn-toolkit2 2.5.0 (rk3588, FP16).

Run: python bench/bench_rknn.py [--keep DIR] [--samples N] [--bisect] [NAME ...] [--corpus [NAME ...]]
[--extra DIR [NAME ...]]
(needs the rknn venv: bash npuprep/vendors/make_rknn_venv.sh; corpus models come from
bench/corpus.py's cache, built first with `python bench/corpus.py`; `--extra DIR` models are
DIR/NAME.onnx with DIR/NAME/calib/ and DIR/NAME/holdout/, as ../shared/corpus/extra2_models.sh
writes them)

Per model: the vendor path alone on the FP32 model (load_onnx, build(do_quantization=
False), simulator) and `npuprep convert --target rk3588` then the same vendor path, each
output's relative L2 error against FP32 (a host-scaled output multiplied back first), the
Inf/NaN count, and the toolkit's own message where it refuses a model. Zoo models calibrate
and run on their own samples; a corpus model calibrates on calib/, and the vendor runs and
npuprep's holdout check use heldout/. A model that fails in npuprep gets one row with the
exact error; the run goes on.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from npuprep.calibrate import calibrate
from npuprep.convert import convert
from npuprep.data import load_samples
from npuprep.examples import example_data_dir, example_model_path
from npuprep.examples.zoo import ZOO
from npuprep.model_io import Model, load_model
from npuprep.profiles import TargetProfile, load_profile
from npuprep.verify.vendor import vendor_check

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402 - the sibling script, run from anywhere


def cell(check) -> str:
    return _cell(check) + bisected(check.bisection)


def bisected(found: dict | None) -> str:
    """With --bisect: the nodes the toolkit broke on and the rewrite tried."""
    if not found:
        return ""
    nodes = ", ".join(f"`{n}` ({o})" for n, o in zip(found["nodes"], found["ops"], strict=True))
    fix = found["fix"] or (f"rewrite declined: {found['declined'][:100]}" if found["declined"]
                           else "no exact rewrite known")
    return f"; bisected in {found['builds']} builds to {nodes or found['why_not']}; {fix}"


def _cell(check) -> str:
    if not check.built:
        # `onnx.onnx_cpp2py_export.checker.ValidationError: ...` -> `ValidationError: ...`
        head, colon, rest = check.refusal.partition(": ")
        if not colon:  # npuprep's own words (a crash), not an exception line
            return head
        return f"refused in {check.stage}: `{head.rsplit('.', 1)[-1]}: {rest[:140]}`"
    bad = sum(o["nonfinite"] for o in check.outputs.values())
    values = sum(o.get("values", 0) for o in check.outputs.values())
    if bad:
        return f"**{bad} Inf/NaN**" + (f" of {values}" if values else "")
    return f"finite, rel L2 {max(o['rel_l2'] for o in check.outputs.values()):.2g}"


def vendor(reference: onnx.ModelProto, candidate: onnx.ModelProto, runs: list,
           **kwargs: Any) -> str:
    """The vendor path's table cell; npuprep's own failure to run it is the cell too."""
    try:
        return cell(vendor_check(reference, candidate, runs, **kwargs))
    except Exception as exc:
        return f"npuprep failed: {short_error(exc)}"


def emulated(check: Any) -> str:
    """npuprep's emulated verdict on the outputs: worst rel L2, or the Inf/NaN count."""
    bad = sum(o["nonfinite"] for o in check.outputs.values())
    if bad:
        return f"**{bad} Inf/NaN**"
    return f"{max(o['rel_l2'] for o in check.outputs.values()):.2g}"


def short_error(exc: BaseException) -> str:
    """`Type: message` on one line, the message cut for a table cell."""
    text = " ".join(str(exc).split())
    return f"`{type(exc).__name__}: {text[:160]}`"


def zoo_model(name: str, work: Path) -> tuple[Model, list, list, list]:
    """A zoo model (or the bundled planner) and its samples: calibration = verification."""
    if name == "planner":  # the bundled README example and its samples
        model = load_model(example_model_path())
        samples = list(load_samples(example_data_dir(), model.proto))
        return model, samples, samples, []
    zoo = ZOO[name]()
    (work / name / "data").mkdir(parents=True, exist_ok=True)
    onnx.save(zoo.model, str(work / name / "model.onnx"))
    for i, feed in enumerate(zoo.samples):
        np.savez(work / name / "data" / f"s{i}.npz", **feed)
    model = load_model(work / name / "model.onnx")
    samples = list(load_samples(work / name / "data", model.proto))
    return model, samples, samples, []


def corpus_model(name: str) -> tuple[Model, list, list, list]:
    """A corpus model from bench/corpus.py's cache: calib/ samples, heldout/ samples."""
    folder = corpus.corpus_dir() / name
    if not (folder / "entry.json").is_file():
        raise FileNotFoundError(f"{folder} not built (run: python bench/corpus.py --only {name})")
    model = load_model(folder / "model.onnx")
    calib = list(load_samples(folder / "calib", model.proto))
    heldout = list(load_samples(folder / "heldout", model.proto))
    return model, calib, heldout, heldout


def extra_model(folder: Path, name: str) -> tuple[Model, list, list, list]:
    """A model from an --extra folder: NAME.onnx, NAME/calib/ samples, NAME/holdout/ samples."""
    model = load_model(folder / f"{name}.onnx")
    calib = list(load_samples(folder / name / "calib", model.proto))
    holdout = list(load_samples(folder / name / "holdout", model.proto))
    return model, calib, holdout, holdout


def measure(name: str, model: Model, calib: list, runs: list, holdout: list, work: Path,
            profile: TargetProfile, bisect: bool = False) -> tuple[str, ...]:
    """One table row: the vendor alone, convert, the vendor after convert."""
    alone = vendor(model.proto, model.proto, runs, work_dir=work / name / "fp32")
    try:
        stats = calibrate(model, calib)
        result = convert(model, profile, calib, stats=stats, holdout=holdout or None)
    except Exception as exc:  # npuprep's own failure: its row says so, the run goes on
        return (alone, f"convert failed: {short_error(exc)}", "-", "-", "-", "-", "-")
    after = vendor(model.proto, result.lowered.model, runs, host_scales=result.host_scales,
                   work_dir=work / name / "converted", bisect=bisect)
    held = emulated(result.holdout) if result.holdout is not None else "-"
    done = {a.action for a in result.plan.actions}
    # Control flow removed before planning is a note of the plan, not an action.
    removed = ["If removed" for n in result.plan.notes if n.startswith("If node ")]
    actions = ", ".join([*removed[:1], *sorted(done)]) or "none"
    host = ", ".join(f"{k} x{v:g}" for k, v in result.host_scales.items()) or "-"
    return (alone, actions, host, emulated(result.output_check), held,
            "PASSED" if result.passed else "FAILED", after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="zoo models or planner (default: all, unless "
                        "--corpus is given)")
    parser.add_argument("--corpus", nargs="*", metavar="NAME",
                        help="corpus models too (no NAME: every built corpus model)")
    parser.add_argument("--extra", nargs="+", metavar="DIR_OR_NAME",
                        help="models of a folder too: DIR, then NAMEs (none: every DIR/NAME.onnx)")
    parser.add_argument("--keep", help="keep the vendor's work folders here")
    parser.add_argument("--samples", type=int, default=4, help="samples per model (default 4)")
    parser.add_argument("--bisect", action="store_true",
                        help="where the toolkit refuses or crashes on the converted model, bisect "
                             "to the nodes and retry their exact rewrite (as convert --verify-with)")
    args = parser.parse_args()
    profile = load_profile("rk3588")
    zoo_names = args.names or ([] if args.corpus is not None or args.extra else [*ZOO, "planner"])
    corpus_names = args.corpus
    if corpus_names == []:
        corpus_names = sorted(p.parent.name for p in corpus.corpus_dir().glob("*/entry.json"))
    jobs = [(n, "zoo") for n in zoo_names] + [(n, "corpus") for n in corpus_names or []]
    if args.extra:
        extra = Path(args.extra[0])
        jobs += [(n, "extra") for n in args.extra[1:] or sorted(p.stem for p in extra.glob("*.onnx"))]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        for name, source in jobs:
            t0 = time.perf_counter()
            try:
                model, calib, runs, holdout = (corpus_model(name) if source == "corpus" else
                                               extra_model(extra, name) if source == "extra"
                                               else zoo_model(name, work))
                row = measure(name, model, calib, runs[: args.samples], holdout, work, profile,
                              args.bisect)
            except Exception as exc:  # a model npuprep cannot even load: one row, exact error
                row = (f"failed: {short_error(exc)}", "-", "-", "-", "-", "-", "-")
            rows.append((name, *row, f"{time.perf_counter() - t0:.0f} s"))
            print(f"{name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    head = ("model", "vendor alone (FP32 model)", "npuprep actions", "host scale",
            "emulated rel L2", "emulated holdout rel L2", "convert", "vendor after convert",
            "time")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
