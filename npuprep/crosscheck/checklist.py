"""First-week bring-up checklist for one model on one target, ticked from workspace artefacts.

Items: calibrate, confirm the precision list (no BF16 to the compiler), probe the board
(loud or silent overflow), crosscheck the compiler's report, compare board and emulation
layer by layer, measure speed, measure memory. An item is ticked only by evidence found
in the workspace (W/*.json by "kind", W/plan.yaml or the W/*.plan.yaml convert writes); an
open item says the command to run. The precision item tells the plan's story
(`plan/story.py`): per flagged node what the plan does, with convert's counts.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from npuprep import json_io
from npuprep.analyse.finding import Finding
from npuprep.crosscheck.check import VERDICTS
from npuprep.crosscheck.plan_view import EIGHT_BIT
from npuprep.crosscheck.readers import DEFAULT_REPORT_NAME, HOW_TO_GET
from npuprep.errors import NpuprepError
from npuprep.formatting import number, percent
from npuprep.formatting import ratio as ratio_text
from npuprep.graph import attribute, tensor_types, walk_graphs
from npuprep.held_out_bound import (
    RULED_OUT,
    resting_on_decisions,
    samples_to_rule_out,
    unseen_share,
)
from npuprep.model_io import Model
from npuprep.names import md_code, shown
from npuprep.numerics import Int8Activations, formats
from npuprep.plan.story import FATE_TEXT, FATES, Story
from npuprep.profiles import OverflowMode, ResolvedTarget, TargetProfile

SCHEMA_VERSION = 1
ARTEFACT_KINDS = ("stats", "probe", "crosscheck", "compare", "convert")
LOUD = ("inf", "nan")
SILENT = ("saturate", "other-finite")
WARMUP_STEPS = 50
TIMED_STEPS = 200


@dataclass(frozen=True)
class Item:
    """One checklist line: done (its artefact exists) or open, the evidence, what to run next.

    `failed` marks a done item whose artefact shows a failure; `steps` then say how to fix it.
    """

    key: str
    title: str
    done: bool
    evidence: tuple[str, ...] = ()
    steps: tuple[str, ...] = ()
    failed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "title": self.title, "done": self.done, "failed": self.failed,
                "evidence": list(self.evidence), "steps": list(self.steps)}


@dataclass(frozen=True)
class Checklist:
    """The whole checklist; truthy when every item is done and none failed."""

    model: str
    fingerprint: str
    target: str
    items: tuple[Item, ...]
    header: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    story: dict[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return all(i.done and not i.failed for i in self.items)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION, "kind": "checklist", "fingerprint": self.fingerprint,
            "model": self.model, "target": self.target,
            "done": sum(i.done for i in self.items), "failed": sum(i.failed for i in self.items),
            "total": len(self.items),
            "items": [i.to_dict() for i in self.items], "notes": list(self.notes),
            "story": dict(self.story),
        }


@dataclass(frozen=True)
class Workspace:
    """Artefacts found in a workspace folder, by kind (files in name order)."""

    path: str
    artefacts: dict[str, list[tuple[str, dict[str, Any]]]] = field(default_factory=dict)
    plan_path: str = ""
    notes: tuple[str, ...] = ()

    def latest(self, kind: str, fingerprint: str | frozenset[str] = "") -> tuple[str, dict[str, Any]] | None:
        """The last artefact of `kind` (by file name), preferring those of this model (one
        fingerprint, or a model's family: see `family`)."""
        found = self.artefacts.get(kind, [])
        wanted = {fingerprint} if isinstance(fingerprint, str) else set(fingerprint)
        matching = [a for a in found if a[1].get("fingerprint") in wanted] if fingerprint else []
        chosen = matching or found
        return chosen[-1] if chosen else None

    def family(self, model: Model) -> frozenset[str]:
        """The fingerprints of `model`, the model it was converted from (metadata) and its
        conversions (convert reports here): artefacts of any of them belong to its story."""
        from npuprep.provenance import find_source

        found = {model.fingerprint}
        source = find_source(model)
        if source is not None:
            found.add(source.fingerprint)
        for _, doc in self.artefacts.get("convert", []):
            pair = {doc.get("fingerprint"), doc.get("output_fingerprint")}
            if pair & found:
                found |= {f for f in pair if isinstance(f, str) and f}
        return frozenset(found)

    def conversion(self, model: Model) -> tuple[str, dict[str, Any]] | None:
        """The workspace's convert report made from `model`, or of which `model` is the output."""
        family = self.family(model)
        found = [a for a in self.artefacts.get("convert", [])
                 if a[1].get("fingerprint") in family or a[1].get("output_fingerprint") in family]
        return found[-1] if found else None


def scan_workspace(path: str | Path) -> Workspace:
    """Read W/*.json (by their "kind") and find the plan; unreadable files become notes."""
    folder = Path(path)
    if not folder.is_dir():
        raise NpuprepError(f"{folder}: workspace folder not found")
    artefacts: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    notes: list[str] = []
    for file in sorted(folder.glob("*.json")):
        if not file.is_file():  # a FIFO would block the read
            continue
        try:
            data = json_io.read_json(file, "JSON artefact")
        except NpuprepError as exc:
            notes.append(f"skipped, {exc}")
            continue
        if isinstance(data, dict) and data.get("kind") in ARTEFACT_KINDS:
            artefacts.setdefault(data["kind"], []).append((str(file), data))
    # The user's reviewed plan.yaml wins over the <model>.plan.yaml that convert writes.
    plans = [folder / "plan.yaml"] if (folder / "plan.yaml").is_file() else sorted(folder.glob("*.plan.yaml"))
    return Workspace(str(folder), artefacts, str(plans[-1]) if plans else "", tuple(notes))


def build_checklist(
    model: Model,
    profile: TargetProfile,
    *,
    model_arg: str,
    target_arg: str,
    stats: Any = None,
    stats_arg: str = "",
    workspace: Workspace | None = None,
    findings: Iterable[Finding] | None = None,
    top_n: int = 10,
    plan: Any = None,
    plan_arg: str = "",
) -> Checklist:
    """The checklist for `model` on `profile`; `*_arg` are the paths as the user typed them.

    `findings` (static and measured; None: found here) name the nodes the precision list must
    keep wide. The plan is `plan` (read from `plan_arg`), else the workspace's plan file, else
    the planner's own decision on these stats and findings (what `convert --plan-only` would
    write; npuprep.plan.decide): the precision item says per flagged node what that plan does,
    as check and convert do.
    """
    ws_arg = workspace.path if workspace else "W"
    notes = list(workspace.notes) if workspace else []
    if stats is None and workspace is not None:
        found = workspace.latest("stats", workspace.family(model))
        if found:
            stats, stats_arg = _load_stats(found[0], model, notes)
    # A conversion's own record holds the plan it applied: that one, no file needed.
    recorded = _recorded_plan(model) if plan is None else None
    if recorded is not None:
        plan, plan_arg = recorded, f"{model_arg} (its conversion record)"
    if plan is None and workspace is not None and workspace.plan_path:
        plan = _load_plan(workspace.plan_path, model, notes)
        plan_arg = workspace.plan_path if plan is not None else ""
    # The format the given plan was made for (a `--precision bf16` conversion's), else the default.
    target = profile.resolve(plan.precision if plan is not None and plan.precision in formats()
                             else None)
    ctx = _Context(model, target, model_arg, target_arg, ws_arg, stats_arg or f"{ws_arg}/stats.json",
                   plan_arg or f"{ws_arg}/plan.yaml", workspace)
    from npuprep.analyse.finding import Findings
    from npuprep.plan.decide import plan_for
    from npuprep.plan.story import plan_story

    # The graph convert plans: a written-out mean folded, no control flow where the target
    # takes none; a given plan was made on it too.
    planned = plan_for(model, target, stats, plan=plan,
                       findings=None if findings is None else Findings(tuple(findings)))
    stats, decision = planned.stats, planned.plan
    if planned.planned_here:
        notes += planned.notes
    story = plan_story(planned.model, profile, decision, list(planned.findings), stats)
    items = (
        _calibrate(ctx, stats),
        _precision_list(ctx, plan, decision, story, stats is not None),
        _probe(ctx),
        _crosscheck(ctx, plan is not None and recorded is None, stats is not None),
        _compare(ctx, stats, top_n, story.masks),
        _speed(ctx),
        _memory(ctx),
    )
    header = (
        f"Model `{model_arg}` (fingerprint `{model.fingerprint}`), target `{profile.name}`: "
        f"{target.fmt.name} by default, overflow `{profile.overflow}`, FP32 pinning "
        f"`{profile.fp32_pinning}`, compiler {profile.compiler_name or 'unknown'} "
        f"(report format `{profile.report_format}`).",
        f"Workspace: `{ws_arg}`." if workspace else
        "No workspace given: pass --workspace W to tick items from the artefacts in W.",
    )
    return Checklist(model_arg, model.fingerprint, profile.name, items, header, tuple(notes),
                     story.to_dict())


@dataclass(frozen=True)
class _Context:
    model: Model
    target: ResolvedTarget
    model_arg: str
    target_arg: str
    ws: str
    stats_arg: str
    plan_arg: str
    workspace: Workspace | None

    @property
    def profile(self) -> TargetProfile:
        return self.target.profile

    def artefact(self, kind: str, same_model: bool) -> tuple[str, dict[str, Any]] | None:
        """The workspace's artefact of `kind`; with `same_model`, only this model's."""
        if self.workspace is None:
            return None
        family = self.workspace.family(self.model)
        found = self.workspace.latest(kind, family)
        if found and same_model and found[1].get("fingerprint") not in family:
            return None
        return found


def _load_stats(path: str, model: Model, notes: list[str]) -> tuple[Any, str]:
    from npuprep.calibrate import load_stats

    try:
        return load_stats(path, model), path
    except NpuprepError as exc:
        notes.append(f"stats not used: {exc}")
        return None, ""


def _recorded_plan(model: Model) -> Any:
    """The plan a conversion records about itself (npuprep.provenance); None for other models."""
    from npuprep.plan import Plan
    from npuprep.provenance import RECORD_KEY, read_conversion

    record = read_conversion(model.proto)
    if record is None:
        return None
    return Plan.from_dict(record.plan, f"{model.path}: metadata {RECORD_KEY}: plan")


def _load_plan(path: str, model: Model, notes: list[str]) -> Any:
    from npuprep.plan import load_plan

    try:
        return load_plan(path, model)
    except NpuprepError as exc:
        notes.append(f"plan not used: {exc}")
        return None


def _calibrate(ctx: _Context, stats: Any) -> Item:
    title = "Calibrate on real samples (activation ranges of every tensor)"
    step = f"npuprep calibrate {ctx.model_arg} --data DATA -o {ctx.ws}/stats.json"
    if stats is None:
        return Item("calibrate", title, False, (), (step,))
    unobserved = len(getattr(stats, "unobserved", {}) or {})
    evidence = [f"{len(stats.tensors)} tensors observed in `{ctx.stats_arg}`"
                + (f", {unobserved} not observed" if unobserved else "")]
    return Item("calibrate", title, True, tuple(evidence))


def bf16_tensors(model: Model) -> list[str]:
    """Tensors (and Cast targets) of type BF16 anywhere in the model."""
    found = sorted(n for n, t in tensor_types(model.proto).items() if t == onnx.TensorProto.BFLOAT16)
    for scope in walk_graphs(model.graph):
        for node in scope.graph.node:
            if node.op_type == "Cast" and attribute(node, "to") == onnx.TensorProto.BFLOAT16:
                found += [o for o in node.output if o and o not in found]
    return found


def _precision_list(ctx: _Context, plan: Any, decision: Any, story: Story, measured: bool) -> Item:
    """BF16 in the model, then the plan's decision and, per flagged node, what it does there.

    `plan` is a plan file (reviewed or written by convert); without one, `decision` is the
    planner's own (the item stays open until a plan file exists).
    """
    p, fmt = ctx.target.profile, ctx.target.fmt
    title = f"Confirm the precision list ({fmt.name} by default, FP32 where pinned) " \
            "and that no BF16 reaches the compiler"
    evidence: list[str] = []
    steps: list[str] = []
    bf16 = bf16_tensors(ctx.model)
    verdict = "unsupported on this target" if "bf16" in p.unsupported_dtypes else "not a fast path here"
    if bf16:
        shown = ", ".join(f"`{t}`" for t in bf16[:8]) + (" ..." if len(bf16) > 8 else "")
        evidence.append(f"BF16 found in the model ({len(bf16)} tensors: {shown}); BF16 is {verdict}")
        steps.append(f"npuprep convert {ctx.model_arg} --target {ctx.target_arg} --stats {ctx.stats_arg} "
                     f"-o {ctx.ws}/model_{fmt.name}.onnx")
    else:
        evidence.append("no BF16 tensor or Cast to BF16 in the model")
    basis = "measured ranges" if measured else "static rules only: calibrate for measured ranges"
    source = (f"plan `{ctx.plan_arg}`" if plan is not None else
              f"the planner's decision ({basis}; what convert --plan-only writes)")
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(story.actions.items()))
    pinned = list(story.pinned)
    shown = ", ".join(f"`{n}`" for n in pinned[:8]) + (" ..." if len(pinned) > 8 else "")
    evidence.append(f"{source}: {sum(story.actions.values())} actions" + (f" ({kinds})" if kinds else "")
                    + f", {len(pinned)} nodes pinned to FP32" + (f" ({shown})" if pinned else "")
                    + f", {story.declined} remedies declined, the rest in {decision.precision}")
    flagged = [s for s in story.nodes if s.rules]
    if flagged:
        counts = ", ".join(f"{n} {fate}" for fate, n in _counts(flagged).items())
        evidence.append(f"{len(flagged)} nodes flagged by small-op rules or measured ranges; "
                        f"what the plan does: {counts}")
    for fate, members in _by_fate(story).items():
        groups = _groups(members)
        listed = "; ".join(groups[:_SHOWN])
        more = f"; ... {len(groups) - _SHOWN} more" if len(groups) > _SHOWN else ""
        evidence.append(f"{fate} ({len(members)} nodes, {FATE_TEXT[fate]}): {listed}{more}")
    converted = ctx.workspace.conversion(ctx.model) if ctx.workspace is not None else None
    if converted is not None:
        from npuprep.report.pin_count import pins_said

        path, doc = converted
        evidence.append(f"converted: `{path}` ({doc.get('model')} -> {doc.get('output')}, "
                        f"{'passed' if doc.get('passed') else 'FAILED'}; {pins_said(doc)})")
    if plan is None and converted is None:
        steps.append(f"npuprep convert {ctx.model_arg} --target {ctx.target_arg} --stats {ctx.stats_arg} "
                     f"--plan-only -o {ctx.ws}/plan.yaml")
        steps.append(f"review {ctx.ws}/plan.yaml, then npuprep convert ... --plan {ctx.ws}/plan.yaml "
                     "writes the model and the compiler's precision constraint files")
    eight = _eight_bit(ctx, decision, converted)
    if eight is not None:
        evidence.append(eight[0])
        steps += eight[1]
    done = (plan is not None or converted is not None) and not bf16
    return Item("precision", title, done, tuple(evidence), tuple(steps))


