"""Calibration: every float tensor's range on real samples, computed inside the graph."""

from npuprep.calibrate.merge import merge_stats
from npuprep.calibrate.run import calibrate
from npuprep.calibrate.stats import CalibrationStats, RangeStats, load_stats, save_stats

__all__ = ["CalibrationStats", "RangeStats", "calibrate", "load_stats", "merge_stats", "save_stats"]
