"""Target profiles: YAML files declaring what a deployment target runs and how it overflows."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from npuprep.errors import NpuprepError
from npuprep.numerics import ALL_DTYPE_NAMES, Int8Activations, NumberFormat, formats, get_format
from npuprep.ops import LAUNCH_CLASSES, LAYOUT_OPS, launch_class
from npuprep.profile_names import builtin_dir, builtin_names
from npuprep.yaml_io import YamlReader, read_yaml


class OverflowMode(enum.StrEnum):
    INF = "inf"
    NAN = "nan"
    SATURATE = "saturate"
    UNKNOWN = "unknown"


class Pinning(enum.StrEnum):
    PER_NODE = "per_node"
    NONE = "none"
    COMPILER_DECIDES = "compiler_decides"


class ControlFlow(enum.StrEnum):
    SUPPORTED = "supported"
    NONE = "none"


class Severity(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Severity:
        try:
            return cls[text.upper()]
        except KeyError:
            raise NpuprepError(f"unknown severity '{text}' (use info, warning or error)") from None


SEVERITY_KEYS = ("overflow", "headroom", "underflow", "unsupported_dtype", "slow_dtype", "hazard")
DEFAULT_SEVERITY = {
    "overflow": Severity.ERROR,
    "headroom": Severity.WARNING,
    "underflow": Severity.WARNING,
    "unsupported_dtype": Severity.ERROR,
    "slow_dtype": Severity.WARNING,
    "hazard": Severity.WARNING,
}


# Formats a throughput figure may be given for (TOPS for the integer ones).
THROUGHPUT_FORMATS = ("fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")


@dataclass(frozen=True)
class Throughput:
    """Dense peak per format (TFLOPS, or TOPS for integers) of the unit that runs the model,
    and memory bandwidth (GB/s); None where the vendor publishes none (ask the vendor)."""

    unit: str = ""
    peak_tflops: dict[str, float | None] = field(default_factory=dict)
    bandwidth_gbs: float | None = None
    # Sustained share of each format's peak (measured GEMMs reach ~0.75 of a datasheet peak)
    # and of the bandwidth (key `bandwidth`); 1 where nothing was measured, over 1 where a
    # published figure understates the die. `npuprep ledger --measured` fits them.
    efficiency: dict[str, float] = field(default_factory=dict)
    launch_us: float = 0.0  # per executed node: kernel launch or NPU dispatch
    # Per launch class (ops.LAUNCH_CLASSES) where it differs from `launch_us`; views (class
    # `view`) launch nothing unless listed here.
    launch_us_by_class: dict[str, float] = field(default_factory=dict)
    run_us: float = 0.0  # per inference: submitting the run and waiting for its end
    # Layout ops this backend makes views (eager torch's Transpose is a strided view): they
    # move nothing and launch as class `view`.
    view_ops: frozenset[str] = frozenset()
    fuses_elementwise: bool = False  # the compiler folds activations into their producer
    # Where a figure is unknown: the FP32 ridge point (FLOPs per byte) and each format's peak
    # over FP32's, as [low, high] ranges with a source: the ledger's speed-up ranges.
    assumed_ridge_fp32: tuple[float, float] | None = None
    assumed_peak_vs_fp32: dict[str, tuple[float, float]] = field(default_factory=dict)

    def peak(self, fmt: str) -> float | None:
        return self.peak_tflops.get(fmt)

    def launch_of(self, launch_class: str) -> float:
        """Microseconds one node of `launch_class` costs to launch."""
        if launch_class in self.launch_us_by_class:
            return self.launch_us_by_class[launch_class]
        return 0.0 if launch_class == "view" else self.launch_us

    def launch_class_of(self, op_type: str) -> str:
        return "view" if op_type in self.view_ops else launch_class(op_type)

    def efficiency_of(self, fmt: str) -> float:
        return self.efficiency.get(fmt, 1.0)

    def bandwidth_efficiency(self, fmt: str) -> float:
        """The bandwidth share a node in `fmt` reaches: `bandwidth_<fmt>` where a fit set one
        (a CPU without FP16 kernels converts as it goes), else `bandwidth`."""
        return self.efficiency.get(f"bandwidth_{fmt}", self.efficiency_of("bandwidth"))

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "unit": self.unit,
            "peak_tflops": {k: "unknown" if v is None else v for k, v in self.peak_tflops.items()},
            "bandwidth_gbs": "unknown" if self.bandwidth_gbs is None else self.bandwidth_gbs}
        if self.efficiency:
            doc["efficiency"] = dict(self.efficiency)
        if self.launch_us:
            doc["launch_us"] = self.launch_us
        if self.launch_us_by_class:
            doc["launch_us_by_class"] = dict(self.launch_us_by_class)
        if self.run_us:
            doc["run_us"] = self.run_us
        if self.view_ops:
            doc["view_ops"] = sorted(self.view_ops)
        if self.fuses_elementwise:
            doc["fuses_elementwise"] = True
        if self.assumed_ridge_fp32 or self.assumed_peak_vs_fp32:
            doc["assumed"] = {
                **({"ridge_fp32": list(self.assumed_ridge_fp32)} if self.assumed_ridge_fp32 else {}),
                **({"peak_vs_fp32": {k: list(v) for k, v in self.assumed_peak_vs_fp32.items()}}
                   if self.assumed_peak_vs_fp32 else {})}
        return doc


@dataclass(frozen=True)
class TargetProfile:
    """What a deployment target runs fast, what it lacks, and how it overflows."""

    name: str
    description: str
    fast_dtypes: tuple[str, ...]
    supported_dtypes: tuple[str, ...]
    slow_dtypes: tuple[str, ...]
    unsupported_dtypes: tuple[str, ...]
    default_precision: str
    overflow: OverflowMode
    fp32_pinning: Pinning
    fp8_saturate: bool | None = None
    int8_activations: Int8Activations = Int8Activations.UNKNOWN
    accumulate: str = "unknown"
    subnormals: str = "unknown"
    keeps_fp32_ops: tuple[str, ...] = ()
    headroom: float = 0.5
    severity: dict[str, Severity] = field(default_factory=lambda: dict(DEFAULT_SEVERITY))
    compiler_name: str = ""
    report_format: str = "generic"
    input_shapes: str = "dynamic"
    input_layout: str = "any"
    # `none`: the compiler refuses If nodes or cannot pin inside them; convert removes them.
    control_flow: ControlFlow = ControlFlow.SUPPORTED
    sources: dict[str, str] = field(default_factory=dict)
    throughput: Throughput = field(default_factory=Throughput)
    path: str = ""

    def precision_of(self, asked: str | None) -> str:
        """The precision a run computes in: `asked` (`--precision`), else the profile's default.
        A name, so 8-bit ones (int8, which has no NumberFormat) resolve here too."""
        return asked or self.default_precision

    def resolve(self, precision: str | None = None) -> ResolvedTarget:
        """This profile with the format a run computes in (`precision`, else the default).

        The only way to a format: the profile offers no format, limit or overflow mode of its
        own, so nothing downstream can read the default after a command chose another."""
        return ResolvedTarget(self, get_format(self.precision_of(precision)))

    def to_dict(self) -> dict[str, Any]:
        """The profile as YAML-ready data, in the file's own key layout."""
        return {
            "name": self.name,
            "description": self.description,
            "dtypes": {
                "fast": list(self.fast_dtypes),
                "supported": list(self.supported_dtypes),
                "slow": list(self.slow_dtypes),
                "unsupported": list(self.unsupported_dtypes),
            },
            "default_precision": self.default_precision,
            "overflow": str(self.overflow),
            "fp8_saturate": "unknown" if self.fp8_saturate is None else self.fp8_saturate,
            "int8_activations": str(self.int8_activations),
            "accumulate": self.accumulate,
            "subnormals": self.subnormals,
            "fp32_pinning": str(self.fp32_pinning),
            "keeps_fp32_ops": list(self.keeps_fp32_ops),
            "headroom": self.headroom,
            "severity": {k: str(v) for k, v in self.severity.items()},
            "compiler": {"name": self.compiler_name, "report_format": self.report_format},
            "inputs": {"shapes": self.input_shapes, "layout": self.input_layout},
            "control_flow": str(self.control_flow),
            "throughput": self.throughput.to_dict(),
            "sources": dict(self.sources),
        }


