"""Bounded per-process history: what detectors need to see change over time.

Keyed by process identity (PID + start time), so a reused PID starts a fresh history. Both the
samples per process and the number of processes are capped, and processes absent from a poll are
forgotten, so the daemon's memory stays flat however long it runs.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Optional

from gpuwatch.model import NodeSnapshot

Identity = tuple[int, Optional[float]]


@dataclass(frozen=True)
class Sample:
    taken_at: float
    rss_bytes: Optional[int]
    gpu_memory_bytes: Optional[int]


@dataclass
class ProcessHistory:
    pid: int
    start_time: Optional[float]
    #: Parent as first seen: an orphan is a process whose recorded parent is gone.
    first_ppid: Optional[int]
    first_seen: float
    last_seen: float
    samples: deque[Sample]


class History:
    def __init__(self, samples: int = 300, max_processes: int = 4096) -> None:
        self.samples = samples
        self.max_processes = max_processes
        self._by_identity: OrderedDict[Identity, ProcessHistory] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_identity)

    def get(self, identity: Identity) -> Optional[ProcessHistory]:
        return self._by_identity.get(identity)

    def record(self, snapshot: NodeSnapshot) -> None:
        seen: set[Identity] = set()
        for p in snapshot.processes.values():
            if not p.in_procfs:
                continue
            key = p.identity
            seen.add(key)
            h = self._by_identity.get(key)
            if h is None:
                h = ProcessHistory(p.pid, p.start_time, p.ppid, snapshot.taken_at,
                                   snapshot.taken_at, deque(maxlen=self.samples))
                self._by_identity[key] = h
            h.last_seen = snapshot.taken_at
            h.samples.append(Sample(snapshot.taken_at, p.rss_bytes, p.gpu_memory_bytes))
            self._by_identity.move_to_end(key)
        for key in [k for k in self._by_identity if k not in seen]:
            del self._by_identity[key]
        while len(self._by_identity) > self.max_processes:
            self._by_identity.popitem(last=False)

    def resize(self, samples: int, max_processes: int) -> None:
        """Apply a reloaded configuration without losing what fits."""
        if samples != self.samples:
            for h in self._by_identity.values():
                h.samples = deque(h.samples, maxlen=samples)
        self.samples = samples
        self.max_processes = max_processes
        while len(self._by_identity) > self.max_processes:
            self._by_identity.popitem(last=False)
