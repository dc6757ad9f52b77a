"""Planning: findings + ranges -> Plan (softmax shift, rescale, pin FP32, clamp), never touching the graph."""

from npuprep.plan.actions import (
    Action,
    Clamp,
    Declined,
    FindingRef,
    Hazard,
    PinFp32,
    Rescale,
    SoftmaxShift,
    Unpinnable,
)
from npuprep.plan.plan import Plan, dump_plan, load_plan, save_plan

__all__ = [
    "Action", "Clamp", "Declined", "FindingRef", "Hazard", "PinFp32", "Plan", "Rescale",
    "SoftmaxShift", "Unpinnable",
    "dump_plan", "load_plan", "save_plan",
]
