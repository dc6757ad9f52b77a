"""The FP32 share of a converted model: FLOPs and multiply-adds kept in FP32, per island.

A conversion that keeps most of the compute in FP32 has failed its user even when its
outputs are exact: the target runs FP32 slowly or on a CPU fallback. This ranks the FP32
islands by their FLOPs, each with why it is FP32 and which cheaper remedy was declined.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import onnx

from npuprep.flops import node_flops
from npuprep.graph import node_label, walk_graphs
from npuprep.ops import MAC_OPS, RECURRENT_OPS

# The default largest share of FLOPs `convert` lets stay FP32 before it fails.
DEFAULT_MAX_FP32_SHARE = 0.10


@dataclass(frozen=True)
class IslandCost:
    """FP32 nodes that belong together, their FLOPs and multiply-add FLOPs, why they are
    FP32 and the cheaper remedy declined for them ("" when none was tried). `required`:
    their true range needs FP32 (an output beyond the target format); the gate names them
    and shows their FLOPs but does not count them."""

    nodes: tuple[str, ...]
    flops: int
    mac_flops: int
    why: str
    declined: str = ""
    required: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": list(self.nodes), "flops": self.flops, "mac_flops": self.mac_flops,
                "why": self.why, "declined": self.declined, "required": self.required}


@dataclass(frozen=True)
class Fp32Share:
    """Share of FLOPs (`flops`) and of the multiply-adds of Conv/MatMul/Gemm and recurrent
    layers (`macs`) kept FP32, against `limit` (a share of FLOPs). Truthy when the FLOPs share
    of the islands that are not required (`avoidable`) is within the limit; `islands` are
    ranked by FLOPs, costliest first."""

    flops: float
    macs: float
    total_flops: int
    total_mac_flops: int
    islands: tuple[IslandCost, ...]
    limit: float = DEFAULT_MAX_FP32_SHARE

    @property
    def avoidable(self) -> float:
        """Share of FLOPs in FP32 islands whose true range does not need FP32."""
        spent = sum(i.flops for i in self.islands if not i.required)
        return spent / self.total_flops if self.total_flops else 0.0

    def __bool__(self) -> bool:
        return self.avoidable <= self.limit

    def verdict(self) -> str:
        """One line: the shares, and when over the limit the costliest island and the
        remedy declined for it."""
        line = (f"FP32 share: {100 * self.flops:.1f}% of FLOPs, {100 * self.macs:.1f}% of "
                f"multiply-adds")
        required = [i for i in self.islands if i.required]
        if required:
            line += (f" ({100 * sum(i.flops for i in required) / max(self.total_flops, 1):.1f}% "
                     f"required in FP32 by range or op support: {', '.join(required[0].nodes[:3])})")
        if self:
            return line
        worst = next(i for i in self.islands if not i.required)
        names = ", ".join(worst.nodes[:3]) + (f" +{len(worst.nodes) - 3}" if len(worst.nodes) > 3 else "")
        share = worst.flops / self.total_flops if self.total_flops else 0.0
        declined = worst.declined or "no cheaper remedy was tried"
        return (f"{line}, over --max-fp32-share {100 * self.limit:g}%; costliest island "
                f"{names} ({100 * share:.1f}% of FLOPs): {declined}")

    def headline(self) -> str:
        """The gate's failure in one short line (terminal width): the avoidable share, the
        costliest island and the remedy declined for it; "" within the limit."""
        if self:
            return ""
        worst = next(i for i in self.islands if not i.required)
        names = ", ".join(worst.nodes[:3]) + (f" +{len(worst.nodes) - 3}" if len(worst.nodes) > 3 else "")
        share = worst.flops / self.total_flops if self.total_flops else 0.0
        remedy = worst.declined.split(":")[0] if worst.declined else "no remedy tried"
        return (f"{100 * self.avoidable:.0f}% of FLOPs stay FP32 (over {100 * self.limit:g}%); "
                f"costliest island {names} ({100 * share:.0f}%): {remedy}")

    def to_dict(self) -> dict[str, Any]:
        return {"flops": self.flops, "macs": self.macs, "total_flops": self.total_flops,
                "total_mac_flops": self.total_mac_flops, "limit": self.limit,
                "avoidable": self.avoidable, "headline": self.headline(),
                "within_limit": bool(self), "islands": [i.to_dict() for i in self.islands]}


def fp32_share(model: onnx.ModelProto,
               groups: Iterable[tuple[Iterable[str], str, str] | tuple[Iterable[str], str, str, bool]],
               *, limit: float = DEFAULT_MAX_FP32_SHARE,
               input_shapes: Mapping[str, tuple[int, ...]] | None = None) -> Fp32Share:
    """The FP32 share of `model` whose FP32 nodes come in `groups` of (nodes, why, declined)
    or (nodes, why, declined, required); `input_shapes` sizes dynamic inputs (a sample's).

    A node in several groups counts once, in the first; groups left without nodes drop out.
    """
    flops = node_flops(model, input_shapes)
    ops = {node_label(n): n.op_type for s in walk_graphs(model.graph) for n in s.graph.node}
    total = sum(flops.values())
    macs = {k: v for k, v in flops.items() if ops.get(k) in MAC_OPS | RECURRENT_OPS}
    total_macs = sum(macs.values())
    seen: set[str] = set()
    islands: list[IslandCost] = []
    for nodes, why, declined, *required in groups:
        mine = tuple(n for n in dict.fromkeys(nodes) if n in flops and n not in seen)
        seen.update(mine)
        if mine:
            islands.append(IslandCost(mine, sum(flops[n] for n in mine),
                                      sum(macs.get(n, 0) for n in mine), why, declined,
                                      bool(required and required[0])))
    islands.sort(key=lambda i: (-i.flops, i.nodes))
    fp32 = sum(i.flops for i in islands)
    fp32_macs = sum(i.mac_flops for i in islands)
    return Fp32Share(fp32 / total if total else 0.0, fp32_macs / total_macs if total_macs else 0.0,
                     total, total_macs, tuple(islands), limit)
