"""Shared CLI pieces: common arguments, JSON and table output, progress bars."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from npuprep.formatting import WIDTH, Output, cell, table_lines, wrap

# Library modules use these too; they live outside cli/ (no library module imports cli/).
from npuprep.json_io import dump_json, to_jsonable  # noqa: F401 - re-exported for the commands
from npuprep.names import shown
from npuprep.progress import progress_counter
from npuprep.scale_rules import ScaleRule

if TYPE_CHECKING:
    import onnx

    from npuprep.data import SampleSet
    from npuprep.detections import Decision

T = TypeVar("T")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def add_target(p: argparse.ArgumentParser, required: bool = True) -> None:
    from npuprep.profile_names import builtin_names

    p.add_argument(
        "--target", "-t", required=required, default=None if required else "generic",
        help=f"built-in profile name ({', '.join(builtin_names())}) or a profile YAML path",
    )


def add_data(p: argparse.ArgumentParser, required: bool = False) -> None:
    g = p.add_argument_group("samples")
    src = g.add_mutually_exclusive_group(required=required)
    src.add_argument("--data", "-d", help=".npz sample, directory of .npz, batched .npz or Polygraphy JSON")
    src.add_argument("--synthetic", type=positive_int, metavar="N",
                     help="N seeded random samples (reports say so)")
    g.add_argument("--batched", action="store_true", help="split a single .npz along axis 0")
    g.add_argument("--seed", type=_seed, default=0, help="seed for --synthetic (default 0)")
    g.add_argument("--input-range", action="append", type=input_range, default=[], metavar="NAME:LO:HI",
                   help="--synthetic values of input NAME: floats in [LO, HI), integers LO..HI (repeatable; "
                        "default: normal floats, integers 0..3, token ids within their embedding table)")
    g.add_argument("--input-shape", action="append", type=input_shape, default=[], metavar="NAME:DIMS",
                   help="--synthetic shape of input NAME, e.g. input_ids:1x128 or x:[1,3,224,224] "
                        "(repeatable; default: the model's, symbolic dimensions 1)")


def add_jobs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", "-j", type=_count, default=1,
                   help="calibration processes over sample ranges (default 1); 'auto' (or 0): one per core when "
                        "each gets at least 32 samples, else 1")
    p.add_argument("--streams", type=_count, default=0,
                   help="samples calibrated at once in each process, on threads sharing one session, each "
                        "on its share of the cores. Default 0 or 'auto': one per core when each gets at "
                        "least 4 samples, else 1 (on every core)")


def _at_least(text: str, lowest: int, expected: str) -> int:
    """An integer option no lower than `lowest`, or one argparse error naming `expected`."""
    try:
        value = int(text)
    except ValueError:
        value = lowest - 1
    if value < lowest:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _count(text: str) -> int:
    """`--jobs`, `--streams`: a count >= 0, or 'auto' (= 0)."""
    return 0 if text == "auto" else _at_least(text, 0, "a count >= 0 or 'auto'")


def _seed(text: str) -> int:
    """`--seed`: an integer >= 0 (numpy's generators refuse negative seeds)."""
    return _at_least(text, 0, "an integer >= 0")


def positive_int(text: str) -> int:
    """An option that is a count >= 1."""
    return _at_least(text, 1, "an integer >= 1")


def positive_float(text: str) -> float:
    """An option that is a finite number > 0 (a tolerance, a gain)."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """An option that is a finite number >= 0 (an absolute tolerance)."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def scale_rule(text: str) -> ScaleRule:
    """`--scale-rule`: one of ScaleRule's words, refused in argparse's own words for a choice."""
    try:
        return ScaleRule(text)
    except ValueError:
        words = ", ".join(repr(r.value) for r in ScaleRule)
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {words})") from None


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def check_rtol(value: float | None, flag: str) -> None:
    """A tolerance given from Python rather than the parser: finite and > 0."""
    from npuprep.errors import NpuprepError

    if value is not None and not (math.isfinite(value) and value > 0):
        raise NpuprepError(f"{flag} needs a finite number > 0, got {value!r}")


