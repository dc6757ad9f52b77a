"""The FP16/BF16 build: rounds of `apply the plan -> lower -> emulate -> compare -> check outputs`.

Each round builds the plan as it stands; a failed check asks verify/pin_rounds.py for the
next pin, which is kept only when the next round is better. Then the FP32 share and the
ledger of what the pins cost. The 8-bit counterpart is npuprep.pipeline.quantise_and_verify.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from npuprep.data import Feed
from npuprep.detections import Decision
from npuprep.graph import weight_bytes
from npuprep.ledger.ledger import build_ledger
from npuprep.model_io import Model, WeightScratch
from npuprep.numerics import NumberFormat
from npuprep.pipeline.result import ConversionResult, SampleUse
from npuprep.plan import Plan
from npuprep.plan.decide import Planned
from npuprep.profiles import Pinning, ResolvedTarget
from npuprep.provenance import record_source
from npuprep.rewrite.apply import apply_plan
from npuprep.rewrite.lower import Lowered, lower
from npuprep.verify.compare import DEFAULT_ATOL, compare_models, emulation_notes
from npuprep.verify.emulate import emulate
from npuprep.verify.fp32_share import fp32_share
from npuprep.verify.output_check import check_output_sets
from npuprep.verify.pin_rounds import Build, PinRounds, sample_shapes

# Models with at least this many bytes of weights keep their lowered (or 8-bit) weights in a
# scratch file while they are verified (npuprep.model_io.WeightScratch), not in memory.
SCRATCH_BYTES = 64 * 2**20


def lower_and_verify(source: Model, planned: Planned, target: ResolvedTarget,
                     samples: Sequence[Feed], holdout: Sequence[Feed] | None, *,
                     use: SampleUse, io_types: str, rtol: float, max_rounds: int,
                     max_fp32_share: float, opset: int | None, top_k: Mapping[str, Decision],
                     stage: Callable[[str], None]) -> ConversionResult:
    """`planned` built for `target` in up to `max_rounds` verification rounds (and up to
    pin_rounds.MAX_WIDENINGS more where an attributed pin falls short of the gate); its FP32
    share (failing over `max_fp32_share`) and the ledger of what its pins cost."""
    work, stats, plan = planned.model, planned.stats, planned.plan
    rounds = PinRounds(target, samples, rtol=rtol, max_fp32_share=max_fp32_share,
                       notes=list(planned.notes))
    # The plan before the last verification pin, its build and its round.
    tried: tuple[Plan, Build, int] | None = None
    round_no, proposed = 0, 0
    while True:
        round_no += 1
        build = _build(work, target, plan, samples, io_types=io_types, rtol=rtol,
                       holdout=holdout, stats=stats, opset=opset, top_k=top_k,
                       stage=lambda s, r=round_no: stage(f"round {r}, {s}"))
        if tried is not None and not rounds.keeps(tried[1], build, round_no):
            # An attributed pin that bought too little is taken wider, not given up on; a
            # divergent node's, back to its inputs' producers.
            wider = rounds.widen(round_no, tried[0]) or rounds.upstream(round_no, tried[0])
            if wider is None:
                plan, build, round_no = tried
                break
            plan = replace(tried[0], actions=(*tried[0].actions, wider))
            continue
        if _passed(build):
            break
        if proposed == max_rounds - 1:
            # The rounds are spent: an attributed pin still short of the gate is taken wider
            # (rounds.widen says when there is nothing wider to take).
            wider = rounds.widen(round_no, plan)
            if wider is None:
                break
            tried = (plan, build, round_no)
            plan = replace(plan, actions=(*plan.actions, wider))
            continue
        pin = rounds.propose(build, plan, round_no, stage)
        if pin is None:
            break
        proposed += 1
        tried = (plan, build, round_no)
        plan = replace(plan, actions=(*plan.actions, pin))
    # The converted model names its source, so the source's stats apply to it by name.
    record_source(build.lowered.model, source.fingerprint, build.tensor_scales)
    share = fp32_share(build.rewritten, _fp32_groups(plan, build, stats, target.fmt),
                       limit=max_fp32_share, input_shapes=sample_shapes(samples))
    ledger = build_ledger(build.rewritten, target, name=source.path,
                          input_shapes=sample_shapes(samples), pinned=sorted(build.pinned),
                          converted=build.lowered.model).to_dict(nodes=False)
    return ConversionResult(
        source=source, profile=target.profile, fmt=target.fmt, findings=planned.findings,
        plan=plan, rewritten=build.rewritten, lowered=build.lowered,
        tensor_scales=build.tensor_scales, pinned_nodes=tuple(sorted(build.pinned)),
        output_check=build.output_check, layers=build.layers,
        holdout=build.holdout, flops_fp32_share=share.flops, rounds=round_no, samples=use,
        io_types=io_types, stats=stats, declined=build.declined,
        notes=tuple(rounds.notes) + build.notes, share=share, host_scales=build.host_scales,
        error_attribution=tuple(rounds.attributions), ledger=ledger,
    )


def _passed(build: Build) -> bool:
    """The outputs pass on the calibration samples and, where there are any, the held-out ones."""
    return bool(build.output_check) and (build.holdout is None or bool(build.holdout))


def _fp32_groups(plan: Plan, build: Build, stats: Any,
                 fmt: NumberFormat) -> list[tuple[tuple[str, ...], str, str, bool]]:
    """The FP32 nodes of a conversion as (nodes, why, declined remedy, required): the plan's
    islands, what lowering forced, what the rewrites inserted, then anything else kept FP32.
    An island is required when an exit's measured range exceeds the format (it can only
    close at an output kept FP32) or when its ops have no kernel in the low format."""
    groups: list[tuple[tuple[str, ...], str, str, bool]] = []
    declined = list(plan.declined) + list(build.declined)
    no_low_kernel = _fixed_fp32_nodes(build.rewritten)
    for pin in plan.pins():
        refs = set(pin.findings)
        mine = [d for d in declined if refs & set(d.findings)]
        first = next((d for d in mine if d.remedy == "rescale"), mine[0] if mine else None)
        why = pin.why.split(" | ")[0]
        required = not pin.forced and (
            any(not _fits_format(stats, t, fmt) and stats is not None and t in stats.tensors
                for t in pin.exit_tensors) or set(pin.nodes) <= no_low_kernel)
        instead = f"{first.remedy} declined: {first.reason}" if first else (
            "forced: the plan asks for FP32" if pin.forced else
            "no remedy planned: verification pinned it" if not pin.findings else "")
        groups.append((pin.nodes, why, instead, required))
    for node, reason in sorted(build.lowered.forced_fp32.items()):
        groups.append(((node,), f"lowering: {reason}", "", node in no_low_kernel))
    by_reason: dict[str, list[str]] = {}
    for node in sorted(build.boundary):
        by_reason.setdefault(build.fp32_reasons.get(node, "inserted by a rewrite"), []).append(node)
    groups += [(tuple(nodes), why, "", False) for why, nodes in sorted(by_reason.items())]
    groups.append((tuple(sorted(build.pinned)), "kept FP32", "", False))
    return groups


def _fixed_fp32_nodes(model: Any) -> set[str]:
    """Nodes whose FP32 no remedy can change: ops of other domains (`ai.onnx.ml` has no FP16
    kernels) and ops whose output type an attribute fixes (npuprep.rewrite.lower)."""
    from npuprep.graph import node_label, walk_graphs
    from npuprep.rewrite.lower import FORCED_FP32_OPS

    return {node_label(n) for scope in walk_graphs(model.graph) for n in scope.graph.node
            if n.domain not in ("", "ai.onnx") or n.op_type in FORCED_FP32_OPS}


def _build(model: Model, target: ResolvedTarget, plan: Plan,
           samples: Sequence[Feed], *, io_types: str, rtol: float,
           holdout: Sequence[Feed] | None, stats: Any = None,
           opset: int | None = None, top_k: Mapping[str, Decision] | None = None,
           stage: Callable[[str], None] = lambda _: None) -> Build:
    """One round: apply `plan`, lower, emulate layer by layer and check the outputs."""
    profile, fmt, saturate = target.profile, target.fmt, target.saturate
    stage("rewriting")
    applied = apply_plan(model.proto, plan)
    # A target that cannot pin runs every node in its format: emulate it so (a PASSED then
    # matches the device). Output compensations the device cannot hold move to the host.
    no_pin = profile.fp32_pinning is Pinning.NONE
    applied, host_scales, host_notes = _host_scales(model, applied, target, stats, samples)
    pinned = set(plan.pinned_nodes()) | set(applied.fp32_nodes)
    pinned |= {n for n, inp in applied.input_nodes.items() if not _fits_format(stats, inp, fmt)}
    lower_fmt = target.weights
    stage("lowering")
    lowered = lower(applied.model, lower_fmt, pinned_nodes=sorted(pinned), io_types=io_types,
                    scratch=WeightScratch() if weight_bytes(applied.model) >= SCRATCH_BYTES else None)
    pinned |= set(lowered.pinned_nodes)
    if opset is not None:
        from npuprep.opsets import convert_opset

        lowered = replace(lowered, model=convert_opset(lowered.model, opset, why="--opset"))
    stage("emulating and comparing layer by layer")
    # A target that cannot pin emulates every node in its format but BatchNorms folded at
    # build time; elsewhere an If that only carries a pinned branch node's FP32 output is not
    # rounded either.
    emulation = emulate(applied.model, fmt, saturate=saturate,
                        pinned_nodes=_folded_at_build(applied.model, lowered) if no_pin
                        else pinned | set(lowered.fp32_output_nodes), weights_in_graph=True)
    reference: list[dict[str, np.ndarray]] = []
    emulated: list[dict[str, np.ndarray]] = []
    layers = compare_models(model.proto, emulation.model, samples, rtol=rtol, atol=DEFAULT_ATOL,
                            tensor_scales=applied.tensor_scales, fmt=fmt, reference_outputs=reference,
                            candidate_outputs=emulated,
                            # The candidate is the emulation of the rewritten model, named by
                            # its source: hashing either would read every weight again.
                            fingerprints=(model.fingerprint, f"{fmt.name}-emulated:{model.fingerprint}"))
    notes = list(emulation_notes(target, saturate)) + list(host_notes) + _flushed_weights(lowered, lower_fmt)
    if no_pin:
        notes.append(f"target {profile.name} cannot pin FP32 (fp32_pinning: none): every node "
                     f"is emulated in {fmt.name}, FP32 islands of the ONNX file included")
    if fmt is not lower_fmt:
        notes.append(f"the ONNX artefact is lowered to {lower_fmt.name}; {fmt.name} is emulated, "
                     "quantisation to it is the compiler's job")
    everywhere = emulation.model if no_pin else None
    del emulation  # its copy of the graph is not needed for the output check elsewhere
    stage("checking the outputs")
    checks = check_output_sets(model.proto, lowered.model, lower_fmt,
                               [samples] + ([holdout] if holdout is not None else []),
                               saturate=saturate, rtol=rtol, io_types=io_types,
                               host_scales=host_scales, emulated=everywhere, top_k=top_k,
                               expected=reference, emulated_outputs=emulated)
    output_check, held = checks[0], (checks[1] if holdout is not None else None)
    return Build(
        rewritten=applied.model, lowered=lowered, tensor_scales=applied.tensor_scales,
        pinned=frozenset(pinned), layers=layers, output_check=output_check, holdout=held,
        declined=tuple(applied.declined), notes=tuple(notes), host_scales=host_scales,
        boundary=frozenset(set(applied.fp32_nodes) | (set(applied.input_nodes) & pinned)),
        fp32_reasons=dict(applied.fp32_reasons))


def _flushed_weights(lowered: Lowered, fmt: NumberFormat) -> list[str]:
    """The weights with non-zero values under the format's smallest subnormal, which the model
    written stores as 0: named, so a loss the outputs' check passes is still seen."""
    flushed = sorted(lowered.flushed_weights.items(), key=lambda kv: (-kv[1], kv[0]))
    if not flushed:
        return []
    named = ", ".join(f"'{name}' ({count})" for name, count in flushed[:3])
    more = f" and {len(flushed) - 3} more" if len(flushed) > 3 else ""
    return [f"non-zero weights under the smallest {fmt.name} subnormal ({fmt.min_subnormal:.3g}) are "
            f"0 in the model written: {named}{more} (values per weight); the outputs' check includes "
            "their loss (a layer they matter to fails it, and verification keeps it FP32)"]


