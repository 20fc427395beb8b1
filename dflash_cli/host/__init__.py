"""Facts about this host and process: tool versions, ONNX Runtime's thread pool, memory."""
