"""Sinks: the document, the exporter and the CLI views; they render snapshots, findings and
documents only (the sinks-render contract in .importlinter). The sockets that serve them are in
gpuwatch.serve."""