# Input arguments a command may take: what each is called in errors, and which files in a
# folder given there the command reads (output_files.OutputPlan.reads; "samples" and
# "workspace" name output_files.SAMPLE_FILES and WORKSPACE_FILES).
INPUT_ARGUMENTS: dict[str, tuple[str, str]] = {
    "data": ("the --data samples", "samples"),
    "holdout": ("the --holdout samples", "samples"),
    "stats": ("the --stats file", "any"),
    "plan": ("the --plan file", "any"),
    "report": ("the --report file", "any"),
    "workspace": ("the --workspace folder", "workspace"),
    "classify": ("the --classify kit", "any"),
    "outputs": ("the --outputs folder", "any"),
    "scales": ("the --scales report", "any"),
}


@dataclass
class Invocation:
    """What a command reads before any work: its target (resolved once, with `--precision`),
    its model, and the output plan that already knows every input path."""

    profile: Any  # npuprep.profiles.TargetProfile, or None for a command without --target
    target: Any  # npuprep.profiles.ResolvedTarget, or None
    model: Any  # npuprep.model_io.Model, or None without a model
    outputs: Any  # npuprep.output_files.OutputPlan


def begin(args: argparse.Namespace, *, inputs: Sequence[str] = (), model: bool = True,
          weights: str = "file", model_arg: str = "model",
          model_what: str = "the input model") -> Invocation:
    """The preamble every command shares: load the target (when the command has --target) and
    the model (argument `model_arg`), and declare the model, its external data, the profile
    file and `inputs` (names in INPUT_ARGUMENTS) as files no output may land on. The model's
    weights stay in its files (`weights="file"`, anchored: each stage reads one when it needs
    it and sessions map them), so no command holds a large model's weights twice."""
    from npuprep.model_io import anchored, load_model
    from npuprep.output_files import SAMPLE_FILES, WORKSPACE_FILES, OutputPlan
    from npuprep.profiles import load_profile

    patterns = {"samples": SAMPLE_FILES, "workspace": WORKSPACE_FILES, "any": ("*",)}
    profile = load_profile(args.target) if getattr(args, "target", None) else None
    target = profile.resolve(_float_precision(getattr(args, "precision", None))) \
        if profile is not None else None
    if target is not None and getattr(args, "precision", None) and target.fmt.name in profile.unsupported_dtypes:
        from npuprep.errors import NpuprepError

        raise NpuprepError(f"--precision {args.precision}: target '{profile.name}' lists {target.fmt.name} as "
                           "unsupported (dtypes.unsupported in its profile); choose another precision or target")
    loaded = load_model(getattr(args, model_arg), weights=weights) if model else None
    if loaded is not None and weights == "file":
        loaded = anchored(loaded)
    if loaded is not None:
        from npuprep.opsets import check_opset_supported

        # Before any work: a static check would otherwise pass a model no stage can read.
        check_opset_supported(loaded.proto, str(getattr(args, model_arg)))
    plan = OutputPlan()
    if model:
        plan.reads_model(getattr(args, model_arg), model_what)
    for name in inputs:
        what, files = INPUT_ARGUMENTS[name]
        plan.reads(getattr(args, name, None), what, patterns[files])
    plan.reads_profile(getattr(args, "target", None))
    return Invocation(profile, target, loaded, plan)


def _float_precision(precision: str | None) -> str | None:
    """The float format a run's findings and plan use: INT8 (QDQ, see npuprep.pipeline.quantise_and_verify)
    has no float range and plans its wider layers in FP16; FP8 keeps its own."""
    from npuprep.numerics import eight_bit_format

    eight = eight_bit_format(precision) if precision else None
    return "fp16" if eight is not None and not eight.is_float else precision


def into_folder(path: str | None, default_name: str) -> str | None:
    """`-o newdir/`: a trailing separator names a folder (made if missing); the file goes in
    it under the name it would have had by default."""
    if path and path.endswith(("/", os.sep)):
        return os.path.join(path, default_name)
    return path


def open_samples(args: argparse.Namespace, model: onnx.ModelProto) -> SampleSet | None:
    """The SampleSet chosen by --data/--synthetic, or None when neither was given."""
    from npuprep.data import load_samples

    if getattr(args, "data", None):
        from npuprep.errors import NpuprepError

        for flag in ("input_range", "input_shape"):
            if getattr(args, flag, None):
                # They shape synthetic samples; ignoring them would hide that from the user.
                raise NpuprepError(f"--{flag.replace('_', '-')} shapes --synthetic samples; with --data "
                                   "the samples are read as they are: drop it or use --synthetic")
        return load_samples(args.data, model, batched=args.batched)
    if getattr(args, "synthetic", None):
        return synthetic_from_args(args, model, args.synthetic)
    return None


