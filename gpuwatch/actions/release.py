"""Whether GPU memory was released: NVML read again after processes were ended.

A real driver tears a CUDA context down just after its process exits, not at the exit itself, so
the check reads NVML until none of the ended processes is listed, or a few seconds have passed.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from gpuwatch.model import NvmlReading
from gpuwatch.sources.nvml import NvmlSource

#: How long the driver gets to release an ended process's memory before it counts as held.
RELEASE_WAIT = 3.0
_TICK = 0.1


def nvml_after(ended: Collection[int], wait: float = RELEASE_WAIT) -> NvmlReading:
    """NVML's reading once none of the PIDs `ended` is listed on any GPU, or after `wait`
    seconds; at once when NVML is unavailable (`status.available` says so)."""
    nvml = NvmlSource()
    deadline = time.monotonic() + wait
    try:
        while True:
            reading = nvml.read()
            if not reading.status.available:
                return reading
            if not (holders(reading) & set(ended)) or time.monotonic() >= deadline:
                return reading
            time.sleep(_TICK)
    finally:
        nvml.close()


def holders(reading: NvmlReading) -> set[int]:
    """The PIDs NVML lists on any GPU."""
    return {u.pid for g in reading.gpus for u in g.processes}