def _folded_at_build(model: Any, lowered: Any) -> set[str]:
    """BatchNormalizations whose weights lowering kept FP32: a compiler that cannot pin still
    folds them into a scale and shift in FP32 at build time (rknn-toolkit2 reports a fused
    `[Conv] bn` layer), so their raw variances never meet FP16; emulation rounds their
    result only."""
    from npuprep.graph import node_label

    ops = {node_label(n): n.op_type for n in model.graph.node}
    return {n for n in lowered.forced_fp32 if ops.get(n) == "BatchNormalization"}


def _host_scales(model: Model, applied: Any, target: ResolvedTarget, stats: Any,
                 samples: Sequence[Feed]) -> tuple[Any, dict[str, float], tuple[str, ...]]:
    """Rescale exits at graph outputs the device cannot hold (over the limit where it cannot
    pin, under the smallest normal anywhere) leave the device scaled
    (npuprep.plan.host_scale decides, npuprep.rewrite.output_scale rewrites)."""
    from npuprep.plan.host_scale import factor_words, host_scaled_outputs
    from npuprep.rewrite.output_scale import leave_output_scaled

    producer = {o: n.name for n in applied.model.graph.node for o in n.output}
    exits = [o.name for o in applied.model.graph.output
             if producer.get(o.name) in set(applied.fp32_nodes)]
    if not exits:
        return applied, {}, ()
    chosen = host_scaled_outputs(exits, _output_absmax(model, stats, samples, exits), target)
    current, fp32_nodes = applied.model, list(applied.fp32_nodes)
    scales, host, notes = dict(applied.tensor_scales), {}, []
    for name, why in chosen.items():
        done = leave_output_scaled(current, name)
        if not done:
            notes.append(f"output '{name}' cannot be scaled on the host: {done.reason}")
            continue
        current = done.model
        factor = float(done.details["host_scales"][name])
        host[name] = factor
        scales[name] = 1.0 / factor
        fp32_nodes.remove(str(done.details["removed"]))
        times = factor_words(factor)
        by = factor_words(1.0 / factor) if factor < 1 else f"1/{times}"
        notes.append(f"output '{name}' leaves the device scaled by {by} ({why}); "
                     f"multiply it by {times} on the host (report key host_scales)")
    return (replace(applied, model=current, fp32_nodes=tuple(fp32_nodes), tensor_scales=scales),
            host, tuple(notes))


def _output_absmax(model: Model, stats: Any, samples: Sequence[Feed],
                   names: list[str]) -> dict[str, float]:
    """True |max| of graph outputs: from the calibration statistics, else a reference run."""
    if stats is not None and all(n in stats.tensors for n in names):
        return {n: float(stats.tensors[n].absmax) for n in names}
    from npuprep.runtime.session import make_session, run

    session = make_session(model.proto)
    found = dict.fromkeys(names, 0.0)
    for feed in samples:
        out = run(session, feed)
        for n in names:
            if n in out:
                found[n] = max(found[n], float(np.nanmax(np.abs(out[n]), initial=0.0)))
    return found


def _fits_format(stats: Any, tensor: str, fmt: NumberFormat) -> bool:
    """A graph input measured within the target format: scaling it by a power of two can
    run in that format. Unmeasured inputs are scaled in FP32, to be safe."""
    r = None if stats is None else stats.tensors.get(tensor)
    return r is not None and r.absmax <= fmt.max and not (r.nan_count or r.inf_count)