def synthetic_from_args(args: argparse.Namespace, model: onnx.ModelProto, count: int) -> SampleSet:
    """`count` synthetic samples with the --input-range/--input-shape given on the command line."""
    from npuprep.data import synthetic_samples

    return synthetic_samples(model, count, getattr(args, "seed", 0),
                             ranges=dict(getattr(args, "input_range", None) or []),
                             shapes=dict(getattr(args, "input_shape", None) or []))


def input_range(text: str) -> tuple[str, tuple[float, float]]:
    """`NAME:LO:HI` (the name may hold colons: the last two fields are the numbers)."""
    import math

    parts = text.rsplit(":", 2)
    try:
        name, lo, hi = parts[0], float(parts[1]), float(parts[2])
    except (IndexError, ValueError):
        raise argparse.ArgumentTypeError(f"expected NAME:LO:HI with numbers LO < HI, got {text!r}") from None
    if not name or not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
        raise argparse.ArgumentTypeError(f"expected NAME:LO:HI with finite numbers LO <= HI, got {text!r}")
    return name, (lo, hi)


def input_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """`NAME:1x128`, `NAME:1,128` or `NAME:[1,128]` (Polygraphy's form)."""
    name, _, rest = text.rpartition(":")
    dims = rest.strip("[]() ").replace("x", ",").split(",")
    try:
        shape = tuple(int(d) for d in dims if d.strip())
    except ValueError:
        shape = ()
    if not name or not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"expected NAME:DIMS with positive dimensions, e.g. x:1x3x224x224, "
                                         f"got {text!r}")
    return name, shape



def print_json(obj: Any) -> None:
    sys.stdout.write(dump_json(obj))


OUTPUT = Output()


def add_output_options(p: argparse.ArgumentParser) -> None:
    """`--wide`, `--show-all`, `-q`, `-v`: how much of the terminal output to show (every command)."""
    g = p.add_argument_group("terminal output")
    g.add_argument("--wide", action="store_true",
                   help="no 100-column limit: whole names, sentences and numbers in every cell")
    g.add_argument("--show-all", action="store_true", help="every row (default: long lists are counted)")
    g.add_argument("-q", "--quiet", action="store_true", help="only the verdict lines, no tables")
    g.add_argument("-v", "--verbose", action="store_true", help="full reasons and every row (implies "
                                                                "--show-all)")


def configure_output(args: argparse.Namespace) -> Output:
    """Set the module's OUTPUT from the parsed options; commands read it through `out()`."""
    global OUTPUT
    verbose = bool(getattr(args, "verbose", False))
    OUTPUT = Output(width=None if getattr(args, "wide", False) else WIDTH,
                    quiet=bool(getattr(args, "quiet", False)), verbose=verbose,
                    show_all=verbose or bool(getattr(args, "show_all", False)))
    return OUTPUT


def out() -> Output:
    return OUTPUT


def say(text: str = "", *, always: bool = False) -> None:
    """A message line for people, wrapped to the width; with -q only `always` lines print."""
    if OUTPUT.quiet and not always:
        return
    print(wrap(shown(text), OUTPUT.width))


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]],
                cut_end: Sequence[str] = (), wrap: Sequence[str] = ()) -> None:
    """A plain aligned table within OUTPUT.width (names keep the part that differs, the
    `cut_end` columns are cut at the end, the `wrap` columns' sentences wrap), greppable when
    piped; nothing with -q."""
    if OUTPUT.quiet:
        return
    sys.stdout.write("\n".join(table_lines(title, columns, rows, OUTPUT.width, cut_end, wrap)) + "\n")


def fmt(v: Any) -> str:
    """A cell value: numbers in engineering form (`3.97e17`), anything else as text."""
    return cell(v)


def progress(items: Iterable[T], total: int, description: str, enabled: bool) -> Iterator[T]:
    """A progress bar on a terminal's stderr over `items`; silent when piped or when JSON is
    asked for."""
    with progress_counter(total, description, enabled) as set_done:
        for done, item in enumerate(items, 1):
            yield item
            set_done(done)


