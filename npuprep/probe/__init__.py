"""Saturation probe: does the target overflow loudly (Inf, NaN) or silently (clamp, wrap)?

Modules (imported one by one; this package imports nothing, so torch_runner runs without onnx):
classify (verdicts), designs (micro-probe values), micro (ONNX micro-probes), backends
(Backend protocol, emulate, ort), runner (run + classify), layer (single-layer probe),
kit (board kit export / classify / measured profile), torch_runner (the micro-probes on a GPU).
"""
