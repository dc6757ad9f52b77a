"""The verdict of a conversion, computed once from typed results: `ConversionResult -> Verdict`.

A conversion passes when every gate holds: the outputs on the calibration samples, the
outputs on the held-out samples, the FP32 share of the FLOPs (FP16/BF16) or the 8-bit share
of the multiply-adds (INT8/FP8), and the vendor's simulator when one was run. The first gate
that trips is where a failure shows (`gate`, `reason`), not always why it happened: a
classifier whose logits live at 1e-9 fails because FP16 flushes them, whichever gate trips.
When a failure traces to an underflow the plan could not lift, or to a hazard only an FP32
pin fixes on a target that cannot pin, that is its `cause`, said first. report/ renders the
verdict as stored in report.json; nothing downstream recomputes it.
"""

from __future__ import annotations

import numpy as np
import onnx

from npuprep.formatting import number, percent, ratio
from npuprep.graph import node_label, to_array
from npuprep.numerics import NumberFormat
from npuprep.pipeline.result import ConversionResult, Gate, Verdict
from npuprep.plan.actions import Rescale
from npuprep.plan.layer_precision import NOT_FP32
from npuprep.profiles import Pinning
from npuprep.report.output_verdicts import agreement_said, detection_failure_said
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.output_errors import output_passes


def judge(result: ConversionResult) -> Verdict:
    """The verdict of `result` (its vendor check included, when one ran)."""
    checks = [c for c in (result.output_check, result.holdout) if c is not None]
    gates = [(Gate.OUTPUTS, result.output_check), (Gate.HOLDOUT, result.holdout),
             (Gate.FP32_SHARE, result.share),
             (Gate.EIGHT_BIT_SHARE, result.eight_bit.share_met if result.eight_bit else None),
             (Gate.VENDOR, result.vendor)]
    tripped = next((g for g, held in gates if held is not None and not held), None)
    if tripped is None:
        return Verdict(passed=True)
    cause = failure_cause(result)
    short = _eight_bit_short(result)
    if tripped is Gate.EIGHT_BIT_SHARE:
        # Every gate before it held: the share is the whole reason, and the outputs that
        # held are said, so a FAILED at 33% 8-bit does not read as an accuracy failure.
        return Verdict(passed=False, gate=tripped, reason=short + _outputs_held(checks), cause=cause)
    outputs_ok = all(checks)
    first = result.first_divergent
    finite = all(o["nonfinite"] == 0 for c in checks for o in c.outputs.values())
    overflowed = first is not None and bool(first.inf_count or first.nan_count or first.saturated_count)
    limited = finite and not overflowed and (first is not None or not (outputs_ok or cause))
    reason = (_overfit(result.output_check, result.holdout, result.louder_inputs)
              or (_precision_limited(result, checks) if limited else "")
              or (f"first divergent node '{first.node}' ({first.op_type})" if first is not None else "")
              or (result.share.headline() if outputs_ok and result.share is not None else "")
              or short or _vendor_failed(result)
              or _nonfinite_reason(checks, result.io_types)
              or ("outputs over their tolerance" if cause and not outputs_ok else ""))
    if short and short not in reason:
        # Both gates failed: the outputs and the 8-bit share, each named.
        reason = f"{reason}; and {short}" if reason else short
    return Verdict(passed=False, gate=tripped, reason=reason, cause=cause, precision_limited=limited)


