"""The cause of a failed conversion, for the first words of its FAILED line: `underflow: logits ... ; then <gate>`.

The gate that tripped (outputs off, the FP32 share over its limit) is where a failure shows,
not why it happened. A classifier whose logits live at 1e-9 fails because FP16 flushes
them, whichever gate trips: when a failing output (or the weights that kept a costly island
FP32) traces to an underflow the plan could not lift, that is named first.
"""

from __future__ import annotations

import re
from typing import Any

from npuprep.numerics import get_format
from npuprep.report.output_verdicts import output_passes

_BEYOND = re.compile(r"weight '([^']+)' reaches ([0-9.e+-]+), beyond")


def failure_cause(report: dict[str, Any]) -> str:
    """One clause naming the underflow behind a failed conversion, or "" when none shows."""
    if report.get("passed"):
        return ""
    return _underflowing_output(report) or _weights_pushed_up(report) or _needs_a_pin(report)


def _needs_a_pin(report: dict[str, Any]) -> str:
    """A hazard the plan found that only an FP32 pin fixes, on a target that cannot pin: a
    note (a coarse phase), or the floor of a Log chain scaled into the format."""
    said = [*report.get("plan", {}).get("notes", []),
            *(a["why"] for a in report.get("actions", []) if a["action"] == "clamp")]
    found = next((n for n in said if "only an FP32 pin" in n), "")
    # A clamp's why opens with the Log input's span: the pin is what the line must say.
    return found[found.find("target "):] if found.startswith("the input") else found


def _underflowing_output(report: dict[str, Any]) -> str:
    fmt = get_format(report["precision"])
    findings = {f["tensor"]: f for f in report.get("findings", [])
                if f.get("rule") == "range.underflow" and f.get("tensor")}
    notes = report.get("plan", {}).get("notes", [])
    for key in ("verification", "holdout"):
        check = report.get(key) or {}
        for name, errors in (check.get("outputs") or {}).items():
            f = findings.get(name)
            if f is None or output_passes(errors, check["rtol"]):
                continue
            absmax = f["evidence"].get("absmax", 0.0)
            declined = [d["reason"] for d in report.get("declined", [])
                        if any(r.get("tensor") == name for r in d.get("findings", []))]
            # A scale up that would push weights past the format is the telling decline.
            why = next((f"(rescale declined: {r})" for r in declined if "past" in r), "") or next(
                (n.split("underflow left as is ", 1)[1] for n in notes
                 if n.startswith(f"range.underflow at {name}:") and "underflow left as is " in n),
                "")
            return (f"underflow: output {name} lives at |x| <= {absmax:.3g}, under the smallest "
                    f"{fmt.name} normal ({fmt.min_normal:.3g}), and comes out with rel L2 "
                    f"{errors['rel_l2']:.3g}" + (f" {why}" if why else ""))
    return ""


def _weights_pushed_up(report: dict[str, Any]) -> str:
    """Weights a rescale up (an underflow's remedy) pushed past the format, kept FP32."""
    fmt = get_format(report["precision"])
    ups = [a for a in report.get("actions", []) if a["action"] == "rescale" and a["k"] < 0]
    if not ups:
        return ""
    nodes = {n for a in ups for n in (a["entry"], *a["absorbers"])}
    pushed = [(node, m.group(1), float(m.group(2)))
              for node, why in report.get("forced_fp32", {}).items()
              if node in nodes and (m := _BEYOND.search(why))]
    if not pushed:
        return ""
    values = sorted(v for _, _, v in pushed)
    return (f"underflow: lifting {', '.join(a['entry'] for a in ups)} out of {fmt.name}'s "
            f"subnormals pushes weights of {', '.join(sorted({n for n, _, _ in pushed}))} past "
            f"{fmt.name} ({values[0]:.6g} .. {values[-1]:.6g}), which keeps them FP32")
