"""Graph outputs of a lowered model, emulated on the target, against the FP32 reference.

    lowered.onnx -> widen (explicit rounding where it stores the low format) -> run beside FP32
    -> per output: Inf/NaN, max abs error, rel L2, top-K decisions (OutputCheck, truthy on a pass)

Which rule judges each output is the user's goal (`judged_outputs`): an output whose consumer
decides by argmax (class scores, CTC probabilities or logits) is judged by its top-1 decision
(a CTC recogniser's by the text it decodes to) unless the user says otherwise (`--metric
rel-l2`, `--top-k`), since the rel L2 of scores nobody reads is error nobody sees; every other
output by its rel L2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import onnx

from npuprep.data import Feed
from npuprep.detections import Decision, Detection
from npuprep.errors import NpuprepError
from npuprep.numerics import COMPUTE_FLOAT_TYPES, NumberFormat
from npuprep.ops import VIEW_OPS
from npuprep.verify.compare import folds_weight_casts
from npuprep.verify.output_errors import CTC_BLANK, CTC_TEXT, ctc_sequences, output_passes


@dataclass(frozen=True)
class OutputCheck:
    """Graph outputs of the lowered model, emulated on the target, against the FP32 reference.

    Truthy when no output holds Inf/NaN and every relative L2 error is within `rtol` (or,
    for an output judged by its top-K classes, every decision is the same).
    """

    rtol: float
    samples: int
    outputs: dict[str, dict[str, Any]]
    # Samples whose emulated outputs the compare pass gave (the same numbers, not run again).
    from_compare: int = 0

    def __bool__(self) -> bool:
        return all(output_passes(o, self.rtol) for o in self.outputs.values())

    @property
    def worst_rel_l2(self) -> float:
        """The largest rel L2 error of the outputs (0 with none)."""
        return float(max((o.get("rel_l2", 0.0) for o in self.outputs.values()), default=0.0))

    def to_dict(self) -> dict[str, Any]:
        # The outputs that failed are stored so a report renders them without the gate's rule.
        return {"passed": bool(self), "rtol": self.rtol, "samples": self.samples,
                "failed": sorted(k for k, o in self.outputs.items() if not output_passes(o, self.rtol)),
                "samples_emulated_in_compare": self.from_compare,
                "outputs": {k: dict(v) for k, v in sorted(self.outputs.items())}}


class Metric(StrEnum):
    """How outputs are judged (`--metric`): `auto` finds the argmax-decided outputs and judges
    them by top-1, the rest by rel L2; `rel-l2` every output by rel L2; `top1` every output
    with classes along its last axis by top-1. `--top-k OUTPUT:K` names one output's K first."""

    AUTO = "auto"
    REL_L2 = "rel-l2"
    TOP1 = "top1"


# A final affine output is logits (not a regression or an embedding) when it has at least this
# many classes and its softmax puts at least PEAKED on one class at most positions: a trained
# classifier is sure of most of its inputs, a box, a score or an embedding has no such peak.
MIN_LOGIT_CLASSES = 10
PEAKED = 0.5
MOST_POSITIONS = 0.5
# Samples run through the FP32 model to read the outputs' values (the first ones given).
GOAL_SAMPLES = 2
# A decided output reads as a CTC recogniser's (batch x steps x classes, decoded to text: the
# rule of `--top-k OUTPUT:ctc`) when it has at least MIN_CTC_STEPS steps and MIN_LOGIT_CLASSES
# classes, the blank (class 0) leads at least CTC_BLANK_SHARE of its steps (the gaps between a
# line's characters: PP-OCR's recognisers 35-39% on rendered lines) and the model reads no
# integer input (a token classifier, whose "O" class may lead as often, reads token ids).
MIN_CTC_STEPS = 8
CTC_BLANK_SHARE = 0.2


