"""The only home of onnxruntime in npuprep."""
