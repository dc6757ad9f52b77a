"""The host-side output scales as a YAML block appended to the constraint files.

    y: 4.0   ->   "# ... multiply on the host" + host_scales: {"y": 4.0}
"""

from __future__ import annotations

import json
from collections.abc import Mapping


def host_scales_block(host_scales: Mapping[str, float]) -> str:
    """YAML lines stating the factor each scaled output must be multiplied by on the host."""
    if not host_scales:
        return ""
    lines = [
        "# host-side output scaling: these outputs leave the device divided by the factor",
        "# (their true range lies outside the target's format); multiply them by it on the host,",
        "# e.g. npuprep.plan.host_scale.undo_host_scales(outputs, host_scales).",
        "host_scales:",
    ]
    lines += [f"  {json.dumps(name)}: {factor!r}" for name, factor in sorted(host_scales.items())]
    return "\n".join(lines) + "\n"
