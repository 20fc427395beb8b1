"""ONNX Runtime compile stage helpers: weight-only quantisation and build-time checks of the compiled graphs."""
