"""The statistics row of one tensor-sample and the wiring state of the graph instrumentation.

    row = [count, detailed, nan, over_fp16, over_bf16, over_fp8_e4m3, over_fp8_e5m2, hist[279]]

npuprep.calibrate.instrument appends the reductions, npuprep.calibrate.detail builds the
counts and the exponent histogram, npuprep.calibrate.stats reads the rows back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onnx import TensorProto

from npuprep.numerics import get_format

# Element types of the FX, FN, I, L1 outputs.
ELEMS = (TensorProto.FLOAT, TensorProto.FLOAT, TensorProto.INT64, TensorProto.FLOAT)
# Formats whose max gets an exact count of |x| above it.
OVER_FORMATS = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
HIST_OFFSET = 150  # bin = floor(log2|x|) + 150; 0 holds zeros, 278 Inf and NaN
HIST_BINS = 279
# Zeros and subnormals are binned again scaled by 2^SUBNORMAL_SHIFT, which makes every
# subnormal a normal float exactly.
SUBNORMAL_SHIFT = 64
HEADER = ("count", "detailed", "nan") + tuple(f"over_{f}" for f in OVER_FORMATS)
WIDTH = len(HEADER) + HIST_BINS
# "detailed" count of a tensor-sample that needed the detail but was built without it (< 0
# also after a Loop/Scan body sums it over iterations).
FLAGGED = -1
# Ordinary range of abs-max (see module docstring): every format's max is above HI, and
# min_normal / eps <= LO for fp16 (2^-4), fp8_e4m3 (2^-3), fp8_e5m2 (2^-12), bf16.
LO = 2.0**-3
HI = 2.0**6
# Below this abs-max no value is above any format's max (fp8_e4m3's 448).
SMALLEST_MAX = min(get_format(f).max for f in OVER_FORMATS)


@dataclass(frozen=True)
class Scope:
    """The formats a calibration is exact for, and the ordinary range of abs-max that follows.

    A tensor-sample with lo <= abs-max <= hi (and finite) gets no detail: no value is above
    any of `formats`' max (hi < smallest_max) and whatever lies under a format's smallest
    normal lies under the tensor's own precision floor (lo >= min_normal / eps). `hi` stays a
    power of two at most half the smallest max, so the share above the profiles' headroom
    limit (0.5 x max) is read from the histogram exactly (RangeStats.fraction_above).
    """

    name: str
    lo: float
    hi: float
    formats: tuple[str, ...]

    @property
    def smallest_max(self) -> float:
        return min(get_format(f).max for f in self.formats)

    def range_of(self, narrow: bool) -> tuple[float, float]:
        """(lo, hi) of a row: a narrow row keeps the "auto" range (see Slot.narrow)."""
        return (LO, HI) if narrow else (self.lo, self.hi)


# "auto" (and "all", which details everything): exact for every format in OVER_FORMATS.
# "fp16": exact for FP16 and BF16 only (an FP16 or BF16 conversion reads nothing else): a
# conv net on raw 0..255 pixels holds activations of ~1e3 in every layer, past FP8's max,
# which the "auto" scope would detail everywhere (issue 37: 10x the calibration's time).
SCOPES = {
    "auto": Scope("auto", LO, HI, OVER_FORMATS),
    "all": Scope("all", LO, HI, OVER_FORMATS),
    "fp16": Scope("fp16", 2.0**-4, 2.0**14, ("fp16", "bf16")),
}
DETAILS = tuple(SCOPES)


def scope_of(detail: str) -> Scope:
    """The Scope of a calibration's `detail` ("auto", "all", "fp16")."""
    if detail not in SCOPES:
        raise ValueError(f"detail must be one of {', '.join(DETAILS)}, got {detail!r}")
    return SCOPES[detail]


@dataclass(frozen=True)
class Slot:
    """One observed tensor: its row in the FX/FN/I outputs."""

    tensor: str
    scope: str
    node: str
    # True when no gate in the graph decides whether the row is ordinary: the caller checks
    # abs-max and the L1 output and flags it (see Instrumented.ordinary).
    gated_outside: bool = False
    # True when the row keeps the "auto" ordinary range whatever the scope (a tensor on its
    # way into a Log, see instrument.log_chains).
    narrow: bool = False


@dataclass
class Wiring:
    types: dict[str, int]
    shapes: dict[str, tuple[int, ...]]
    opset: int
    detail: str  # "auto" or "all" (a scope's name picks its range: `scope`)
    scope: Scope = SCOPES["auto"]
    # Main-graph tensors that keep the "auto" ordinary range in a wider scope.
    narrow: frozenset[str] = frozenset()
    detailed: frozenset[str] | None = None
    nan_checked: frozenset[str] | None = None
    lean: frozenset[str] = frozenset()
    # The tensors to observe (None: every float tensor): a pass that fills in a few tensors
    # instruments only those, so its session is a fraction of a whole calibration's to build.
    only: frozenset[str] | None = None
    loop_depth: int = 0
    nchwc: set[str] = field(default_factory=set)
    minmax: dict[str, tuple[str, str]] = field(default_factory=dict)
    scalars: dict[str, float] = field(default_factory=dict)
    channels: set[int] = field(default_factory=set)
    # Pooled tensor -> its per-channel max and per-channel max of -x ([1, C, 1, 1] each).
    channel_extremes: dict[str, tuple[str, str]] = field(default_factory=dict)
    known_finite: set[str] = field(default_factory=set)
    # Known constants whose values are all finite and >= 0.
    known_nonneg: set[str] = field(default_factory=set)
    trusting: dict[str, tuple[str, ...]] = field(default_factory=dict)
    counter: int = 0
    sizes: set[int] = field(default_factory=set)
    ones: set[int] = field(default_factory=set)
    aliases: dict[str, Slot] = field(default_factory=dict)
    alias_of: dict[str, str] = field(default_factory=dict)
    unobserved: dict[str, str] = field(default_factory=dict)

    def name(self, stem: str) -> str:
        self.counter += 1
        return f"__npuprep_{stem}_{self.counter}"