@contextmanager
def progress_stages(description: str, enabled: bool) -> Iterator[Callable[[str], None]]:
    """A spinner with the elapsed time on a terminal's stderr, for work without a count
    (convert's rounds, a probe's runs): the function this yields names the stage now running.
    Silent when piped or when JSON is asked for."""
    if not enabled or not sys.stderr.isatty():
        yield lambda stage: None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield lambda stage: bar.update(task, description=f"{description}: {stage}")


def parse_top_k(items: list[str]) -> dict[str, int]:
    """`OUTPUT:K` -> {output: K}, `OUTPUT:ctc` -> {output: CTC_TEXT}; output names may
    themselves contain ':'."""
    from npuprep.errors import NpuprepError
    from npuprep.verify.output_errors import CTC_TEXT

    top_k: dict[str, int] = {}
    for item in items:
        name, _, k = item.rpartition(":")
        if name and k == "ctc":
            top_k[name] = CTC_TEXT
            continue
        if not name or not k.isdigit() or int(k) < 1:
            raise NpuprepError(f"--top-k {item}: expected OUTPUT:K with K a whole number >= 1, "
                               "or OUTPUT:ctc")
        top_k[name] = int(k)
    return top_k


def parse_decisions(top_k: list[str], detect: list[str]) -> dict[str, Decision]:
    """--top-k and --detect together: {output: K, CTC_TEXT or Detection}; an output named by
    both is refused in one line."""
    from npuprep.detections import parse_detect
    from npuprep.errors import NpuprepError

    by_k, by_detection = parse_top_k(top_k), parse_detect(detect)
    both = sorted(set(by_k) & set(by_detection))
    if both:
        raise NpuprepError(f"output '{both[0]}' is named by --top-k and --detect; an output is "
                           "judged by one rule")
    return {**by_k, **by_detection}


def add_goal(p: argparse.ArgumentParser, default_metric: str | None = "auto") -> None:
    """--metric and --top-k: how the graph outputs are judged (convert's goal; compare's too)."""
    # The values of npuprep.verify.output_check.Metric (not imported: the CLI starts light).
    p.add_argument("--metric", choices=("auto", "rel-l2", "top1"), default=default_metric,
                   help=("how outputs are judged: " if default_metric else
                         "judge REF and CAND by their graph outputs, as convert does (internal "
                         "tensors become where to look), the record's rule replaced: ")
                        + "auto" + (" (default)" if default_metric == "auto" else "")
                        + " judges outputs a consumer decides "
                        "by argmax (Softmax, probabilities, peaked logits of a final Gemm/MatMul, "
                        "an ArgMax in the graph) by their top-1 decision and the rest by rel L2; "
                        "rel-l2 every output by rel L2; top1 every output with classes by top-1")
    p.add_argument("--top-k", action="append", default=[], metavar="OUTPUT:K",
                   help="judge OUTPUT by its top-K classes along the last axis, whatever --metric "
                        "says: it passes when they agree at every position where FP32 decides "
                        "(FP32 values within --rtol of each other are a tie; its rel L2 is still "
                        "reported); OUTPUT:ctc judges a CTC recogniser's steps x classes by their "
                        "greedy decoding (argmax per step, repeats merged, blank class 0 dropped), "
                        "text by text; repeatable")
    p.add_argument("--detect", action="append", default=[],
                   metavar="SCORES[=BOXES],...:THRESHOLD",
                   help="judge a detector by its detections: each SCORES output passes when every "
                        "(position, class) whose FP32 score is further than --rtol x max(1, "
                        "THRESHOLD) from THRESHOLD stays on its side of it (0.5 +- 0.05 for "
                        "probabilities in 8 bits: closer is a tie, counted apart); each BOXES "
                        "output (every axis but the last matching SCORES) by its rel L2 at the "
                        "positions FP32 detects in "
                        "SCORES, background left out; the SCORES of one --detect are one detector, "
                        "its detections counted together (none on the samples: rel L2 judges, and "
                        "the report says so); e.g. --detect 'cls8=reg8,cls16=reg16:0.5'; "
                        "THRESHOLD as sigmoid(P): SCORES are logits the post-processing reads "
                        "as probabilities, judged as those (BlazeFace: 'classificators="
                        "regressors:sigmoid(0.5)'); SCORES[K] or SCORES[K:] reads only those "
                        "classes of SCORES' last axis (a softmax's background left out: "
                        "'softmax[1]=boxes:0.6'); repeatable")
