"""Multi-node patterns: decomposed LayerNorm, softmax without max subtraction, `a + w * (a - b)`."""

from __future__ import annotations

import onnx

from npuprep.analyse.context import Context, ScopeView
from npuprep.analyse.finding import Finding
from npuprep.analyse.matching import is_max_subtracted, reduction_size, square_exponent
from npuprep.graph import node_label

# Below this guidance weight the difference term is not amplified beyond the operands' own scale.
GUIDANCE_MIN_WEIGHT = 2.0


def _of(view: ScopeView, name: str, op_type: str) -> onnx.NodeProto | None:
    node = view.source(name)
    return node if node is not None and node.op_type == op_type else None


def _division(view: ScopeView, node: onnx.NodeProto) -> tuple[str, str, list[onnx.NodeProto]] | None:
    """(numerator, denominator, extra members) of Div(a, b) or Mul(a, Reciprocal(b))."""
    if node.op_type == "Div" and len(node.input) == 2:
        return node.input[0], node.input[1], []
    if node.op_type == "Mul" and len(node.input) == 2:
        for i in (0, 1):
            recip = _of(view, node.input[1 - i], "Reciprocal")
            if recip is not None:
                return node.input[i], recip.input[0], [recip]
    return None


def _layernorm(ctx: Context, view: ScopeView, node: onnx.NodeProto) -> Finding | None:
    """(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps)."""
    parts = _division(view, node)
    if parts is None:
        return None
    num, den, extra = parts
    sub = _of(view, num, "Sub")
    mean = _of(view, sub.input[1], "ReduceMean") if sub is not None else None
    if mean is None or mean.input[0] != sub.input[0]:
        return None
    sqrt = _of(view, den, "Sqrt")
    add = _of(view, sqrt.input[0], "Add") if sqrt is not None else None
    if add is None:
        return None
    eps = next((view.scalar(i) for i in add.input if view.is_constant(i)), None)
    var = next((n for n in (_of(view, i, "ReduceMean") for i in add.input) if n is not None), None)
    square = view.source(var.input[0]) if var is not None else None
    if square is None or square_exponent(view, square) != 2 or square.input[0] != sub.output[0]:
        return None
    fmt = ctx.fmt
    members = [mean, sub, square, var, add, sqrt, *extra, node]
    eps_survives = eps is not None and eps > fmt.min_subnormal / 2
    return Finding(
        rule="pattern.layernorm", severity=ctx.profile.severity["hazard"],
        node=node_label(square), op_type=square.op_type, tensor=node.output[0], scope=view.path,
        message=(f"decomposed LayerNorm: (x - mean)^2 overflows {fmt.name} for "
                 f"|x - mean| > {fmt.square_limit:.4g}"
                 + ("" if eps_survives else "; no constant eps" if eps is None
                    else f"; eps {eps:.3g} flushes to zero")),
        evidence={"format": fmt.name, "members": [node_label(m) for m in members],
                  "input_limit": fmt.square_limit, "eps": eps, "eps_survives": eps_survives,
                  "output": node.output[0]},
        remedy="pin_fp32",
        remedy_text=("pin the island from the first ReduceMean to the Div to FP32 (or fuse it "
                     "into LayerNormalization kept in FP32); rescaling its input by 2^-k with "
                     "eps scaled by 2^-2k is exact too"),
    )


def _softmax(ctx: Context, view: ScopeView, node: onnx.NodeProto) -> Finding | None:
    """exp(x) / sum(exp(x)) with no x - max(x) before the Exp."""
    parts = _division(view, node)
    if parts is None:
        return None
    num, den, extra = parts
    exp = _of(view, num, "Exp")
    total = _of(view, den, "ReduceSum")
    if exp is None or total is None or view.source(total.input[0]) is not exp:
        return None
    if is_max_subtracted(view, exp.input[0]):
        return None
    fmt = ctx.fmt
    members = [exp, total, *extra, node]
    return Finding(
        rule="pattern.softmax", severity=ctx.profile.severity["hazard"],
        node=node_label(exp), op_type="Exp", tensor=node.output[0], scope=view.path,
        message=(f"decomposed softmax without max subtraction: exp overflows {fmt.name} for "
                 f"logits > {fmt.exp_limit:.4g}, then Inf/Inf gives NaN"),
        evidence={"format": fmt.name, "members": [node_label(m) for m in members],
                  "input_limit": fmt.exp_limit,
                  "reduction_size": reduction_size(ctx, view, total), "output": node.output[0]},
        remedy="pin_fp32",
        remedy_text=("subtract the row max before the Exp (same result, exp <= 1), replace the "
                     "chain by Softmax, or pin Exp..Div to FP32"),
    )


def _guidance(ctx: Context, view: ScopeView, node: onnx.NodeProto) -> Finding | None:
    """a + w * (a - b) (either operand order) with a constant |w| >= 2."""
    if node.op_type != "Add" or len(node.input) != 2:
        return None
    for i in (0, 1):
        base, term = node.input[i], node.input[1 - i]
        mul = _of(view, term, "Mul")
        if mul is None:
            continue
        for j in (0, 1):
            w = view.scalar(mul.input[j])
            sub = _of(view, mul.input[1 - j], "Sub")
            if w is None or sub is None or base not in sub.input:
                continue
            if abs(w) < GUIDANCE_MIN_WEIGHT:
                return None
            fmt = ctx.fmt
            members = [sub, mul, node]
            return Finding(
                rule="pattern.guidance", severity=ctx.profile.severity["hazard"],
                node=node_label(mul), op_type="Mul", tensor=node.output[0], scope=view.path,
                message=(f"guidance a + {w:g} * (a - b): the difference of two close values is "
                         f"amplified {abs(w):g}x; rounding error grows {2 * abs(w) + 1:g}x and "
                         f"|a - b| > {fmt.max / abs(w):.4g} overflows {fmt.name}"),
                evidence={"format": fmt.name, "members": [node_label(m) for m in members],
                          "w": w, "diff_limit": fmt.max / abs(w), "error_gain": 2 * abs(w) + 1,
                          "eps": fmt.eps, "output": node.output[0]},
                remedy="pin_fp32",
                remedy_text="pin Sub, Mul and Add of the guidance combination to FP32",
            )
    return None


def find(ctx: Context) -> list[Finding]:
    findings: list[Finding] = []
    for view, node in ctx.float_nodes():
        for matcher in (_layernorm, _softmax, _guidance):
            found = matcher(ctx, view, node)
            if found is not None:
                findings.append(found)
    return findings
