"""Actions: the code that changes the node, beside the sinks that only render.

`signals` is the one signalling path (identity checked before every signal, SIGTERM then
SIGKILL); `reaper` plans and carries out reaps of findings; `release` checks with NVML that GPU
memory was released; `supervisor` is `gpuwatch run`. Nothing else in gpuwatch sends a signal.
"""
