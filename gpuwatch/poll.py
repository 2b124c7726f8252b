"""One poll: read every source once and join the parts into one immutable `NodeSnapshot`.

Which host processes are read: the GPU holders NVML lists (without NVML, what looks like GPU
work), the members of their jobs (every descendant of each job root), the processes the caller
asks to keep watching (job members from earlier polls, so helpers stay visible after they are
reparented), and the ancestors of all of these up to PID 1.
"""

from __future__ import annotations

import socket
import time
from collections import defaultdict
from collections.abc import Iterable
from types import MappingProxyType
from typing import Callable, Optional

from gpuwatch.jobtree import job_root, job_roots
from gpuwatch.model import GpuProcessUsage, NodeSnapshot
from gpuwatch.sources.nvml import NvmlSource
from gpuwatch.sources.processes import ProcessSource

#: Bounds the walk down job trees, so a fork bomb under a launcher cannot stall a poll.
MAX_JOB_MEMBERS = 4096


class Poller:
    def __init__(self, nvml: Optional[NvmlSource] = None,
                 processes: Optional[ProcessSource] = None,
                 hostname: Optional[str] = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.nvml = nvml or NvmlSource()
        self.processes = processes or ProcessSource()
        self.hostname = hostname or socket.gethostname()
        self._clock = clock

    def poll(self, watch: Iterable[int] = ()) -> NodeSnapshot:
        started = time.perf_counter()
        taken_at = self._clock()
        reading = self.nvml.read()
        usage: dict[int, list[GpuProcessUsage]] = defaultdict(list)
        for gpu in reading.gpus:
            for u in gpu.processes:
                usage[u.pid].append(u)
        gpu_usage = {pid: tuple(us) for pid, us in usage.items()}
        # Without NVML nobody can say who holds GPU memory; show what looks like GPU work.
        seeds = (set(usage) if reading.status.available
                 else self.processes.discover_gpu_candidates())
        host = self.processes.read(seeds | set(watch), gpu_usage)
        roots = {job_root(pid, host.processes) for pid in seeds}
        members = self._descendants({root for root in roots if root is not None})
        more = self.processes.read(members - host.processes.keys(), gpu_usage,
                                   known=host.processes)
        processes = more.processes
        self.processes.forget_others(processes.values())
        return NodeSnapshot(
            taken_at=taken_at,
            hostname=self.hostname,
            nvml=reading.status,
            gpus=reading.gpus,
            processes=processes,
            errors=reading.errors + host.errors + more.errors,
            poll_duration_seconds=time.perf_counter() - started,
            job_roots=MappingProxyType(job_roots(processes)),
        )

    def _descendants(self, roots: set[int]) -> set[int]:
        """Every process under the roots (each root's children file read once)."""
        found: set[int] = set(roots)
        todo = list(roots)
        while todo and len(found) < MAX_JOB_MEMBERS:
            for child in self.processes.children(todo.pop()):
                if child not in found:
                    found.add(child)
                    todo.append(child)
        return found - roots

    def close(self) -> None:
        self.nvml.close()
