"""The export stage's cache-key version, apart from the exporters so that a flow can key its stages without
importing torch or onnx."""

# Bump when the graph the exporter writes changes.
EXPORT_FORMAT = 4
