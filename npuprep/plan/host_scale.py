"""Host-side output scaling: which graph outputs leave the device scaled by 2^k (decision only).

    output y (true range 1.1e5 > limit), rescale exit Mul(y', 4) on a target that cannot
    pin -> y leaves the device as y' = y / 4; the host multiplies by 4
    output z (true range 1.6e-10 < FP16's smallest normal), exit Mul(z', 2^-29) -> z leaves
    the device as z' = z x 2^29; the host multiplies by 2^-29

A rescale absorbed "at a graph output" ends in a compensating Mul that must run in FP32
to hold the output's true range. A target whose compiler runs every node in FP16
(`fp32_pinning: none`) runs that Mul in FP16 too and gives Inf above the format, or flushes
to 0 / rounds as subnormals below its smallest normal, so the compensation moves to the
host, where the user's code (or `undo_host_scales`) multiplies the output back. An output
wholly under the smallest normal leaves scaled on every target: a Mul back to it on the
device gives subnormals or 0 wherever it runs in the format (a compiler that decides, an
FP16 output), and on the host it costs one multiply.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from npuprep.profiles import Pinning, ResolvedTarget


def host_scaled_outputs(exits: Iterable[str], absmax: Mapping[str, float],
                        target: ResolvedTarget) -> dict[str, str]:
    """Outputs (among rescale exits) to leave scaled on the device, each with the reason.

    Where the output's true range lies wholly under the format's smallest normal (an
    all-zero output needs nothing), on every target; where it exceeds the target's safe
    limit, only on targets that cannot pin (elsewhere the FP32 Mul holds it). An output
    that fits keeps its compensation on the device.
    """
    profile, limit, fmt = target.profile, target.limit, target.fmt
    cannot_pin = profile.fp32_pinning is Pinning.NONE
    runs = (f"target {profile.name} runs the compensating Mul in {fmt.name}" if cannot_pin else
            f"a Mul back to it on the device gives {fmt.name} subnormals or 0 wherever it runs in {fmt.name}")
    chosen = {}
    for name in exits:
        top = absmax.get(name, 0.0)
        if top > limit and cannot_pin:
            chosen[name] = f"true range {top:.4g} exceeds the limit {limit:.6g} and {runs}"
        elif 0.0 < top < fmt.min_normal:
            chosen[name] = (f"true range {top:.4g} lies under the smallest {fmt.name} normal "
                            f"{fmt.min_normal:.3g}; {runs}")
    return chosen


def factor_words(factor: float) -> str:
    """A host scale for people: `4`, `64`, and an underflow's `2^-29` (not 1.86265e-09)."""
    e = round(math.log2(factor))
    return f"{factor:g}" if e >= 0 else f"2^{e}"


def undo_host_scales(outputs: Mapping[str, np.ndarray],
                     host_scales: Mapping[str, float]) -> dict[str, np.ndarray]:
    """The device's outputs with each host-scaled one multiplied back (in FP32).

    `host_scales` is the convert report's "host_scales" (output -> factor, a power of two).
    """
    return {name: (np.asarray(value, dtype=np.float32) * np.float32(host_scales[name])
                   if name in host_scales else value)
            for name, value in outputs.items()}