def _eight_bit(ctx: _Context, decision: Any, converted: tuple[str, dict[str, Any]] | None,
               ) -> tuple[str, list[str]] | None:
    """For an 8-bit conversion (the plan's precision, or the workspace's convert report):
    what it decided, and the steps that carry its artefacts (dataset, QDQ model, scales) to
    the compiler; None otherwise."""
    doc = converted[1] if converted is not None else {}
    eight = doc.get("eight_bit") or {}
    fmt = eight.get("format") or (decision.precision if decision.precision in EIGHT_BIT else "")
    if not fmt:
        return None
    layers = getattr(decision, "eight_bit", ())
    wider = [x.node for x in layers if x.precision != fmt]
    share = eight.get("mac_share", {}).get(fmt)
    said = (f"8-bit ({fmt}"
            + (f", scales {eight['scale_rule']}" if eight.get("scale_rule") else "") + ")"
            + (f": {share:.0%} of the Conv/MatMul/Gemm multiply-adds in {fmt}"
               if share is not None else "")
            + f"; {len(wider)} nodes kept wider (the plan's eight_bit list)")
    model = (doc.get("artefacts") or {}).get("model") or doc.get("output") or \
        f"{ctx.ws}/model_{fmt}.onnx"
    steps = [] if converted is not None else [
        f"npuprep convert {ctx.model_arg} --target {ctx.target_arg} --precision {fmt} --data DATA "
        f"-o {ctx.ws}/model_{fmt}.onnx" + (f" --verify-with {ctx.profile.report_format}"
                                          if ctx.profile.report_format in ("rknn", "openvino")
                                          else "")]
    steps += [
        f"the QDQ model `{model}` carries the scales (QuantizeLinear/DequantizeLinear at the "
        f"{fmt} layers): give the compiler that file (a pre-quantised model), not the FP32 one",
        "the calibration dataset is the --data samples: a compiler that calibrates itself "
        "(rknn-toolkit2's dataset.txt, trtexec --calib) takes the same samples",
        f"the layers kept wider ({', '.join(f'`{n}`' for n in wider[:5])}"
        f"{' ...' if len(wider) > 5 else ''}) must stay FP16 in the compiler (rknn-toolkit2: "
        "hybrid quantisation; TensorRT: layer precision); crosscheck its report with --plan"
        if wider else f"every flagged node is in the plan's {fmt} decision; crosscheck the "
        "compiler's report with --plan to see it did the same",
    ]
    if eight.get("searched") is False:
        held = (doc.get("holdout") or {}).get("outputs") or {}
        worst = max((o.get("rel_l2", 0.0) for o in held.values()), default=None)
        wider = len(eight.get("kept_wider") or ())
        steps.append(
            "the conversion kept its plain start (every layer at the default scale rule, weights "
            "rounded to nearest, nothing balanced or searched"
            + (f"; {wider} layer(s) kept wider by its own ranking" if wider else "")
            + ": it erred under half the gate"
            + (f"; held out, rel L2 {worst:.3g}" if worst is not None else "") + "): where the "
            "board's outputs on real inputs come near the gate, convert again with "
            "`--search always` for more margin")
    offset = (eight.get("zero_points") or {}).get("uint8_with_zero_point", 0)
    if offset and ctx.profile.int8_activations is Int8Activations.UNKNOWN:
        steps.append(
            f"{offset} activations are uint8 with a zero point and `{ctx.profile.name}` does "
            "not say whether its compiler takes one: ask the vendor (TensorRT does not); if "
            "not, set `int8_activations: symmetric` in a copy of the profile and convert again")
    return said, steps