@dataclass(frozen=True)
class ResolvedTarget:
    """A profile and the format one run computes in, resolved once at the top of a command and
    passed down: every stage reads the format, its limit and the overflow mode from here."""

    profile: TargetProfile
    fmt: NumberFormat

    @property
    def weights(self) -> NumberFormat:
        """The format the ONNX artefact stores: FP8 targets get FP16 weights (the lowering
        writes FP16 and the compiler quantises)."""
        return self.fmt if self.fmt.name in ("fp16", "bf16") else get_format("fp16")

    @property
    def saturate(self) -> bool:
        """Overflow behaviour to emulate in `fmt`: saturate only when the profile says so
        (`unknown` is emulated as the loud case; reports tell the user to probe)."""
        return self.saturates_in(self.fmt)

    def saturates_in(self, fmt: NumberFormat) -> bool:
        """Overflow behaviour in a format this run stores (`weights`, FP16 beside FP8)."""
        if fmt.name.startswith("fp8"):
            return bool(self.profile.fp8_saturate)
        return self.profile.overflow is OverflowMode.SATURATE

    @property
    def limit(self) -> float:
        """Safe magnitude in `fmt`: the profile's headroom x its max finite."""
        return self.limit_in(self.fmt)

    def limit_in(self, fmt: NumberFormat) -> float:
        """Safe magnitude in another format this run stores (`weights`): headroom x its max."""
        return self.profile.headroom * fmt.max


