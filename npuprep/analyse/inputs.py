"""Graph inputs a fixed-size compiler cannot take as they are: symbolic or unknown dims (`input.dynamic_shape`).

Only for profiles with `inputs.shapes: fixed` (rk3588: rknn-toolkit2's load_onnx refuses
`['batch', 3, 'height', 'width']` unless sizes are given, and then runs only those sizes).
"""

from __future__ import annotations

from npuprep.analyse.context import Context
from npuprep.analyse.finding import Finding
from npuprep.profiles import Severity


def find(ctx: Context) -> list[Finding]:
    if ctx.profile.input_shapes != "fixed":
        return []
    graph = ctx.model.graph
    inits = {i.name for i in graph.initializer}
    findings = []
    for vi in graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        shape = vi.type.tensor_type.shape if vi.type.tensor_type.HasField("shape") else None
        dims = [d.dim_param or ("?" if d.dim_value <= 0 else str(d.dim_value))
                for d in shape.dim] if shape is not None else None
        if dims is not None and all(d.isdigit() for d in dims):
            continue
        shown = f"[{', '.join(dims)}]" if dims is not None else "no shape"
        findings.append(Finding(
            rule="input.dynamic_shape", severity=Severity.WARNING, node=vi.name,
            op_type="graph input", tensor=vi.name,
            message=f"input '{vi.name}' has {shown}; {ctx.profile.name} builds for fixed sizes only",
            evidence={"dims": dims},
            remedy="none",
            remedy_text="give every input's size at build time (rknn-toolkit2: load_onnx("
                        "inputs=..., input_size_list=...); npuprep's vendor runs take the "
                        "samples' shapes) and build once per size you need",
        ))
    return findings
