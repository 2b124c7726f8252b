"""Sinks: the exporter, the CLI views and the reaper; they read snapshots and findings only."""