def judged_outputs(model: onnx.ModelProto, samples: Sequence[Feed], metric: Metric | str,
                   top_k: Mapping[str, Decision], *,
                   source: str | None = None) -> tuple[dict[str, Decision], dict[str, str]]:
    """The gate's `top_k` {output: K or Detection} and, per float output, the rule that
    judges it in words (`top-1 (auto: Softmax over its last axis)`, `rel L2`, `top-3
    (--top-k)`, `detections at > 0.5 (--detect)`). `samples`: a few feeds whose FP32
    outputs tell probabilities and logits apart from other values.
    `source`: the user's file `model` is (onnxruntime's refusal to run it is the input's)."""
    metric = Metric(metric)
    floats = [o.name for o in model.graph.output if o.type.tensor_type.elem_type in COMPUTE_FLOAT_TYPES]
    values = _outputs(model, list(samples[:GOAL_SAMPLES]), source=source) \
        if metric is not Metric.REL_L2 and floats and samples else []
    found = decided_outputs(model, values) if metric is Metric.AUTO else {}
    chosen: dict[str, Decision] = {}
    judged: dict[str, str] = {}
    for name in floats:
        classes = min((np.asarray(v[name]).shape[-1] for v in values if np.asarray(v[name]).ndim),
                      default=_declared_classes(model, name))
        rule = top_k.get(name)
        if isinstance(rule, Detection):
            chosen[name], judged[name] = rule, f"{rule.said()} (--detect)"
        elif rule is not None:
            chosen[name], judged[name] = rule, (
                f"{'CTC text' if rule == CTC_TEXT else f'top-{rule}'} (--top-k)")
        elif name in found and classes != 1:  # one class decides nothing (0: not known)
            blank = ctc_blank_share(model, [np.asarray(v[name]) for v in values if name in v])
            if blank is None:
                chosen[name], judged[name] = 1, f"top-1 (auto: {found[name]})"
            else:
                # The user reads the text, not each step's class: a step's flip between the blank
                # and a repeat of its neighbour changes nothing they see.
                chosen[name], judged[name] = CTC_TEXT, (
                    f"CTC text (auto: {found[name]}, blank 0 leads {100 * blank:.0f}% of steps)")
        elif metric is Metric.TOP1 and classes >= 2:
            chosen[name], judged[name] = 1, "top-1 (--metric top1)"
        else:
            judged[name] = "rel L2" + (" (--metric rel-l2)" if metric is Metric.REL_L2 else "")
    if metric is Metric.TOP1 and not chosen:
        raise NpuprepError("--metric top1: no output of the model has classes along its last axis "
                           f"(outputs: {', '.join(floats)}); use --metric rel-l2")
    return chosen, judged


def decided_outputs(model: onnx.ModelProto,
                    values: Sequence[Mapping[str, np.ndarray]] = ()) -> dict[str, str]:
    """Graph outputs a consumer decides by argmax, each with why: the output of a Softmax or
    LogSoftmax over its last axis; an output the graph itself feeds to ArgMax or TopK; values
    that are probabilities along the last axis (a softmax written out); or the logits of a
    final Gemm/MatMul (+ bias) with >= MIN_LOGIT_CLASSES classes whose softmax is peaked on
    `values` (the FP32 outputs on a few samples). View ops (Reshape, Identity...) between are
    looked through."""
    graph = model.graph
    made = {o: n for n in graph.node for o in n.output}
    read: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            read.setdefault(i, []).append(n)
    consts = {t.name for t in graph.initializer} | {o for n in graph.node if n.op_type == "Constant"
                                                    for o in n.output}
    # Before opset 13 a Softmax's axis defaults to 1 (and flattens the axes after it).
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    found: dict[str, str] = {}
    for out in graph.output:
        name = out.name
        node = made.get(name)
        while node is not None and node.op_type in VIEW_OPS and node.input:
            node = made.get(node.input[0])
        arrays = [np.asarray(v[name], np.float64) for v in values if name in v]
        rank = arrays[0].ndim if arrays else len(out.type.tensor_type.shape.dim)
        if node is not None and node.op_type in ("Softmax", "LogSoftmax") and \
                _attr(node, "axis", -1 if opset >= 13 else 1) in (-1, rank - 1):
            found[name] = f"{node.op_type} over its last axis"
        elif any(r.op_type in ("ArgMax", "TopK") for r in read.get(name, ())):
            found[name] = "the graph takes its argmax"
        elif arrays and all(a.ndim >= 1 and a.shape[-1] >= 2 for a in arrays) and all(
                a.min() >= 0 and np.allclose(a.sum(-1), 1, atol=1e-3) for a in arrays):
            found[name] = "probabilities along its last axis"
        elif node is not None and _affine(node, made, consts) and arrays and all(
                a.ndim >= 1 and a.shape[-1] >= MIN_LOGIT_CLASSES for a in arrays) and \
                _peaked_share(arrays) >= MOST_POSITIONS:
            found[name] = f"logits of a final {_affine(node, made, consts)}, peaked softmax"
    return found


