"""npuprep: make FP32/BF16-trained ONNX models safe on FP16/FP8 deployment targets."""

__version__ = "0.1.0"
