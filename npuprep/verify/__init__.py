"""Verification: emulate target numerics and compare layer by layer against the FP32 reference."""