def ctc_blank_share(model: onnx.ModelProto, arrays: Sequence[np.ndarray]) -> float | None:
    """The share of steps class 0 leads where a decided output of `model` with these FP32
    values reads as a CTC recogniser's (see MIN_CTC_STEPS; steps first where torch's layout
    puts them: npuprep.verify.output_errors.ctc_sequences), else None."""
    arrays = [ctc_sequences(a) for a in arrays]
    if not arrays or any(a.ndim != 3 or a.shape[-2] < MIN_CTC_STEPS or a.shape[-1] < MIN_LOGIT_CLASSES
                         for a in arrays):
        return None
    weights = {t.name for t in model.graph.initializer}  # listed as inputs before IR 4
    if any(i.type.tensor_type.elem_type not in COMPUTE_FLOAT_TYPES for i in model.graph.input
           if i.name not in weights):
        return None
    blank = float(np.mean(np.concatenate([a.argmax(-1).ravel() == CTC_BLANK for a in arrays])))
    return blank if blank >= CTC_BLANK_SHARE else None


def _affine(node: onnx.NodeProto, made: Mapping[str, onnx.NodeProto], consts: set[str]) -> str:
    """`Gemm` or `MatMul` when `node` is one, or a bias Add after one; else ""."""
    if node.op_type in ("Gemm", "MatMul"):
        return node.op_type
    if node.op_type == "Add" and len(node.input) == 2:
        for a, b in (node.input, node.input[::-1]):
            inner = made.get(a)
            if b in consts and inner is not None and inner.op_type in ("Gemm", "MatMul"):
                return inner.op_type
    return ""


def _peaked_share(arrays: Sequence[np.ndarray]) -> float:
    """The share of positions (rows along the last axis) whose softmax tops PEAKED."""
    rows = np.concatenate([a.reshape(-1, a.shape[-1]) for a in arrays])
    shifted = np.exp(rows - rows.max(-1, keepdims=True))
    top = (shifted / shifted.sum(-1, keepdims=True)).max(-1)
    return float(np.mean(top >= PEAKED)) if top.size else 0.0


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((int(onnx.helper.get_attribute_value(a)) for a in node.attribute if a.name == name),
                default)


def _declared_classes(model: onnx.ModelProto, name: str) -> int:
    """The declared size of an output's last axis, 0 when unknown."""
    out = next(o for o in model.graph.output if o.name == name)
    dims = out.type.tensor_type.shape.dim
    return dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else 0


def check_outputs(reference: onnx.ModelProto, lowered: onnx.ModelProto, fmt: NumberFormat, samples: Sequence[Feed], *,
                  saturate: bool, rtol: float, io_types: str = "fp32",
                  host_scales: dict[str, float] | None = None,
                  emulated: onnx.ModelProto | None = None,
                  top_k: Mapping[str, Decision] | None = None) -> OutputCheck:
    """Run the reference and the lowered model's emulation; per-output Inf/NaN and errors.

    The lowered model is judged by widening it back to FP32 with explicit rounding wherever
    it stores the low format (npuprep.verify.emulate_lowered), and it is also run as-is on
    onnxruntime, which proves it loads and runs. `emulated` replaces that widening (a target
    that cannot pin: every node rounded); outputs in `host_scales` are multiplied back first;
    outputs in `top_k` are also judged by their top-K classes (npuprep.verify.output_errors), where
    a position whose FP32 top values lie within `rtol` of each other is a tie, not a decision.
    """
    return check_output_sets(reference, lowered, fmt, [samples], saturate=saturate, rtol=rtol,
                             io_types=io_types, host_scales=host_scales, emulated=emulated,
                             top_k=top_k)[0]


