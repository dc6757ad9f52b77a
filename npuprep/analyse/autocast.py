"""Ops torch autocast keeps in FP32 on a GPU that the target profile does not promise to keep there."""

from __future__ import annotations

from npuprep.analyse.context import Context
from npuprep.analyse.finding import Finding
from npuprep.graph import node_label
from npuprep.profiles import Pinning, Severity

# torch autocast's FP32 list (background article, section 4.2; sqrt from its section 3 list)
# as the ONNX ops an export turns each into. mse_loss and rsqrt have no op of their own: they
# export as Sub/Pow/ReduceMean and Reciprocal(Sqrt), which the entries below cover.
AUTOCAST_FP32_OPS: dict[str, str] = {
    "LayerNormalization": "layer_norm",
    "BatchNormalization": "batch_norm",
    "GroupNormalization": "group_norm",
    "InstanceNormalization": "group_norm",
    "Softmax": "softmax",
    "LogSoftmax": "log_softmax",
    "SoftmaxCrossEntropyLoss": "cross_entropy",
    "NegativeLogLikelihoodLoss": "nll_loss",
    "Pow": "pow",
    "Exp": "exp",
    "Log": "log",
    "Sqrt": "sqrt",
    "Reciprocal": "reciprocal",
    "ReduceSum": "sum",
    "ReduceSumSquare": "norm",
    "ReduceL1": "norm",
    "ReduceL2": "norm",
    "LpNormalization": "norm",
    "ReduceLogSumExp": "logsumexp",
}


def find(ctx: Context) -> list[Finding]:
    profile = ctx.profile
    kept = set(profile.keeps_fp32_ops)
    # Where the compiler decides per-op precision, its list is unknown until its report is read.
    severity = Severity.WARNING if profile.fp32_pinning is Pinning.COMPILER_DECIDES else Severity.INFO
    findings: list[Finding] = []
    for view, node in ctx.float_nodes():
        torch_name = AUTOCAST_FP32_OPS.get(node.op_type)
        if torch_name is None or node.op_type in kept:
            continue
        findings.append(Finding(
            rule="autocast.fp32_op", severity=severity, node=node_label(node),
            op_type=node.op_type, tensor=node.output[0] if node.output else "", scope=view.path,
            message=(f"GPU autocast runs {torch_name} in FP32; {profile.name} does not promise "
                     f"to keep {node.op_type} in FP32"),
            evidence={"torch_op": torch_name, "fp32_pinning": str(profile.fp32_pinning),
                      "profile_keeps_fp32": sorted(kept)},
            remedy="pin_fp32",
            remedy_text=("check the compiler's per-layer precision report; request FP32 for this "
                         "node if its measured range nears the limit"),
        ))
    return findings
