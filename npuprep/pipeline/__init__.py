"""One conversion pipeline for every format: `convert(model, profile, samples, ...)` (see stages.py)."""

from npuprep.pipeline.result import ConversionResult, EightBitResult, Gate, Verdict
from npuprep.pipeline.stages import CALIBRATE, SPLIT, STAGES, convert, draft_plan

__all__ = ["CALIBRATE", "SPLIT", "STAGES", "ConversionResult", "EightBitResult", "Gate",
           "Verdict", "convert", "draft_plan"]