def check_output_sets(reference: onnx.ModelProto, lowered: onnx.ModelProto, fmt: NumberFormat,
                      sample_sets: Sequence[Sequence[Feed]], *, saturate: bool, rtol: float,
                      io_types: str = "fp32", host_scales: dict[str, float] | None = None,
                      emulated: onnx.ModelProto | None = None,
                      top_k: Mapping[str, Decision] | None = None,
                      expected: Sequence[dict[str, np.ndarray]] = (),
                      emulated_outputs: Sequence[dict[str, np.ndarray]] = (),
                      margin: float = 1.0,
                      reference_outputs: list[dict[str, np.ndarray]] | None = None
                      ) -> list[OutputCheck]:
    """check_outputs on several sets of samples (calibration, held out) with one session per
    model: an OutputCheck per set, the top-K decisions also with the error scaled by `margin`
    (OutputErrors). `expected`: the reference's outputs on the first samples,
    already run (npuprep.verify.compare.compare_models gives them); `reference_outputs`, where
    given, receives them on every sample, in order (a later check of the same samples need not
    run the reference again). `emulated_outputs`: an
    emulation's outputs on the first samples, already run: `emulated`'s own, or, without
    `emulated`, the plan's emulation's, which stand for the lowered model's only where its
    emulation gives the first of them bit for bit (else it runs on every sample)."""
    from npuprep.verify.emulate_lowered import emulate_lowered
    from npuprep.verify.output_errors import OutputErrors

    samples = [feed for feeds in sample_sets for feed in feeds]
    # One session at a time (the outputs are small, the weights are not): the reference, the
    # emulation, then the lowered model as it is on one sample, which proves it loads and runs.
    expected = list(expected[:len(samples)])
    if len(expected) < len(samples):
        expected += _outputs(reference, samples[len(expected):])
    if reference_outputs is not None:
        reference_outputs += expected
    # Past LARGE_WEIGHTS (folds_weight_casts) without graph rewrites: onnxruntime would fold the Casts that widen
    # stored weights into a second, FP32 copy of them (the rounding pairs are kept either way).
    emulation = emulated if emulated is not None else emulate_lowered(lowered, fmt, saturate=saturate).model
    known = list(emulated_outputs[:len(samples)])
    reused = len(known)
    if emulated is None and known:
        # The lowered model's emulation must give the plan's numbers on a sample already run.
        first, *rest = _outputs(emulation, [samples[0], *samples[reused:]],
                                optimize=folds_weight_casts(emulation), produced="the emulated model")
        if not _identical(first, known[0]):
            known = [first, *_outputs(emulation, samples[1:reused], optimize=folds_weight_casts(emulation),
                                      produced="the emulated model")]
            reused = 0
        got = known + rest
    else:
        got = known + _outputs(emulation, samples[reused:], optimize=folds_weight_casts(emulation),
                               produced="the emulated model")
    del emulation
    if emulated is not lowered:  # run as it is above already (npuprep.verify.second_draw)
        _outputs(lowered, samples[:1], optimize=folds_weight_casts(lowered), produced="the lowered model")
    host = host_scales or {}
    checks, start = [], 0
    for feeds in sample_sets:
        errors = OutputErrors(top_k=dict(top_k or {}), tie_rtol=rtol, margin=margin)
        for r, c in zip(expected[start:start + len(feeds)], got[start:start + len(feeds)], strict=True):
            for name, rv in r.items():
                if np.issubdtype(np.asarray(rv).dtype, np.floating):
                    errors.add(name, rv, np.asarray(c[name], dtype=np.float64) * host.get(name, 1.0))
        checks.append(OutputCheck(rtol=rtol, samples=len(feeds), outputs=errors.result(),
                                  from_compare=max(0, min(reused - start, len(feeds)))))
        start += len(feeds)
    return checks