_SHOWN = 6


def _groups(members: list[Any]) -> list[str]:
    """Nodes that one finding (or one island) decides share an entry: a pattern's members."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for s in members:
        grouped.setdefault((s.because or s.node, s.detail), []).append(s.node)
    return [f"`{nodes[0]}`" + (f" +{len(nodes) - 1} nodes" if len(nodes) > 1 else "")
            + (f" ({detail})" if detail else "") for (_, detail), nodes in grouped.items()]


def _counts(stories: list[Any]) -> dict[str, int]:
    return {f: n for f in FATES if (n := sum(s.fate == f for s in stories))}


def _by_fate(story: Story) -> dict[str, list[Any]]:
    grouped: dict[str, list[Any]] = {}
    for s in story.nodes:
        grouped.setdefault(s.fate, []).append(s)
    return {f: grouped[f] for f in FATES if f in grouped}


def _probe(ctx: _Context) -> Item:
    title = "Run the probe kit on the board and record whether overflow is loud or silent"
    kit = f"{ctx.ws}/probe_kit"
    steps = (
        f"npuprep probe {ctx.model_arg} --target {ctx.target_arg} --export-kit {kit}",
        f"run the kit on the board as {kit}/README.md says; save the outputs in {ctx.ws}/probe_outputs",
        f"npuprep probe --classify {kit} --outputs {ctx.ws}/probe_outputs --target {ctx.target_arg} "
        f"--json > {ctx.ws}/probe.json",
    )
    if ctx.profile.report_format == "openvino":
        # OpenVINO's CPU plugin is the target itself: its real FP16 kernels answer here.
        steps = (f"npuprep probe --target {ctx.target_arg} --backend openvino --precision fp16 "
                 f"--json > {ctx.ws}/probe.json",)
    found = ctx.artefact("probe", same_model=False)
    if found is None:
        why = (f"the profile does not know how `{ctx.profile.name}` overflows: only the board can tell"
               if ctx.profile.overflow is OverflowMode.UNKNOWN else
               f"the profile says overflow `{ctx.profile.overflow}`; confirm it on the board")
        return Item("probe", title, False, (why,), steps)
    path, doc = found
    overall = doc.get("overall") or {}
    verdict = str(overall.get("verdict", "")) if isinstance(overall, dict) else str(overall)
    backend = str(doc.get("backend", ""))
    loudness = ("loud" if verdict in LOUD else "silent" if verdict in SILENT
                else "inconclusive" if verdict == "no-overflow" else "mixed across units"
                if verdict == "mixed" else "unknown")
    evidence = [f"`{path}`: overall `{verdict}` ({loudness}) on {backend or 'an unnamed backend'}"
                + (f": {overall['reason']}" if isinstance(overall, dict) and overall.get("reason") else "")]
    on_board = backend.startswith("board") or (ctx.profile.report_format == "openvino"
                                               and backend.startswith("openvino"))
    if not on_board:
        evidence.append("this probe ran on the host, not on the board: it shows the profile, "
                        "not the hardware")
    elif verdict and verdict != str(ctx.profile.overflow) and verdict in LOUD + SILENT:
        evidence.append(f"the profile says overflow `{ctx.profile.overflow}`; the board measured "
                        f"`{verdict}`: update it with --write-profile")
    conclusive = on_board and verdict not in ("", "no-overflow")
    return Item("probe", title, conclusive, tuple(evidence), () if conclusive else steps)


def _crosscheck(ctx: _Context, have_plan: bool, have_stats: bool) -> Item:
    fmt = ctx.profile.report_format
    title = f"Crosscheck the compiler's per-layer precision report ({fmt}) against the findings"
    report = f"{ctx.ws}/{DEFAULT_REPORT_NAME[fmt]}"
    converted = ctx.workspace.conversion(ctx.model) if ctx.workspace is not None else None
    if converted is not None:
        # Only the conversion carries the rescales and shifts that keep it in range: the
        # compiler gets it, and crosscheck reads its record (its plan decides, no --plan).
        model = converted_model(converted[1]) or ctx.model_arg
        stats = f" --stats {ctx.stats_arg}" if have_stats else ""
        steps = (
            compiler_step(fmt, model, report, converted[1]),
            f"npuprep crosscheck {model} --report {report} --target {ctx.target_arg} "
            f"--report-format {fmt}{stats} --json > {ctx.ws}/crosscheck.json",
        )
    else:
        source = (f" --plan {ctx.plan_arg}" if have_plan
                  else f" --stats {ctx.stats_arg}" if have_stats else "")
        steps = (
            HOW_TO_GET[fmt].format(model=ctx.model_arg, report=report),
            f"npuprep crosscheck {ctx.model_arg} --report {report} --target {ctx.target_arg} "
            f"--report-format {fmt}{source} --json > {ctx.ws}/crosscheck.json",
        )
    found = ctx.artefact("crosscheck", same_model=True)
    if found is None:
        return Item("crosscheck", title, False, (), steps)
    path, doc = found
    counts = doc.get("counts", {}) or {}
    shown = ", ".join(f"{k} {counts[k]}" for k in VERDICTS if counts.get(k))
    passed = bool(doc.get("passed"))
    evidence = [f"`{path}`: {'passed' if passed else 'FAILED'} ({shown or 'no verdicts'})"]
    failing = [v for v in doc.get("verdicts", []) if v.get("verdict") in ("mismatch", "pin-ignored")]
    for v in failing[:8]:
        evidence.append(f"{v.get('verdict')}: `{v.get('node')}` runs in {v.get('runs_in')}, "
                        f"needs {v.get('needs')}")
    fix = () if passed else (
        f"pin the failing nodes (edit {ctx.plan_arg}), rebuild with the constraint file, "
        "and rerun the crosscheck",)
    return Item("crosscheck", title, True, tuple(evidence), fix, failed=not passed)


def converted_model(convert_doc: dict[str, Any]) -> str:
    """The converted model a convert report names ("" when it names none)."""
    artefacts = convert_doc.get("artefacts") or {}
    return str(artefacts.get("model") or convert_doc.get("output") or "")


def compiler_step(fmt: str, model: str, report: str, convert_doc: dict[str, Any]) -> str:
    """How to get the compiler's report for the converted `model`: for TensorRT, the trtexec
    line convert wrote (its precision constraints) on that model, exporting the layer info."""
    trtexec = (convert_doc.get("artefacts") or {}).get("trtexec")
    line = _first_command(trtexec) if fmt == "trt_json" and trtexec else ""
    if not line:
        return HOW_TO_GET[fmt].format(model=model, report=report)
    # The file names the model beside it; the step runs from where convert was run.
    words = [f"--onnx={model}" if w.startswith("--onnx=") else w for w in shlex.split(line)]
    return shlex.join([*words, "--profilingVerbosity=detailed", f"--exportLayerInfo={report}"])


def _first_command(path: str) -> str:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return ""
    return next((x.strip() for x in lines if x.startswith("trtexec ")), "")


def riskiest_tensors(stats: Any, target: ResolvedTarget, top_n: int,
                     masks: Iterable[str] = ()) -> list[tuple[str, str, float, float]]:
    """(tensor, producer, absmax, absmax / format max), largest first; non-finite first of all.

    `masks` (tensors holding an intentional -inf mask) are left out: they are no risk.
    """
    rows = []
    fmt_max = target.fmt.max
    skip = set(masks)
    for name, r in stats.tensors.items():
        if name in skip:
            continue
        absmax = float(r.absmax)
        key = math.inf if not math.isfinite(absmax) else absmax
        rows.append((key, name, str(getattr(r, "node", "")), absmax))
    rows.sort(key=lambda row: (-row[0], row[1]))
    return [(name, node, absmax, absmax / fmt_max) for _, name, node, absmax in rows[:top_n]]


def _compare(ctx: _Context, stats: Any, top_n: int, masks: tuple[str, ...] = ()) -> Item:
    p, fmt = ctx.target.profile, ctx.target.fmt
    title = "Compare board and emulation on a fixed batch, layer by layer"
    evidence: list[str] = []
    steps: list[str] = []
    if masks:
        evidence.append(f"{len(masks)} tensors hold an intentional -inf mask (first `{masks[0]}`): "
                        "one warning (range.mask), no risk; check on the board that the mask "
                        f"value -max ({-fmt.max:g}) survives the compiler")
    if stats is not None:
        risky = riskiest_tensors(stats, ctx.target, top_n, masks)
        limit = ctx.target.limit
        listed = "; ".join(
            (f"`{t}` ({node or 'input'}): absmax {number(absmax)} = {_share(ratio)} {fmt.name} max"
             + (" OVER the safe limit" if absmax > limit else "") if math.isfinite(absmax)
             else f"`{t}` ({node or 'input'}): non-finite values ({number(absmax)})")
            for t, node, absmax, ratio in risky)
        evidence.append(f"riskiest tensors by abs-max vs {fmt.name} max {fmt.max:g} "
                        f"(safe limit {limit:g} at headroom {p.headroom:g}): {listed}")
        dump = ", ".join(t for t, *_ in risky)
        steps.append(f"on the board, dump these tensors for the fixed batch: {dump}")
    else:
        steps.append(f"npuprep calibrate {ctx.model_arg} --data DATA -o {ctx.ws}/stats.json")
        steps.append("the statistics name the riskiest tensors to dump on the board")
    converted = ctx.workspace.conversion(ctx.model) if ctx.workspace is not None else None
    model = converted_model(converted[1]) if converted is not None else ""
    # A conversion is compared with its source on held-out samples, by convert's own gate.
    steps.append(f"npuprep compare {ctx.model_arg} {model} --target {ctx.target_arg} --data HELDOUT "
                 f"--json > {ctx.ws}/compare.json" if model and model != ctx.model_arg else
                 f"npuprep compare {ctx.model_arg} --emulate --target {ctx.target_arg} --data DATA "
                 f"--json > {ctx.ws}/compare.json")
    steps.append("run the same fixed batch on the board, dump the tensors named above and check them "
                 "against the emulation's values (max abs error and headroom, not cosine alone)")
    if converted is not None:
        steps += _decisions_on_the_board(converted[1]) + _decisions_on_a_second_draw(converted[1])
    found = ctx.artefact("compare", same_model=False)
    if found is None:
        return Item("compare", title, False, tuple(evidence), tuple(steps))
    path, doc = found
    passed = bool(doc.get("passed"))
    first = doc.get("first_divergent")
    if isinstance(first, dict):
        where = f"first divergent node `{first.get('node') or first.get('tensor')}`"
        numbers = [f"{k.replace('_', ' ')} {first[k]:.4g}" if isinstance(first.get(k), float)
                   else f"{k.replace('_', ' ')} {first[k]}"
                   for k in ("max_abs_error", "rel_l2", "headroom") if first.get(k) is not None]
        if first.get("tensor"):
            where += f" (tensor `{first['tensor']}`" + (": " + ", ".join(numbers) if numbers else "") + ")"
    else:
        where = f"first divergent node `{first}`" if first else "no divergent node"
    evidence.insert(0, f"`{path}`: {'passed' if passed else 'FAILED'}, {where}")
    if passed:
        return Item("compare", title, True, tuple(evidence))
    fix = (f"start at the first divergent node: rescale, clamp or pin it in {ctx.plan_arg}, "
           "convert again and rerun the compare",) if first else tuple(steps)
    return Item("compare", title, True, tuple(evidence), fix, failed=True)


def _decisions_on_the_board(convert_doc: dict[str, Any]) -> list[str]:
    """A step where the conversion's held-out check passed outputs by their decisions alone on
    too few samples to rule out RULED_OUT of them changing (npuprep.held_out_bound)."""
    held = convert_doc.get("holdout")
    if not isinstance(held, dict) or not isinstance(held.get("outputs"), dict) \
            or not isinstance(held.get("rtol"), int | float):
        return []  # no held-out check recorded, or not as convert writes one
    samples = held.get("samples", 0)
    resting = resting_on_decisions(samples, held["rtol"], held["outputs"])
    if not resting:
        return []
    need = samples_to_rule_out(RULED_OUT)
    return [f"{', '.join(f'`{n}`' for n in resting)} passed held out by decisions alone on "
            f"{samples} samples, which rule out a share of changed samples above "
            f"{percent(unseen_share(samples))} only: run {need} fresh samples on the board and count "
            f"those whose decisions (text, class, detections) differ from FP32; none of {need} "
            f"rules out {percent(RULED_OUT)}"]


def _decisions_on_a_second_draw(convert_doc: dict[str, Any]) -> list[str]:
    """A step where the written 8-bit model as onnxruntime runs it (eight_bit.as_written:
    another draw of the rounding, npuprep.verify.second_draw) changed decisions that convert's
    verified run held, on the same samples."""
    drawn = (convert_doc.get("eight_bit") or {}).get("as_written")
    if not isinstance(drawn, dict):
        return []  # not an 8-bit conversion, or one from before the second draw
    said = []
    for which, verified_key, drawn_key in (("calibration", "verification", "calibration"),
                                           ("held-out", "holdout", "holdout")):
        verified = ((convert_doc.get(verified_key) or {}).get("outputs") or {})
        second = ((drawn.get(drawn_key) or {}).get("outputs") or {})
        for name, row in second.items():
            first = verified.get(name)
            if not isinstance(row, dict) or not isinstance(first, dict) or "top_k" not in row:
                continue
            held, changed = first.get("top_k_agreement"), row.get("top_k_agreement")
            positions = row.get("top_k_positions")
            if isinstance(held, int | float) and isinstance(changed, int | float) and \
                    isinstance(positions, int) and held >= 1.0 > changed:
                said.append(f"`{name}` {round((1 - changed) * positions)} of {positions} on the "
                            f"{which} samples")
    if not said:
        return []
    need = samples_to_rule_out(RULED_OUT)
    return [f"the written model as onnxruntime runs it (another draw of the 8-bit rounding than "
            f"convert's verified FP16 run) changed decisions the verified run held: "
            f"{'; '.join(said)}. The board's kernels draw again: on the board, count the fresh "
            f"samples whose decisions differ from FP32 before trusting it; none of {need} rules "
            f"out {percent(RULED_OUT)}"]


def _speed(ctx: _Context) -> Item:
    title = (f"Measure speed after warm-up: median of {TIMED_STEPS} steps after {WARMUP_STEPS}, "
             "in a steady thermal state")
    steps = [f"fix clocks and power mode, run {WARMUP_STEPS} warm-up steps, then time {TIMED_STEPS} "
             "single steps and report the median (not the mean) with min and max; repeat once the "
             "temperature is steady and check the medians agree"]
    if ctx.profile.report_format == "trt_json":
        steps.append("on Jetson: `sudo nvpmodel -m 0 && sudo jetson_clocks`, watch `tegrastats` for "
                     f"steady temperatures; `trtexec --loadEngine=model.engine --iterations={TIMED_STEPS} "
                     "--useSpinWait` reports the median")
    return Item("speed", title, False, (), tuple(steps))


def _memory(ctx: _Context) -> Item:
    title = "Measure memory by peak allocation"
    steps = ["record the runtime's peak device allocation over a full step (weights, activations, "
             "workspace), not the resident size at idle; compare it with the board's budget"]
    if ctx.profile.report_format == "trt_json":
        steps.append("with TensorRT: `trtexec --loadEngine=model.engine --verbose` prints the engine's "
                     "device memory; `tegrastats` shows the peak during the timed run")
    return Item("memory", title, False, (), tuple(steps))


def to_markdown(checklist: Checklist) -> str:
    lines = [f"# First-week bring-up checklist: {md_code(checklist.model)} on {md_code(checklist.target)}", ""]
    lines += [*checklist.header, ""]
    done = sum(i.done for i in checklist.items)
    failed = sum(i.failed for i in checklist.items)
    lines += [f"{done} of {len(checklist.items)} items done" + (f", {failed} failed" if failed else "")
              + ".", ""]
    for n, item in enumerate(checklist.items, 1):
        lines.append(f"- [{'x' if item.done else ' '}] **{n}. {item.title}**"
                     + (" (FAILED)" if item.failed else ""))
        lines += [f"  - {e}" for e in item.evidence]
        label = "fix" if item.failed else "next"
        lines += [f"  - {label}: `{s}`" if _is_command(s) else f"  - {label}: {s}" for s in item.steps]
    if checklist.notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in checklist.notes]
    # Names inside the lines (tensors, paths) cannot start a line of their own.
    return "\n".join(shown(line) for line in lines) + "\n"


def _is_command(step: str) -> bool:
    return step.startswith(("npuprep ", "trtexec ", "hb_mapper ", "rknn."))


def _share(ratio: float) -> str:
    """abs-max against the format's max: a percentage up to 10x, a factor beyond."""
    if not math.isfinite(ratio) or ratio >= 10:
        return ratio_text(ratio)
    return f"{ratio:.1%} of"