def _precision_limited(result: ConversionResult, checks: list[OutputCheck]) -> str:
    # The outputs that failed: a held-out set whose decisions all held is no part of the reason.
    failing = [(name, o) for c in checks for name, o in c.outputs.items()
               if not output_passes(o, c.rtol)]
    worst = max((o["rel_l2"] for _, o in failing),
                default=max((o["rel_l2"] for c in checks for o in c.outputs.values()), default=0.0))
    first = result.first_divergent
    traced = (result.error_attribution or ({},))[-1].get("layers")
    # Where the error was traced to its layers, they are its source; the first divergent node
    # is only where it shows.
    source = (f"largest own share '{traced[0]['node']}' ({percent(traced[0]['share'])} of it), "
              f"first seen at '{first.node}'" if traced and first is not None else
              f"first divergent node '{first.node}'" if first is not None else
              "no single layer is over the tolerance under the layer-by-layer emulation")
    # A detector's output fails by its detections, not by the rel L2 of its background.
    moved = [f"{name}: {detection_failure_said(o)}" for name, o in failing
             if "detect" in o and "detect_fallback" not in o]
    # An output judged by its decisions (top-K, a CTC decoder's text) fails by them, on each
    # sample set named where both were checked.
    sets = {id(result.output_check): "calibration", id(result.holdout): "held out"}
    said: dict[str, list[str]] = {}
    for c in checks:
        for name, o in c.outputs.items():
            if "top_k" in o and "detect" not in o and not output_passes(o, c.rtol):
                said.setdefault(name, []).append(
                    agreement_said(o) + (f" {sets[id(c)]}" if len(checks) > 1 else ""))
    moved += [f"{name}: {', '.join(parts)}" for name, parts in said.items()]
    off = f"by rel L2 {number(worst)}" if not moved else f"({'; '.join(dict.fromkeys(moved))})"
    # Steps judged one by one whose greedy CTC texts all held: the user may mean those.
    rows = [(name, o) for c in checks for name, o in c.outputs.items()]
    texts = sorted({name for name, o in failing if "ctc_text_agreement" in o} - {
        name for name, o in rows if o.get("ctc_text_agreement", 1.0) < 1.0})
    hint = (f"; read as CTC text every sequence of {', '.join(texts)} holds (--top-k "
            f"{texts[0]}:ctc if a CTC decoder reads it)" if texts else "")
    return (f"outputs off {off} with no Inf/NaN ({result.precision.upper()} precision; "
            f"--metric, --top-k, --detect or --rtol are yours{hint}): {source}")


def _overfit(calibration: OutputCheck | None, held: OutputCheck | None,
             louder: dict[str, tuple[float, float]]) -> str:
    """The calibration samples pass and the held-out ones do not; where held-out inputs
    go past the calibration samples' range, the loudest is named (a range the plan never saw)."""
    if not calibration or held is None or held:
        return ""
    outs = held.outputs.values()
    bad = sum(o["nonfinite"] for o in outs)
    worst = max((o["rel_l2"] for o in outs), default=0.0)
    was = max((o["rel_l2"] for o in calibration.outputs.values()), default=0.0)
    said = (f"held-out samples fail (rel L2 {number(worst)}" + (f", {bad} Inf/NaN" if bad else "")
            + f") where the calibration samples pass (rel L2 {number(was)}): the conversion "
            "fits the samples it was planned on")
    if not louder:
        return said
    name, (seen, reached) = next(iter(louder.items()))
    where = (f"{ratio(reached / seen)} the calibration samples' largest |value| "
             f"({number(reached)} against {number(seen)})" if seen else
             f"|value| {number(reached)} where every calibration sample holds 0")
    return f"{said}; held-out input '{name}' reaches {where}: calibrate on samples as loud as deployment's"


def _eight_bit_short(result: ConversionResult) -> str:
    e = result.eight_bit
    if e is None or e.share_met:
        return ""
    typed = [x.why for x in result.plan.eight_bit if f", {NOT_FP32} (" in x.why]
    return (f"{percent(e.mac_share[e.format])} of the multiply-adds in {e.format}, under "
            f"--min-8bit-share {percent(e.min_8bit_share)}"
            + (f"; {len(typed)} layer(s) not FP32, e.g. {typed[0]}" if typed else ""))


def _outputs_held(checks: list[OutputCheck]) -> str:
    """`(the outputs hold: worst rel L2 0.0035, top-1 held)` for outputs that passed."""
    worst = max((o["rel_l2"] for c in checks for o in c.outputs.values()), default=0.0)
    decided = [o for c in checks for o in c.outputs.values() if "top_k" in o]
    held = ", every top-K decision held" if decided and all(o["top_k_agreement"] == 1.0 for o in decided) else ""
    detected = [o for c in checks for o in c.outputs.values() if "detect_agreement" in o]
    if detected and all(o["detect_agreement"] == 1.0 for o in detected):
        held += ", every detection held"
    return f" (the outputs pass: worst rel L2 {number(worst)}{held})" if checks else ""


def _vendor_failed(result: ConversionResult) -> str:
    v = result.vendor
    if v is None or v:
        return ""
    if not v.built:
        return f"{v.vendor} refused the converted model in {v.stage}: {v.refusal}"
    # rknn-toolkit2 simulates the board; OpenVINO runs on its real device.
    run = "simulator" if v.vendor == "rknn" else "run"
    return f"outputs over their tolerance in {v.vendor}'s {run} ({v.target_platform})"