def check_until(emulated: onnx.ModelProto, samples: Sequence[Feed],
                expected: Sequence[Mapping[str, np.ndarray]], *, rtol: float,
                stop_past: float) -> OutputCheck:
    """The outputs' check of `emulated` (every output judged by rel L2) against the reference's
    `expected` outputs on `samples`, a sample at a time: once an output's squared errors so
    far over every sample's squared references pass `stop_past` (or it holds Inf/NaN), it
    stops there, its rel L2 that lower bound (OutputCheck.samples: the samples run)."""
    from npuprep.calibrate.run import session_threads
    from npuprep.runtime.session import make_session, release_freed_memory, run_in_streams
    from npuprep.verify.compare import sample_streams
    from npuprep.verify.output_errors import OutputErrors, PooledSums, reference_squares

    streams = sample_streams(len(samples))
    session = make_session(emulated, optimize=folds_weight_casts(emulated), prepack=False,
                           lean=True, threads=session_threads(streams))
    types = {i.name: i.type for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    feeds = [{k: _as_input(v, types.get(k, "")) for k, v in feed.items()} for feed in samples]
    squares = reference_squares(expected)
    errors, sums = OutputErrors(tie_rtol=rtol), PooledSums()
    found: OutputCheck | None = None
    for at, got in enumerate(run_in_streams(session, feeds, names, streams)):
        want = expected[at]
        for name, rv in want.items():
            if np.issubdtype(np.asarray(rv).dtype, np.floating):
                errors.add(name, rv, np.asarray(got[name], dtype=np.float64))
        sums.add(got, want)
        if at + 1 < len(samples) and sums.worst(squares) > stop_past:
            outputs = errors.result()
            for name, low in sums.lows(squares).items():
                outputs[name]["rel_l2"] = low
            found = OutputCheck(rtol=rtol, samples=at + 1, outputs=outputs)
            break
    del session
    release_freed_memory()
    if found is not None:  # a failing check is falsy
        return found
    return OutputCheck(rtol=rtol, samples=len(samples), outputs=errors.result())


def _identical(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    """The same outputs, bit for bit (types and shapes too)."""
    def same(x: np.ndarray, y: np.ndarray) -> bool:
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()

    return a.keys() == b.keys() and all(same(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def _outputs(model: onnx.ModelProto, samples: Sequence[Feed], optimize: bool = True,
             produced: str | None = None, source: str | None = None) -> list[dict[str, np.ndarray]]:
    """Every output of `model` on each sample; the session is gone when this returns. Each
    model is fed its own input types (a model with FP16 inputs has FP32 ones once widened)."""
    from npuprep.calibrate.run import session_threads
    from npuprep.runtime.session import (
        make_session,
        release_freed_memory,
        run_errors,
        run_in_streams,
    )
    from npuprep.verify.compare import sample_streams

    if not samples:
        return []
    # No prepacked copy of the weights: each session runs few samples (the reference only
    # the held-out ones, the model as lowered one), and the copy would double its memory.
    streams = sample_streams(len(samples))
    session = make_session(model, optimize=optimize, prepack=False, produced=produced, lean=True,
                           threads=session_threads(streams), source=source)
    types = {i.name: i.type for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    feeds = [{k: _as_input(v, types.get(k, "")) for k, v in feed.items()} for feed in samples]
    with run_errors(source) if source else contextlib.nullcontext():
        outputs = list(run_in_streams(session, feeds, names, streams))
    del session
    release_freed_memory()
    return outputs


def _as_input(value: np.ndarray, ort_type: str) -> np.ndarray:
    if ort_type == "tensor(float16)":
        return value.astype(np.float16)
    if ort_type == "tensor(float)" and value.dtype == np.float16:
        return value.astype(np.float32)
    return value
