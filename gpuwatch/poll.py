"""One poll: read every source once and join the parts into one immutable `NodeSnapshot`."""

from __future__ import annotations

import socket
import time
from collections import defaultdict
from typing import Callable, Optional

from gpuwatch.model import GpuProcessUsage, NodeSnapshot
from gpuwatch.sources.nvml import NvmlSource
from gpuwatch.sources.processes import ProcessSource


class Poller:
    def __init__(self, nvml: Optional[NvmlSource] = None,
                 processes: Optional[ProcessSource] = None,
                 hostname: Optional[str] = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.nvml = nvml or NvmlSource()
        self.processes = processes or ProcessSource()
        self.hostname = hostname or socket.gethostname()
        self._clock = clock

    def poll(self) -> NodeSnapshot:
        started = time.perf_counter()
        taken_at = self._clock()
        reading = self.nvml.read()
        usage: dict[int, list[GpuProcessUsage]] = defaultdict(list)
        for gpu in reading.gpus:
            for u in gpu.processes:
                usage[u.pid].append(u)
        # Without NVML nobody can say who holds GPU memory; show what looks like GPU work.
        pids = (set(usage) if reading.status.available
                else self.processes.discover_gpu_candidates())
        host = self.processes.read(pids, {pid: tuple(us) for pid, us in usage.items()})
        return NodeSnapshot(
            taken_at=taken_at,
            hostname=self.hostname,
            nvml=reading.status,
            gpus=reading.gpus,
            processes=host.processes,
            errors=reading.errors + host.errors,
            poll_duration_seconds=time.perf_counter() - started,
        )

    def close(self) -> None:
        self.nvml.close()
