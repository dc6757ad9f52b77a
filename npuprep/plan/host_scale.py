"""Host-side output scaling: which graph outputs leave the device scaled by 2^-k (decision only).

    output y (true range 1.1e5 > limit), rescale exit Mul(y', 4) on a target that cannot
    pin -> y leaves the device as y' = y / 4; the host multiplies by 4

A rescale absorbed "at a graph output" ends in a compensating Mul that must run in FP32
to hold the output's true range. A target whose compiler runs every node in FP16
(`fp32_pinning: none`) runs that Mul in FP16 too and gives Inf, so the compensation moves
to the host, where the user's code (or `undo_host_scales`) multiplies the output back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from npuprep.profiles import Pinning, TargetProfile


def host_scaled_outputs(exits: Iterable[str], absmax: Mapping[str, float],
                        profile: TargetProfile) -> dict[str, str]:
    """Outputs (among rescale exits) to leave scaled on the device, each with the reason.

    Only for targets that cannot pin, and only where the output's true range exceeds the
    profile's safe limit: an output that fits keeps its compensation on the device.
    """
    if profile.fp32_pinning is not Pinning.NONE:
        return {}
    limit = profile.limit()
    return {
        name: (f"true range {absmax[name]:.4g} exceeds the limit {limit:.6g} and target "
               f"{profile.name} runs the compensating Mul in {profile.default_precision}")
        for name in exits if absmax.get(name, 0.0) > limit
    }


def undo_host_scales(outputs: Mapping[str, np.ndarray],
                     host_scales: Mapping[str, float]) -> dict[str, np.ndarray]:
    """The device's outputs with each host-scaled one multiplied back (in FP32).

    `host_scales` is the convert report's "host_scales" (output -> factor, a power of two).
    """
    return {name: (np.asarray(value, dtype=np.float32) * np.float32(host_scales[name])
                   if name in host_scales else value)
            for name, value in outputs.items()}
