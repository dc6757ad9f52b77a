"""Mask constants at lowering: which nodes read a constant as an additive mask, and FP16 -inf masks.

A mask value beyond the target's range (-inf, FP32 lowest, -1e9) is stored as the target's
-max where it is added, selected or compared (MASK_OPS), and where a scalar mask value
(numerics.MASK_SCALE) multiplies a 0/1 mask on its way there (`(1 - m) * -1e9`): -max x {0, 1}
is the same mask. Any other reader of such a constant keeps its node FP32 (lower.py: never clipped).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuprep.graph import GraphScope, to_array

# Ops where a large negative constant is a mask (added, selected or compared), not a weight.
MASK_OPS = frozenset({"Add", "Where", "Min", "Max"})
# Ops that carry a mask's values unchanged on to where it is used.
_CARRIERS = frozenset({"Cast", "Identity", "Unsqueeze", "Reshape", "Expand"})


def _readers(scopes: list[GraphScope]) -> dict[str, list[onnx.NodeProto]]:
    readers: dict[str, list[onnx.NodeProto]] = {}
    for scope in scopes:
        for node in scope.graph.node:
            for name in node.input:
                readers.setdefault(name, []).append(node)
    return readers


def _only_masks(name: str, readers: dict[str, list[onnx.NodeProto]], returned: set[str],
                carriers: frozenset[str]) -> bool:
    users = readers.get(name, [])
    return bool(users) and name not in returned and all(
        u.op_type in MASK_OPS or (u.op_type in carriers and all(
            _only_masks(o, readers, returned, carriers) for o in u.output if o))
        for u in users)


def mask_readers(scopes: list[GraphScope], scalars: set[str]) -> set[int]:
    """ids of the nodes that read a constant as a mask: every MASK_OPS node, and each Mul of
    a scalar constant (`scalars`) whose product only reaches MASK_OPS."""
    readers = _readers(scopes)
    returned = {o.name for s in scopes for o in s.graph.output}
    found: set[int] = set()
    for scope in scopes:
        for node in scope.graph.node:
            if node.op_type in MASK_OPS:
                found.add(id(node))
            elif node.op_type == "Mul" and any(i in scalars for i in node.input) and all(
                    _only_masks(o, readers, returned, _CARRIERS) for o in node.output if o):
                found.add(id(node))
    return found


def map_fp16_masks(scopes: list[GraphScope],
                   constant_value: Callable[[onnx.NodeProto], np.ndarray | None]) -> dict[str, int]:
    """FP16 constants read only as masks (through Casts and Identities) take -max for -inf,
    as FP32 masks do when lowered: the target stores no -inf it was not given. Returns
    constant -> values mapped. `constant_value(node)` reads a Constant node's value."""
    readers = _readers(scopes)
    returned = {o.name for s in scopes for o in s.graph.output}
    carriers = frozenset({"Cast", "Identity"})
    mapped: dict[str, int] = {}
    lowest = np.float16(-np.finfo(np.float16).max)
    for scope in scopes:
        overridable = {vi.name for vi in scope.graph.input}
        found = [(i.name, i, None) for i in scope.graph.initializer
                 if i.data_type == TensorProto.FLOAT16 and i.name not in overridable]
        found += [(n.output[0], None, n) for n in scope.graph.node if n.op_type == "Constant"
                  and n.output and (v := constant_value(n)) is not None and v.dtype == np.float16]
        for name, init, node in found:
            value = to_array(init) if init is not None else constant_value(node)
            bad = ~np.isfinite(value)
            if not bad.any() or not np.all(value[bad] == -np.inf) or \
                    not _only_masks(name, readers, returned, carriers):
                continue
            tensor = numpy_helper.from_array(np.where(bad, lowest, value), name)
            if init is not None:
                init.CopyFrom(tensor)
            else:
                del node.attribute[:]
                node.attribute.append(helper.make_attribute("value", tensor))
            mapped[name] = int(bad.sum())
    return mapped