def load_profile(name_or_path: str | Path) -> TargetProfile:
    """Load a built-in profile by name, or a user's profile from a YAML path."""
    text = str(name_or_path)
    path = Path(text)
    if not (text.endswith((".yaml", ".yml")) or path.is_file()):
        if text not in builtin_names():
            known = ", ".join(builtin_names())
            raise NpuprepError(
                f"unknown target '{text}': not a built-in profile ({known}) and not a YAML file"
            )
        path = builtin_dir() / f"{text}.yaml"
    data = read_yaml(path, "target profile")
    return parse_profile(data, str(path))


_TOP_KEYS = {
    "name", "description", "dtypes", "default_precision", "overflow", "fp8_saturate",
    "int8_activations",
    "accumulate", "subnormals", "fp32_pinning", "keeps_fp32_ops", "headroom", "severity",
    "compiler", "inputs", "control_flow", "sources", "throughput",
}
_REQUIRED = ("name", "description", "dtypes", "default_precision", "overflow", "fp32_pinning")


class _Reader(YamlReader):
    def dtype_list(self, value: Any, key: str) -> tuple[str, ...]:
        if value is None:
            return ()
        if not isinstance(value, list):
            raise self.fail(key, f"expected a list of dtype names, got {type(value).__name__}")
        for i, item in enumerate(value):
            self.choice(item, f"{key}[{i}]", ALL_DTYPE_NAMES)
        return tuple(value)


