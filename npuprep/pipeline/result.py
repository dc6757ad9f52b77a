"""What a conversion decided and measured: `ConversionResult` (every format) and `EightBitResult`.

The 8-bit fields are typed here (they used to travel as a dict of string keys); `to_dict`
gives the report's `eight_bit` block. The verdict (`Verdict`) is computed once, by the
pipeline's verdict stage (npuprep.pipeline.verdict.judge), and stored in the result before
anything is written; `passed` reads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from npuprep.analyse.finding import Findings
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import NumberFormat
from npuprep.plan import Plan
from npuprep.plan.remedies import remedied
from npuprep.profiles import TargetProfile
from npuprep.provenance import ConversionRecord
from npuprep.verify.output_check import OutputCheck
from npuprep.verify.second_draw import SecondDraw

if TYPE_CHECKING:
    from npuprep.calibrate.stats import CalibrationStats
    from npuprep.rewrite.lower import Lowered
    from npuprep.verify.compare import CompareResult
    from npuprep.verify.fp32_share import Fp32Share
    from npuprep.verify.qdq_model import Sensitivity
    from npuprep.verify.vendor import VendorCheck
    from npuprep.verify.widening import CurvePoint

SCHEMA_VERSION = 1


class Gate(StrEnum):
    """What a conversion has to meet, in the order they are judged."""

    OUTPUTS = "outputs"  # the outputs on the calibration samples
    HOLDOUT = "holdout"  # the outputs on the held-out samples
    FP32_SHARE = "fp32_share"  # at most --max-fp32-share of the FLOPs left FP32
    EIGHT_BIT_SHARE = "8bit_share"  # at least --min-8bit-share of the multiply-adds in 8 bits
    VENDOR = "vendor"  # the vendor toolchain built it and its simulator's outputs hold


@dataclass(frozen=True)
class Verdict:
    """PASSED, or FAILED at `gate` with `reason` (the gate's failure in one clause) and
    `cause` (what made it fail, "" when nothing more is known than the gate).
    `precision_limited`: the outputs are off by the format's precision alone (no Inf/NaN, no
    overflow): no range remedy changes that; --top-k and --rtol are the user's levers."""

    passed: bool
    gate: Gate | None = None
    reason: str = ""
    cause: str = ""
    precision_limited: bool = False

    @property
    def said(self) -> str:
        """The verdict line: `PASSED`, `FAILED: <reason>`, or `FAILED: <cause>; then <reason>`."""
        if self.passed:
            return "PASSED"
        if self.cause:
            return f"FAILED: {self.cause}" + (f"; then {self.reason}" if self.reason else "")
        return f"FAILED: {self.reason}" if self.reason else "FAILED"

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "gate": self.gate.value if self.gate else None,
                "reason": self.reason, "cause": self.cause,
                "precision_limited": self.precision_limited, "said": self.said}