def _nonfinite_reason(checks: list[OutputCheck], io_types: str) -> str:
    """Why outputs are Inf/NaN where no node diverged first: FP32 itself, or the FP16 outputs."""
    rows = [(name, o) for c in checks for name, o in c.outputs.items() if o["nonfinite"]]
    if not rows:
        return ""
    name, o = rows[0]
    if o.get("reference_nonfinite"):
        return (f"the FP32 model itself gives {o['reference_nonfinite']} Inf/NaN in '{name}' on these "
                "samples (an Inf in the model or out-of-range samples): nothing to compare there")
    if io_types == "target":
        return (f"'{name}' has {o['nonfinite']} Inf/NaN: with --io-types target the graph's inputs and "
                "outputs are FP16 and its values pass FP16's largest; keep them FP32 (--io-types fp32)")
    return f"'{name}' has {o['nonfinite']} Inf/NaN under emulation, at no node before the output"


# An output is said to fail by underflow when at least this share of its values lie under
# the format's smallest normal.
MOSTLY = 0.5


def failure_cause(result: ConversionResult) -> str:
    """One clause naming the underflow (or the pin a target cannot grant) behind a failure,
    or "" when none shows. The conversion planned its wider layers in `result.fmt`."""
    return (_underflowing_output(result) or _weights_pushed_up(result)
            or _needs_a_pin(result))


def _underflowing_output(result: ConversionResult) -> str:
    """A failing output that the findings measured under the smallest normal of the format."""
    fmt = result.fmt
    under = {f.tensor: f for f in result.findings if f.rule == "range.underflow" and f.tensor}
    declined = (*result.plan.declined, *result.declined)
    for check in (result.output_check, result.holdout):
        for name, errors in (check.outputs if check is not None else {}).items():
            found = under.get(name)
            if found is None or output_passes(errors, check.rtol):
                continue
            absmax = found.evidence.get("absmax", 0.0)
            share = found.evidence.get("share_below_min_normal", 1.0)
            if share < MOSTLY:
                continue  # a few values flushed to zero do not make an output's error
            if errors.get("max_abs_error", 0.0) > fmt.min_normal:
                # A value under the smallest normal errs by less than it, flushed whole: a
                # larger error sits at the output's normal values (a softmax over thousands of
                # classes, its tiny probabilities exact enough, its top ones off).
                continue
            # A remedy the planner declined is why the output stayed down there: a lift first.
            mine = sorted((d for d in declined if any(r.tensor == name for r in d.findings)),
                          key=lambda d: d.remedy != "rescale")
            why = f" ({mine[0].remedy} declined: {mine[0].reason})" if mine else ""
            lives = (f"lives at |x| <= {absmax:.3g}, under" if absmax < fmt.min_normal
                     else f"has {share:.0%} of its values under")
            return (f"underflow: output {name} {lives} the smallest {fmt.name} normal "
                    f"({fmt.min_normal:.3g}), and comes out with rel L2 {errors['rel_l2']:.3g}{why}")
    return ""


def _weights_pushed_up(result: ConversionResult) -> str:
    """Weights that a rescale up (an underflow's remedy) pushed past the format, so lowering
    kept their nodes FP32: measured on the rewritten model's initialisers."""
    fmt = result.fmt
    ups = [a for a in result.plan.actions if isinstance(a, Rescale) and a.k < 0]
    nodes = {n for a in ups for n in (a.entry, *a.absorbers)} & set(result.lowered.forced_fp32)
    if not nodes:
        return ""
    pushed = _weights_beyond(result.rewritten, nodes, fmt)
    if not pushed:
        return ""
    values = sorted(v for _, v in pushed.values())
    return (f"underflow: lifting {', '.join(a.entry for a in ups)} out of {fmt.name}'s "
            f"subnormals pushes weights of {', '.join(sorted(pushed))} past "
            f"{fmt.name} ({values[0]:.6g} .. {values[-1]:.6g}), which keeps them FP32")


def _weights_beyond(model: onnx.ModelProto, nodes: set[str],
                    fmt: NumberFormat) -> dict[str, tuple[str, float]]:
    """node -> (its first weight past `fmt`'s max, that weight's largest |value|)."""
    inits = {t.name: t for t in model.graph.initializer}
    found: dict[str, tuple[str, float]] = {}
    for node in model.graph.node:
        label = node_label(node)
        if label not in nodes:
            continue
        for name in node.input:
            if name not in inits:
                continue
            largest = float(np.max(np.abs(to_array(inits[name])), initial=0.0))
            if largest > fmt.max:
                found[label] = (name, largest)
                break
    return found


def _needs_a_pin(result: ConversionResult) -> str:
    """A hazard the plan found that only an FP32 pin fixes, on a target that cannot pin (a
    coarse phase, a Log chain floored instead): the plan's first `Unpinnable`, as it said it."""
    if result.profile.fp32_pinning is not Pinning.NONE:
        return ""
    return next((u.why for u in result.plan.unpinnable), "")
