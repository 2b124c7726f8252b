"""Sinks: the document, the exporter, the CLI views and the sockets that serve them; they render
snapshots, findings and documents only (the sinks-render contract in .importlinter)."""
