"""Sources: each reads one part of the node (NVML, /proc, the agent socket) for a snapshot."""