def parse_profile(data: Any, source: str) -> TargetProfile:
    """Validate YAML data as a target profile; `source` names the file in errors."""
    r = _Reader(source)
    if data is None:
        raise NpuprepError(f"{source}: empty target profile")
    top = r.mapping(data, "", _TOP_KEYS)
    for key in _REQUIRED:
        if key not in top:
            raise r.fail(key, "required key is missing")
    dtypes = r.mapping(top["dtypes"], "dtypes", {"fast", "supported", "slow", "unsupported"})
    if "fast" not in dtypes:
        raise r.fail("dtypes.fast", "required key is missing")
    fast = r.dtype_list(dtypes["fast"], "dtypes.fast")
    unsupported = r.dtype_list(dtypes.get("unsupported"), "dtypes.unsupported")
    overlap = set(fast) & set(unsupported)
    if overlap:
        raise r.fail("dtypes.unsupported", f"{', '.join(sorted(overlap))} also listed as fast")
    float_names = tuple(n for n in formats() if n != "fp32")
    precision = r.choice(top["default_precision"], "default_precision", float_names)
    if precision in unsupported:
        raise r.fail("default_precision", f"'{precision}' is listed as unsupported")

    fp8_sat_raw = top.get("fp8_saturate", "unknown")
    if fp8_sat_raw == "unknown" or fp8_sat_raw is None:
        fp8_saturate = None
    elif isinstance(fp8_sat_raw, bool):
        fp8_saturate = fp8_sat_raw
    else:
        raise r.fail("fp8_saturate", f"expected true, false or unknown, got {fp8_sat_raw!r}")

    headroom = top.get("headroom", 0.5)
    if isinstance(headroom, bool) or not isinstance(headroom, int | float):
        raise r.fail("headroom", f"expected a number, got {type(headroom).__name__}")
    if not 0 < headroom <= 1:
        raise r.fail("headroom", f"{headroom} is outside (0, 1]")

    severity = dict(DEFAULT_SEVERITY)
    if "severity" in top:
        sev = r.mapping(top["severity"], "severity", set(SEVERITY_KEYS))
        for k, v in sev.items():
            severity[k] = Severity[r.choice(v, f"severity.{k}", ("info", "warning", "error")).upper()]

    compiler = r.mapping(top.get("compiler", {}) or {}, "compiler", {"name", "report_format"})
    report_format = r.choice(
        compiler.get("report_format", "generic"),
        "compiler.report_format",
        ("trt_json", "horizon", "rknn", "openvino", "generic"),
    )
    inputs = r.mapping(top.get("inputs", {}) or {}, "inputs", {"shapes", "layout"})
    sources = r.mapping(top.get("sources", {}) or {}, "sources")
    for k, v in sources.items():
        r.string(v, f"sources.{k}")

    throughput = _throughput(r, top.get("throughput"), sources)
    return TargetProfile(
        name=r.string(top["name"], "name"),
        description=r.string(top["description"], "description"),
        fast_dtypes=fast,
        supported_dtypes=r.dtype_list(dtypes.get("supported"), "dtypes.supported"),
        slow_dtypes=r.dtype_list(dtypes.get("slow"), "dtypes.slow"),
        unsupported_dtypes=unsupported,
        default_precision=precision,
        overflow=OverflowMode(r.choice(top["overflow"], "overflow", tuple(m.value for m in OverflowMode))),
        fp32_pinning=Pinning(
            r.choice(top["fp32_pinning"], "fp32_pinning", tuple(p.value for p in Pinning))
        ),
        fp8_saturate=fp8_saturate,
        int8_activations=Int8Activations(r.choice(
            top.get("int8_activations", "unknown"), "int8_activations",
            tuple(a.value for a in Int8Activations))),
        accumulate=r.choice(top.get("accumulate", "unknown"), "accumulate", ("fp32", "fp16", "unknown")),
        subnormals=r.choice(top.get("subnormals", "unknown"), "subnormals", ("keep", "flush", "unknown")),
        keeps_fp32_ops=r.strings(top.get("keeps_fp32_ops"), "keeps_fp32_ops"),
        headroom=float(headroom),
        severity=severity,
        compiler_name=r.string(compiler.get("name", ""), "compiler.name"),
        report_format=report_format,
        input_shapes=r.choice(inputs.get("shapes", "dynamic"), "inputs.shapes", ("fixed", "dynamic")),
        input_layout=r.choice(inputs.get("layout", "any"), "inputs.layout", ("any", "nchw", "nhwc")),
        control_flow=ControlFlow(r.choice(top.get("control_flow", "supported"), "control_flow",
                                          tuple(c.value for c in ControlFlow))),
        sources={str(k): v for k, v in sources.items()},
        throughput=throughput,
        path=source,
    )


def _figure(r: _Reader, value: Any, key: str) -> float | None:
    """A published figure, or `unknown` (None)."""
    if value is None or value == "unknown":
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise r.fail(key, f"expected a positive number or unknown, got {value!r}")
    return float(value)


