"""Runtime sessions behind one small interface: ONNX Runtime (default) and QAIC."""
