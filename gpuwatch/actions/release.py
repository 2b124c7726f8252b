"""Whether GPU memory was released: NVML read again after processes were ended.

A real driver tears a CUDA context down just after its process exits, not at the exit itself, so
the check reads NVML until none of the ended processes is listed, or a few seconds have passed.

A GPU whose process list cannot be read lists nobody, and that is no evidence of a release: the
check waits for it to be readable, and gives up as it does without NVML (`status.available`
False, with the reason) when it stays unreadable.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import replace

from gpuwatch.model import NvmlReading
from gpuwatch.sources.nvml import NvmlSource, holders_unknown

#: How long the driver gets to release an ended process's memory before it counts as held.
RELEASE_WAIT = 3.0
_TICK = 0.1


def nvml_after(ended: Collection[int], wait: float = RELEASE_WAIT) -> NvmlReading:
    """NVML's reading once none of the PIDs `ended` is listed on any GPU, or after `wait`
    seconds; at once when NVML is unavailable (`status.available` says so). When a GPU's
    process list still cannot be read at the end, the reading's status is not available either,
    with that as its reason: who holds memory there is unknown, so no release can be told."""
    nvml = NvmlSource()
    deadline = time.monotonic() + wait
    try:
        while True:
            reading = nvml.read()
            if not reading.status.available:
                return reading
            blind = unreadable(reading)
            done = not blind and not (holders(reading) & set(ended))
            if done or time.monotonic() >= deadline:
                break
            time.sleep(_TICK)
    finally:
        nvml.close()
    if blind:
        gpus = ", ".join(str(i) for i in blind)
        reading = replace(reading, status=replace(
            reading.status, available=False,
            error=f"process list unreadable on GPU {gpus}"))
    return reading


def holders(reading: NvmlReading) -> set[int]:
    """The PIDs NVML lists on any GPU."""
    return {u.pid for g in reading.gpus for u in g.processes}


def unreadable(reading: NvmlReading) -> list[int]:
    """The GPUs whose holders are unknown (a process list, or the GPU itself, could not be
    read)."""
    return [g.index for g in reading.gpus if holders_unknown(g)]
