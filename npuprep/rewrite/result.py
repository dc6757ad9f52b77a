"""RewriteResult: what every rewrite returns (the model, whether it changed, and why)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import onnx


@dataclass(frozen=True)
class RewriteResult:
    """The outcome of one rewrite.

    `modified` is False when the rewrite declined; `reason` then says why in a sentence a
    report can print, and `model` is the input unchanged. Truthy when the model changed.
    `details` carries rewrite-specific facts (e.g. "tensor_scales" for rescale).
    """

    model: onnx.ModelProto
    modified: bool
    reason: str
    details: Mapping[str, object] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.modified
