"""Bounded per-process history: what detectors need to see change over time.

Keyed by process identity (PID + start time), so a reused PID starts a fresh history. Both the
samples per process and the number of processes are capped, and processes absent from a poll are
forgotten, so the daemon's memory stays flat however long it runs. Samples are kept in packed
arrays (8 bytes a figure, NaN for unknown) rather than one Python object each: a full window of
every watched process then costs a few hundred KiB, and trend tests read the series directly.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from typing import NamedTuple, Optional

from gpuwatch.model import NodeSnapshot

Identity = tuple[int, Optional[float]]
_NAN = math.nan


class Sample(NamedTuple):
    taken_at: float
    rss_bytes: Optional[int]
    gpu_memory_bytes: Optional[int]


class ProcessHistory:
    __slots__ = ("capacity", "first_ppid", "first_seen", "gpu_memory", "last_seen", "pid",
                 "rss", "start_time", "times")

    def __init__(self, pid: int, start_time: Optional[float], first_ppid: Optional[int],
                 first_seen: float, capacity: int) -> None:
        self.pid = pid
        self.start_time = start_time
        #: Parent as first seen: an orphan is a process whose recorded parent is gone.
        self.first_ppid = first_ppid
        self.first_seen = first_seen
        self.last_seen = first_seen
        self.capacity = capacity
        self.times = array("d")
        self.rss = array("d")
        self.gpu_memory = array("d")

    def append(self, taken_at: float, rss: Optional[int], gpu_memory: Optional[int]) -> None:
        self.last_seen = taken_at
        for series, value in ((self.times, taken_at), (self.rss, rss),
                              (self.gpu_memory, gpu_memory)):
            series.append(_NAN if value is None else float(value))
            if len(series) > self.capacity:
                del series[0]

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        for series in (self.times, self.rss, self.gpu_memory):
            if len(series) > capacity:
                del series[: len(series) - capacity]

    def samples(self) -> Iterator[Sample]:
        for t, rss, gpu in zip(self.times, self.rss, self.gpu_memory):
            yield Sample(t, None if math.isnan(rss) else int(rss),
                         None if math.isnan(gpu) else int(gpu))

    def __len__(self) -> int:
        return len(self.times)


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
                h = ProcessHistory(p.pid, p.start_time, p.ppid, snapshot.taken_at, self.samples)
                self._by_identity[key] = h
            h.append(snapshot.taken_at, p.rss_bytes, p.gpu_memory_bytes)
            self._by_identity.move_to_end(key)
        for key in [k for k in self._by_identity if k not in seen]:
            del self._by_identity[key]
        self._trim()

    def resize(self, samples: int, max_processes: int) -> None:
        """Apply a reloaded configuration without losing what fits."""
        if samples != self.samples:
            for h in self._by_identity.values():
                h.resize(samples)
        self.samples = samples
        self.max_processes = max_processes
        self._trim()

    def _trim(self) -> None:
        while len(self._by_identity) > self.max_processes:
            self._by_identity.popitem(last=False)
