"""Turning the export-ready modules into ONNX graphs and proving the graphs right."""
