"""Helpers for the analysis tests: run the static rules on a tiny model, emulate it in FP16."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import model_from_text
from onnx import numpy_helper

from npuprep.analyse import Finding, static_findings
from npuprep.model_io import Model, fingerprint
from npuprep.numerics import get_format
from npuprep.profiles import TargetProfile, load_profile
from npuprep.runtime.session import make_session, run
from npuprep.verify.emulate import emulate


def build(text: str, **weights: np.ndarray) -> onnx.ModelProto:
    """A model from ONNX text; keyword arrays become initialisers (checked afterwards)."""
    model = onnx.parser.parse_model(text)
    for name, value in weights.items():
        model.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    onnx.checker.check_model(model)
    return model


def findings(model: onnx.ModelProto | str, target: str | TargetProfile = "generic",
             precision: str | None = None) -> list[Finding]:
    """The static findings on `target` (a name or a profile) in `precision` (else its default)."""
    proto = model_from_text(model) if isinstance(model, str) else model
    profile = target if isinstance(target, TargetProfile) else load_profile(target)
    return list(static_findings(Model(proto, "test.onnx", fingerprint(proto)), profile.resolve(precision)))


def rules(model: onnx.ModelProto | str, target: str = "generic") -> list[str]:
    return [f.rule for f in findings(model, target)]


def fp16_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a loud FP16 target computes: explicit Cast pairs inside the FP32 graph."""
    emulated = emulate(model, get_format("fp16"), saturate=False).model
    return run(make_session(emulated, optimize=False), feeds)
