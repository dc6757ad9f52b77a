"""Wide phases: `Sin(t * freq)` with t up to 1000 -> the Mul and the Sin kept FP32 (pinned).

A timestep embedding's phase reaches 1000 rad, where FP16's spacing is 0.5 rad: Sin and
Cos of it are noise, though nothing overflows and the calibration samples may still pass.
Found from the measured range of every main-graph Sin/Cos input: where its target rounding
exceeds PHASE_ERROR (|phase| >= 8 rad in FP16), the Sin/Cos and the elementwise producers
of the phase (the Mul by the frequencies, the timestep's reshapes) stay FP32. These are cheap
nodes. A target that cannot pin gets an `Unpinnable` record naming what only a pin could fix:
a failure's cause.
"""

from __future__ import annotations

from npuprep.calibrate.stats import RangeStats
from npuprep.graph import node_label
from npuprep.ops import PASSTHROUGH_OPS
from npuprep.plan.actions import Hazard, PinFp32, Unpinnable
from npuprep.plan.context import PlanContext
from npuprep.profiles import Pinning

# Largest absolute error (rad) a phase may take from its rounding: sin's error is as large.
PHASE_ERROR = 2.0**-8
PERIODIC = frozenset({"Sin", "Cos"})
# Ops a phase is computed with: the product with the frequencies, shifts, reshapes, casts.
PHASE_OPS = PASSTHROUGH_OPS | {"Mul", "Add", "Sub", "Div", "Neg", "Exp", "Concat", "Tile"}
# At most this many producers join a phase's pin (a phase is a few nodes from its inputs).
MAX_PRODUCERS = 16


def wide_phases(ctx: PlanContext) -> None:
    """Record an FP32 pin (or, where the target cannot pin, an `Unpinnable`) per coarse phase."""
    by_phase: dict[str, list[str]] = {}
    for label, (node, _graph, scope) in ctx.nodes.items():
        if node.op_type in PERIODIC and scope == "main" and node.input:
            by_phase.setdefault(node.input[0], []).append(label)
    for phase, readers in sorted(by_phase.items(), key=lambda kv: ctx.order[kv[1][0]]):
        r = ctx.range_of(phase)
        if r is None or _half_step(ctx, r) <= PHASE_ERROR:
            continue
        step = 2 * _half_step(ctx, r)
        nodes = [n for n in [*_coarse_producers(ctx, phase), *readers] if n not in ctx.forbid]
        said = (f"{', '.join(readers)} read phase {phase} up to {r.absmax:.4g} rad, where "
                f"{ctx.fmt.name}'s spacing is {step:.3g} rad")
        if ctx.profile.fp32_pinning is Pinning.NONE:
            ctx.unpinnable.append(Unpinnable(
                Hazard.COARSE_PHASE, phase, tuple(sorted(nodes, key=ctx.order.__getitem__)),
                f"{said}: only an FP32 pin of {', '.join(nodes)} could fix it, and target "
                f"{ctx.profile.name} cannot pin"))
            continue
        ctx.islands.append(PinFp32(
            nodes=tuple(sorted(nodes, key=ctx.order.__getitem__)), exit_tensors=(),
            measured={"phase_absmax": float(r.absmax)},
            request=ctx.profile.fp32_pinning is Pinning.COMPILER_DECIDES,
            why=f"{said}: the phase and its {'/'.join(sorted({ctx.node(n).op_type for n in readers}))} "
                "stay FP32 (cheap elementwise nodes)"))


def _half_step(ctx: PlanContext, r: RangeStats) -> float:
    top = r.top_exponent()
    return 0.0 if top is None else 2.0**top * ctx.fmt.eps / 2


def _coarse_producers(ctx: PlanContext, phase: str) -> list[str]:
    """Elementwise producers of `phase`, back through PHASE_OPS to graph inputs, constants or
    other ops: a factor's relative rounding (2^-11 in FP16) times the phase is already more
    than PHASE_ERROR once the phase is coarse, whatever the factor's own range."""
    found: list[str] = []
    todo, seen = [phase], set()
    while todo and len(found) < MAX_PRODUCERS:
        tensor = todo.pop()
        node = ctx.produced_by.get(tensor)
        if tensor in seen or node is None:
            continue
        seen.add(tensor)
        label = node_label(node)
        if node.op_type not in PHASE_OPS or ctx.nodes[label][2] != "main":
            continue
        found.append(label)
        todo.extend(i for i in node.input if i)
    return found
