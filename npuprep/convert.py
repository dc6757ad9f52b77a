"""`from npuprep.convert import convert`: the conversion pipeline, where users have imported it from.

The pipeline itself is npuprep/pipeline/ (its stages in stages.py).
"""

from npuprep.pipeline import CALIBRATE, SPLIT, ConversionResult, convert
from npuprep.pipeline.stages import DEFAULT_RTOL

__all__ = ["CALIBRATE", "DEFAULT_RTOL", "SPLIT", "ConversionResult", "convert"]
