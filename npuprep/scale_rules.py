"""The rules that place an 8-bit clip (no heavy imports: the CLI's `--scale-rule` lists them
before anything else is loaded). npuprep.calibrate.scales computes each rule's clip."""

from __future__ import annotations

from enum import StrEnum


class ScaleRule(StrEnum):
    """Where an 8-bit activation clip is placed: at the measured abs-max, at the 99.99th
    percentile of |x|, or where the expected squared error is least. The values are the
    CLI's `--scale-rule` words and what reports and plans record."""

    ABSMAX = "absmax"
    PERCENTILE = "percentile"
    MSE = "mse"


DEFAULT_RULE = ScaleRule.PERCENTILE
