"""Dtypes the target lacks: BF16/FP64 initialisers, Casts and tensors (`dtype.unsupported`, `dtype.slow`)."""

from __future__ import annotations

from npuprep.analyse.context import Context
from npuprep.analyse.finding import Finding
from npuprep.graph import attribute, node_label
from npuprep.numerics import FLOAT_ONNX_TYPES
from npuprep.profiles import Severity, TargetProfile

_LISTED_NAMES = 20


def _verdict(profile: TargetProfile, dtype: str) -> tuple[str, Severity, str] | None:
    """(rule, severity, how the profile lists it) for a dtype the target does not run well."""
    if dtype in profile.fast_dtypes or dtype in profile.supported_dtypes:
        return None
    if dtype in profile.slow_dtypes:
        return "dtype.slow", profile.severity["slow_dtype"], "slow"
    listed = "unsupported" if dtype in profile.unsupported_dtypes else "not listed"
    return "dtype.unsupported", profile.severity["unsupported_dtype"], listed


def _remedy(dtype: str, profile: TargetProfile) -> str:
    fast = ", ".join(d for d in profile.fast_dtypes if d in FLOAT_ONNX_TYPES.values()) or "fp32"
    return (f"convert {dtype} to fp32 before lowering (exact for bf16, whose range fp32 shares), "
            f"then lower to the target's fast format ({fast})")


def _what(listed: str, profile: TargetProfile, dtype: str) -> str:
    if listed == "slow":
        return f"{dtype} is not a fast path on {profile.name}"
    if listed == "unsupported":
        return f"{profile.name} does not support {dtype}"
    return f"{profile.name} does not list {dtype} as supported"


def find(ctx: Context) -> list[Finding]:
    profile = ctx.profile
    findings: list[Finding] = []
    for view in ctx.views():
        graph = view.graph
        covered: set[str] = set()
        # Initialisers and Constant values, one finding per dtype and graph.
        constants: dict[str, list[tuple[str, int]]] = {}
        for init in graph.initializer:
            dtype = FLOAT_ONNX_TYPES.get(init.data_type)
            if dtype:
                size = 1
                for d in init.dims:
                    size *= d
                constants.setdefault(dtype, []).append((init.name, size))
                covered.add(init.name)
        for node in graph.node:
            value = attribute(node, "value") if node.op_type == "Constant" else None
            dtype = FLOAT_ONNX_TYPES.get(value.data_type) if value is not None else None
            if dtype:
                size = 1
                for d in value.dims:
                    size *= d
                constants.setdefault(dtype, []).append((node.output[0], size))
                covered.add(node.output[0])
        for dtype, entries in sorted(constants.items()):
            verdict = _verdict(profile, dtype)
            if verdict is None:
                continue
            rule, severity, listed = verdict
            names = sorted(name for name, _ in entries)
            first = names[0]
            user = view.consumer.get(first, [])
            findings.append(Finding(
                rule=rule, severity=severity,
                node=node_label(user[0]) if user else first,
                op_type=user[0].op_type if user else "initializer",
                message=f"{len(entries)} {dtype} constant(s): {_what(listed, profile, dtype)}",
                tensor=first, scope=view.path,
                evidence={"dtype": dtype, "kind": "constant", "count": len(entries),
                          "elements": sum(size for _, size in entries), "profile_lists": listed,
                          "tensors": names[:_LISTED_NAMES]},
                remedy="convert_dtype", remedy_text=_remedy(dtype, profile),
            ))

        # Casts into the dtype, one finding each.
        for node in graph.node:
            if node.op_type != "Cast":
                continue
            dtype = FLOAT_ONNX_TYPES.get(int(attribute(node, "to", 0)))
            verdict = _verdict(profile, dtype) if dtype else None
            if verdict is None:
                continue
            rule, severity, listed = verdict
            covered.update(node.output)
            findings.append(Finding(
                rule=rule, severity=severity, node=node_label(node), op_type="Cast",
                message=f"Cast to {dtype}: {_what(listed, profile, dtype)}",
                tensor=node.output[0], scope=view.path,
                evidence={"dtype": dtype, "kind": "cast", "count": 1, "profile_lists": listed},
                remedy="convert_dtype",
                remedy_text=f"cast to fp32 instead (or drop the Cast); {_remedy(dtype, profile)}",
            ))

        # Remaining tensors (graph inputs, outputs, activations) typed in the dtype.
        tensors: dict[str, list[str]] = {}
        names = [vi.name for vi in list(graph.input) + list(graph.output)]
        names += [o for n in graph.node for o in n.output if o]
        for name in dict.fromkeys(names):
            dtype = FLOAT_ONNX_TYPES.get(ctx.types.get(name, 0))
            if dtype and name not in covered:
                tensors.setdefault(dtype, []).append(name)
        io_names = {vi.name for vi in list(graph.input) + list(graph.output)}
        for dtype, found in sorted(tensors.items()):
            verdict = _verdict(profile, dtype)
            if verdict is None:
                continue
            rule, severity, listed = verdict
            first = found[0]
            node = view.producer.get(first)
            findings.append(Finding(
                rule=rule, severity=severity,
                node=node_label(node) if node is not None else first,
                op_type=node.op_type if node is not None else "graph input",
                message=f"{len(found)} {dtype} tensor(s): {_what(listed, profile, dtype)}",
                tensor=first, scope=view.path,
                evidence={"dtype": dtype, "kind": "tensor", "count": len(found),
                          "graph_io": sorted(io_names & set(found)), "profile_lists": listed,
                          "tensors": found[:_LISTED_NAMES]},
                remedy="convert_dtype", remedy_text=_remedy(dtype, profile),
            ))
    return findings
