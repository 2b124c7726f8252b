"""Simulated GPU node: a fake NVML driver and the state that drives it, for tests and the demo."""