def _throughput(r: _Reader, value: Any, sources: dict[str, Any]) -> Throughput:
    """`throughput:`; every published figure needs `sources.peak` / `sources.bandwidth`."""
    if value is None:
        return Throughput()
    top = r.mapping(value, "throughput", {"unit", "peak_tflops", "bandwidth_gbs", "efficiency",
                                          "launch_us", "launch_us_by_class", "run_us", "view_ops",
                                          "fuses_elementwise", "assumed"})
    peaks = r.mapping(top.get("peak_tflops", {}) or {}, "throughput.peak_tflops",
                      set(THROUGHPUT_FORMATS))
    peak = {str(k): _figure(r, v, f"throughput.peak_tflops.{k}") for k, v in peaks.items()}
    bandwidth = _figure(r, top.get("bandwidth_gbs"), "throughput.bandwidth_gbs")
    if any(v is not None for v in peak.values()) and "peak" not in sources:
        raise r.fail("sources.peak", "a published peak needs its source (datasheet name or URL)")
    if bandwidth is not None and "bandwidth" not in sources:
        raise r.fail("sources.bandwidth", "a published bandwidth needs its source")
    effs = r.mapping(top.get("efficiency", {}) or {}, "throughput.efficiency",
                     {*THROUGHPUT_FORMATS, "bandwidth", *(f"bandwidth_{f}" for f in THROUGHPUT_FORMATS)})
    efficiency = {str(k): _share(r, v, f"throughput.efficiency.{k}") for k, v in effs.items()}
    launch = _microseconds(r, top.get("launch_us", 0.0), "throughput.launch_us")
    classes = r.mapping(top.get("launch_us_by_class", {}) or {}, "throughput.launch_us_by_class",
                        set(LAUNCH_CLASSES))
    by_class = {str(k): _microseconds(r, v, f"throughput.launch_us_by_class.{k}")
                for k, v in classes.items()}
    run_us = _microseconds(r, top.get("run_us", 0.0), "throughput.run_us")
    views = r.strings(top.get("view_ops"), "throughput.view_ops")
    for op in views:
        if op not in LAYOUT_OPS:
            raise r.fail("throughput.view_ops", f"{op!r} is not a layout op ({', '.join(sorted(LAYOUT_OPS))})")
    fuses = top.get("fuses_elementwise", False)
    if not isinstance(fuses, bool):
        raise r.fail("throughput.fuses_elementwise", f"expected true or false, got {fuses!r}")
    if fuses and "fusion" not in sources:
        raise r.fail("sources.fusion", "fuses_elementwise needs its source (the compiler's documentation)")
    if (efficiency or launch or by_class or run_us) and "efficiency" not in sources:
        raise r.fail("sources.efficiency", "a sustained efficiency or launch cost needs its source "
                                           "(a measurement: `npuprep ledger --measured` writes one)")
    assumed = r.mapping(top.get("assumed", {}) or {}, "throughput.assumed", {"ridge_fp32", "peak_vs_fp32"})
    ridge = _range(r, assumed["ridge_fp32"], "throughput.assumed.ridge_fp32") if "ridge_fp32" in assumed else None
    ratios = r.mapping(assumed.get("peak_vs_fp32", {}) or {}, "throughput.assumed.peak_vs_fp32",
                       set(THROUGHPUT_FORMATS))
    peak_vs = {str(k): _range(r, v, f"throughput.assumed.peak_vs_fp32.{k}") for k, v in ratios.items()}
    if (ridge or peak_vs) and "assumed" not in sources:
        raise r.fail("sources.assumed", "an assumed range needs its source (the documents it is drawn from)")
    return Throughput(unit=r.string(top.get("unit", ""), "throughput.unit"), peak_tflops=peak,
                      bandwidth_gbs=bandwidth, efficiency=efficiency, launch_us=launch,
                      launch_us_by_class=by_class, run_us=run_us, view_ops=frozenset(views),
                      fuses_elementwise=fuses, assumed_ridge_fp32=ridge, assumed_peak_vs_fp32=peak_vs)


def _microseconds(r: _Reader, value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise r.fail(key, f"expected a number of microseconds >= 0, got {value!r}")
    return float(value)


def _share(r: _Reader, value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise r.fail(key, f"expected a positive share of the figure reached, got {value!r}")
    return float(value)


def _range(r: _Reader, value: object, key: str) -> tuple[float, float]:
    """`[low, high]`, both positive, low <= high."""
    if (not isinstance(value, list) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int | float) or not v > 0 for v in value)
            or value[0] > value[1]):
        raise r.fail(key, f"expected [low, high] with 0 < low <= high, got {value!r}")
    return float(value[0]), float(value[1])