@dataclass(frozen=True)
class EightBitResult:
    """What an INT8/FP8 conversion chose: the format and its scale rule, the share of the
    Conv/MatMul/Gemm multiply-adds in each format, the layers kept wider and why (their
    ranking by sensitivity, and every choice it tried), and the per-tensor choices."""

    format: str
    scale_rule: str
    saturate: bool
    mac_share: dict[str, float]
    min_8bit_share: float
    sensitivity: tuple[Sensitivity, ...]
    kept_wider: tuple[str, ...]
    rank_runs: int
    kept_wider_cost: float
    tensor_rules: dict[str, str]
    # 8-bit node -> (its balanced input tensor, that input's outlier ratio)
    balanced: dict[str, tuple[str, float]]
    input_shapes: dict[str, tuple[int, ...]]
    # Every choice the search tried: layers kept wider, 8-bit share, outputs' rel L2
    curve: tuple[CurvePoint, ...] = ()
    # (activations written as uint8 with a zero point, activations quantised)
    zero_points: tuple[int, int] = (0, 0)
    # False: the plain start was kept as it is or widened by its own ranking
    # (npuprep.pipeline.plain_start), nothing treated
    searched: bool = True
    # The written model as onnxruntime runs it, its wider layers in FP32: another draw of the
    # 8-bit rounding than the verified FP16 run (npuprep.verify.second_draw)
    as_written: SecondDraw | None = None

    @property
    def share_met(self) -> bool:
        """At least `min_8bit_share` of the multiply-adds run in the 8-bit format."""
        return self.eight_bit_share >= self.min_8bit_share

    @property
    def eight_bit_share(self) -> float:
        """The share of the multiply-adds in 8 bits: the format's, and the target's other
        8-bit format's where some layers took it."""
        return sum(v for k, v in self.mac_share.items() if k not in ("fp16", "fp32"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format, "scale_rule": self.scale_rule, "saturate": self.saturate,
            "mac_share": dict(self.mac_share), "min_8bit_share": self.min_8bit_share,
            "sensitivity": [s.to_dict() for s in self.sensitivity],
            "kept_wider": list(self.kept_wider),
            "rank_runs": self.rank_runs, "kept_wider_cost": self.kept_wider_cost,
            "tensor_rules": dict(sorted(self.tensor_rules.items())),
            "balanced": {x: {"tensor": t, "outlier_ratio": r}
                         for x, (t, r) in sorted(self.balanced.items())},
            "input_shapes": {k: list(v) for k, v in self.input_shapes.items()},
            "curve": [p.to_dict() for p in self.curve],
            "zero_points": {"uint8_with_zero_point": self.zero_points[0],
                            "activations": self.zero_points[1]},
            "searched": self.searched,
            "as_written": self.as_written.to_dict() if self.as_written is not None else None,
        }


@dataclass(frozen=True)
class SampleUse:
    """Which samples a conversion planned and verified on: the calibration part (verified on
    too) and the held-out part, by id (file names, or indices into their source), and the
    sentence that says how they were split ("" when the caller split them)."""

    calibration_ids: tuple[str, ...] = ()
    holdout_ids: tuple[str, ...] = ()
    said: str = ""
    description: str = ""
    synthetic: bool = False
    # Where the calibration ids are from (SampleSet.source_info: the kind and folder or file),
    # so another folder's files of the same names are not taken for them.
    calibration_source: Mapping[str, str | int] = field(default_factory=dict)


@dataclass(frozen=True)
class ConversionResult:
    """Everything `convert` decided and measured; truthy when its verdict passed."""

    source: Model
    profile: TargetProfile
    fmt: NumberFormat
    findings: Findings
    plan: Plan
    rewritten: Any  # onnx.ModelProto, FP32, same function (up to clamps)
    lowered: Lowered
    tensor_scales: dict[str, float]
    pinned_nodes: tuple[str, ...]
    output_check: OutputCheck | None
    layers: CompareResult | None  # the rewritten graph's emulation, layer by layer
    holdout: OutputCheck | None
    flops_fp32_share: float
    rounds: int
    samples: SampleUse
    io_types: str = "fp32"
    stats: CalibrationStats | None = None
    declined: tuple[Any, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    # Outputs that leave the device scaled (target cannot pin): output -> host factor.
    host_scales: dict[str, float] = field(default_factory=dict)
    share: Fp32Share | None = None
    # Per verification round that traced a precision failure to layers (verify.attribution).
    error_attribution: tuple[dict[str, Any], ...] = ()
    ledger: dict[str, Any] | None = None  # npuprep.ledger: estimated time per format, the pins' cost
    eight_bit: EightBitResult | None = None
    vendor: VendorCheck | None = None
    # Set by the verdict stage, before anything is written; the record by the record stage.
    verdict: Verdict | None = None
    record: ConversionRecord | None = None
    # Each float output -> the rule that judged it (top-1 or rel L2, and who chose it).
    judged_by: dict[str, str] = field(default_factory=dict)
    # Inputs the held-out samples drive past the calibration samples' range (holdout.louder_inputs).
    louder_inputs: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        if self.verdict is None:
            raise RuntimeError("the verdict stage has not run on this conversion")
        return self.verdict.passed

    def __bool__(self) -> bool:
        return self.passed

    @property
    def precision(self) -> str:
        """The format the conversion targets: the 8-bit one, else the float one."""
        return self.eight_bit.format if self.eight_bit else self.fmt.name

    @property
    def first_divergent(self) -> Any:
        return None if self.layers is None else self.layers.first_divergent

    def to_dict(self, *, output: str = "") -> dict[str, Any]:
        layers = self.layers.to_dict() if self.layers is not None else None
        verdict = self.verdict.to_dict() if self.verdict is not None else None
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "convert",
            "fingerprint": self.source.fingerprint,
            "output_fingerprint": fingerprint(self.lowered.model),
            "model": self.source.path,
            "output": output,
            "target": self.profile.name,
            "profile": self.profile.to_dict(),
            "precision": self.precision,
            "passed": self.passed,
            "verdict": verdict,
            "judged_by": dict(self.judged_by),
            "failure_cause": verdict["cause"] if verdict else "",
            "samples": {"description": self.samples.description, "synthetic": self.samples.synthetic,
                        "calibration_ids": list(self.samples.calibration_ids),
                        "holdout_ids": list(self.samples.holdout_ids)},
            "gates": self.record.gates.to_dict() if self.record is not None else None,
            # Each finding with what the applied plan did for it, not the rule's suggestion.
            "findings": remedied(self.findings, self.plan, self.host_scales).to_dict(),
            "plan": self.plan.to_dict(),
            "actions": [a.to_dict() for a in self.plan.actions],
            "declined": [d.to_dict() for d in (*self.plan.declined, *self.declined)],
            "pinned_nodes": list(self.pinned_nodes),
            "forced_fp32": dict(sorted(self.lowered.forced_fp32.items())),
            "cast_count": self.lowered.cast_count,
            "flops_fp32_share": self.flops_fp32_share,
            "fp32_share": self.share.to_dict() if self.share is not None else None,
            "fp32_verdict": self.share.verdict() if self.share is not None else "",
            "tensor_scales": dict(sorted(self.tensor_scales.items())),
            "host_scales": dict(sorted(self.host_scales.items())),
            "tensors": self.tensor_rows(),
            "verification": self.output_check.to_dict() if self.output_check is not None else None,
            "holdout": self.holdout.to_dict() if self.holdout is not None else None,
            "first_divergent": layers["first_divergent"] if layers and not self.passed else None,
            "compare": layers,
            "rounds": self.rounds,
            "error_attribution": list(self.error_attribution),
            "ledger": self.ledger,
            "notes": list(self.notes),
        } | ({"eight_bit": self.eight_bit.to_dict()} if self.eight_bit else {}) \
          | ({"vendor": self.vendor.to_dict()} if self.vendor is not None else {})

    def save(self, path: str | Path, *, exports: Sequence[str] | None = None,
             report_path: str | Path | None = None, html: str | Path | None = None,
             protected: Sequence[str | Path] = ()) -> dict[str, Any]:
        """Write what `npuprep convert` writes: the model at `path` (at `<path>.FAILED.onnx`
        when the conversion failed: npuprep.pipeline.artefacts), `<path>.plan.yaml`,
        `<path>.report.json`, `<path>.report.md`, and the constraint files of `exports`
        (None: the target compiler's; names in npuprep.pipeline.artefacts.EXPORTS); an earlier
        conversion's files for `path` that this set does not write are removed with it.
        Returns the report, its `artefacts` naming every file written."""
        from npuprep.pipeline.artefacts import save_conversion

        return save_conversion(self, path, exports=exports, report_path=report_path, html=html,
                               protected=protected)

    def tensor_rows(self) -> list[dict[str, Any]]:
        """Every compared tensor: abs-max before (calibration of the original) and after (what
        the converted model stores, emulated), and the precision it is stored in."""
        if self.layers is None:
            return []
        from npuprep.graph import node_label, producers, walk_graphs

        made_by: dict[str, str] = {}
        for scope in walk_graphs(self.rewritten.graph):
            made_by.update({t: node_label(n) for t, n in producers(scope.graph).items()})
        pinned = set(self.pinned_nodes)
        measured = self.stats.tensors if self.stats is not None else {}
        fmt_max = self.fmt.max
        rows = []
        for t in self.layers.tensors:
            before = measured[t.tensor].absmax if t.tensor in measured else t.ref_absmax
            stored = "fp32" if made_by.get(t.tensor) in pinned else self.fmt.name
            rows.append({
                "tensor": t.tensor, "node": t.node, "op_type": t.op_type,
                "absmax_before": before, "absmax_after": t.cand_absmax, "stored_as": stored,
                "headroom_before": fmt_max / before if before else None,
                "headroom_after": (fmt_max / t.cand_absmax if t.cand_absmax else None)
                if stored != "fp32" else None,
                "scale": t.scale,
            })
        return rows
