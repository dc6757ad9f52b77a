"""The written 8-bit model as onnxruntime runs it: a second draw of its rounding.

    verified:    QDQ model, every wider tensor rounded to FP16  -> OutputCheck (the gate's)
    second draw: QDQ model as written, wider tensors in FP32    -> OutputCheck (reported)

The emulation is one draw of the 8-bit rounding: which way each activation rounds at a
QuantizeLinear depends on the low bits of its input, and those differ between the emulated
FP16 run, the file run by onnxruntime (what a user checks it with) and the board's own FP16
kernels (accumulation order, fused ops). On most models the draws err alike. Where the point
sits on a knife edge they do not (PP-OCRv4 rec INT8: calibration rel L2 0.049 emulated, 0.095
as written, one text of eight changed), and no gate on one draw can show it. The gate stays on
the emulation, what the board computes; this run says how much the verdict depends on the draw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from npuprep.data import Feed
from npuprep.detections import Decision
from npuprep.verify.output_check import OutputCheck, check_output_sets
from npuprep.verify.output_errors import output_passes

# A second draw erring this many times the verified run's error is said, passing or not.
DRAW_RATIO = 2.0


@dataclass(frozen=True)
class SecondDraw:
    """The written model's outputs as onnxruntime computes them (its wider tensors in FP32)
    against the FP32 reference: on the calibration samples and, where given, the held-out
    ones. Truthy when every output passes there as the verified run's rule judges it."""

    calibration: OutputCheck
    holdout: OutputCheck | None = None

    def __bool__(self) -> bool:
        return bool(self.calibration) and (self.holdout is None or bool(self.holdout))

    def to_dict(self) -> dict[str, Any]:
        return {"passed": bool(self), "calibration": self.calibration.to_dict(),
                "holdout": self.holdout.to_dict() if self.holdout is not None else None}


def second_draw(reference: onnx.ModelProto, written: onnx.ModelProto,
                calibration: Sequence[Feed], holdout: Sequence[Feed] | None, *, rtol: float,
                top_k: Mapping[str, Decision],
                expected: Sequence[dict[str, np.ndarray]] = ()) -> SecondDraw:
    """`written` (a QDQ model, FP32 between its pairs) run as it is, with onnxruntime's basic
    optimisations (its default fusions compute some Q/DQ pairs otherwise), on `calibration`
    and `holdout`, its outputs judged against `reference`'s as the gate judges them (`rtol`,
    `top_k`). `expected`: the reference's outputs on the first samples (calibration, then
    held-out), already run."""
    from npuprep.numerics import get_format

    sets = [calibration] + ([holdout] if holdout is not None else [])
    checks = check_output_sets(reference, written, get_format("fp32"), sets, saturate=False,
                               rtol=rtol, emulated=written, top_k=top_k, expected=expected)
    return SecondDraw(checks[0], checks[1] if holdout is not None else None)


def second_draw_notes(verified: OutputCheck, held: OutputCheck | None,
                      drawn: SecondDraw) -> list[str]:
    """A note for each sample set where the second draw fails what the verified run passes,
    or errs DRAW_RATIO x as much; none where the draws agree."""
    notes = []
    for which, first, second in (("calibration", verified, drawn.calibration),
                                 ("held-out", held, drawn.holdout)):
        if first is None or second is None:
            continue
        lost = [name for name, o in second.outputs.items()
                if name in first.outputs and output_passes(first.outputs[name], first.rtol)
                and not output_passes(o, second.rtol)]
        worse = second.worst_rel_l2 >= DRAW_RATIO * max(first.worst_rel_l2, 1e-12)
        if not lost and not worse:
            continue
        changed = [f"'{name}' {_changed(second.outputs[name])}" for name in lost
                   if "top_k" in second.outputs[name]]
        fails = ("; it fails there: " + ", ".join(changed or [f"'{n}'" for n in lost])
                 if lost else "")
        notes.append(
            f"the written model as onnxruntime runs it (its wider layers in FP32: another draw "
            f"of the 8-bit rounding, as the board's FP16 kernels are) errs "
            f"{second.worst_rel_l2:.3g} on the {which} samples, where the verified FP16 run errs "
            f"{first.worst_rel_l2:.3g}{fails}. The verdict depends on the rounding draw: "
            f"check the board on more samples (--holdout; `npuprep checklist`)")
    return notes


def _changed(errors: Mapping[str, Any]) -> str:
    """`changed decisions at 1 of 8 samples` for a decided output's row (its CTC texts or
    top-K positions)."""
    positions = int(errors.get("top_k_positions", 0))
    changed = round((1.0 - float(errors.get("top_k_agreement", 1.0))) * positions)
    unit = "texts" if errors.get("ctc_text") else "positions"
    return f"changes {changed} of {positions} decided {unit}"
