"""Calibration: every float tensor's range on real samples, computed inside the graph."""

from npuprep.calibrate.executors import calibrate
from npuprep.calibrate.mapping import load_stats
from npuprep.calibrate.merge import merge_stats
from npuprep.calibrate.stats import CalibrationStats, RangeStats, save_stats

__all__ = ["CalibrationStats", "RangeStats", "calibrate", "load_stats", "merge_stats", "save_stats"]
