"""A process's samples: its RSS, GPU memory and USS at each sampled poll, in compact arrays.

Samples are rings of 32-bit floats (4 bytes a figure, NaN for unknown) taken whole at a
process's first sight (FigureRing), so their memory is the processes' count times
history.samples x 8 bytes from the first poll on, not a climb over the history's span. A figure
a 32-bit float does not hold exactly turns its ring into doubles: what is kept is always what
was read. Every process is sampled at the same polls, so their times are kept once
(SampleClock). ProcessHistory is what the history
keeps of one process: those rings, its lineage as first seen and its states.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator
from typing import NamedTuple, Optional

from gpuwatch.history.steps import StepSeries
from gpuwatch.jobs.key import JobKey
from gpuwatch.jobs.records import Identity
from gpuwatch.launch_env import process_title
from gpuwatch.model import HostProcess
from gpuwatch.vocabulary import ProcState

_NAN = math.nan


class Sample(NamedTuple):
    taken_at: float
    rss_bytes: Optional[int]
    gpu_memory_bytes: Optional[int]


class Ring:
    """The newest `capacity` figures, in one array of doubles taken whole when the ring is made:
    a process's samples cost their memory at its first sight, never more as they fill, and the
    oldest is overwritten in place."""

    __slots__ = ("_data", "_size", "_start")
    #: The array's type: doubles.
    TYPECODE = "d"

    def __init__(self, capacity: int, unknown: int = 0) -> None:
        self._data = array(self.TYPECODE, [_NAN]) * max(1, capacity)
        self._start = 0
        #: How many are filled; `unknown` NaNs to begin with.
        self._size = min(unknown, len(self._data))

    def __len__(self) -> int:
        return self._size

    def append(self, value: float) -> None:
        data = self._data
        if self._size < len(data):
            data[self._size] = value  # _start stays 0 until the ring is full
            self._size += 1
        else:
            data[self._start] = value
            self._start = (self._start + 1) % len(data)

    def values(self) -> array[float]:
        """The figures, oldest first (a copy)."""
        if self._start == 0:
            return self._data[:self._size]
        return self._data[self._start:] + self._data[:self._start]

    def every(self, stride: int) -> array[float]:
        """values()[::stride], copying only the figures chosen: the time-based leak test reads
        a window's worth spread over every sample, each poll, for every process."""
        data, start, size = self._data, self._start, self._size
        if start == 0:
            return data[:size:stride]
        # Full, and wrapped: the oldest figures run from `start` to the end, then from 0.
        first = data[start::stride]
        return first + data[len(first) * stride - (len(data) - start):start:stride]

    def rise(self, i: int) -> float:
        """values()[i] - values()[0], for 0 <= i < len(self), read in place."""
        data = self._data
        # (Before the ring is full `_start` is 0 and the index negative: counted from the end.)
        first = self._start - len(data)
        return data[first + i] - data[first]

    def resize(self, capacity: int) -> None:
        kept = self.values()[-max(1, capacity):]
        self._data = array(self._data.typecode, [_NAN]) * max(1, capacity)
        self._data[:len(kept)] = kept
        self._start, self._size = 0, len(kept)


class FigureRing(Ring):
    """A Ring of byte counts in 32-bit floats: half a double's memory, and exact for every
    figure the kernel and NVML give in practice. RSS and USS are whole pages (exact up to
    64 GiB: 2**24 pages of 4 KiB), NVML's GPU memory whole MiB (exact up to 16 TiB); any figure
    with at most 24 significant bits is exact whatever its size. One that is not (an RSS over
    64 GiB not a multiple of a larger power of two, or beyond a float's range) turns the ring
    into doubles, as a Ring is, before it is kept: no figure is ever rounded, so no leak test
    can turn on the unit. Reading one costs nothing more: its values are Python floats all the
    same."""

    __slots__ = ()
    TYPECODE = "f"

    def append(self, value: float) -> None:
        data = self._data
        if self._size < len(data):
            i = self._size
            self._size += 1
        else:
            i = self._start
            self._start = (i + 1) % len(data)
        try:
            data[i] = value
            if data[i] == value or value != value:  # exact, or NaN (unknown)
                return
        except OverflowError:  # beyond a float's range (where Python refuses to round it)
            pass
        self._data = array("d", data)
        self._data[i] = value

    @property
    def compact(self) -> bool:
        """Whether its figures are still 32-bit floats (not turned into doubles)."""
        return self._data.typecode == "f"


class SampleClock:
    """When the history's samples were taken: one time for every process sampled then.

    Every process is sampled at the same polls (those at least `sample_spacing` after the last
    one), so the times are kept once, not once per process: a process's samples are the newest
    of these, as many as it has."""

    __slots__ = ("_ordered", "_times", "taken")

    def __init__(self, capacity: int) -> None:
        self._times = Ring(capacity)
        self._ordered: Optional[array[float]] = None
        #: Samples taken so far: what a process's samples are made of changes only with it.
        self.taken = 0

    def due(self, now: float, spacing: float) -> bool:
        """Whether a poll at `now` is a sample (a hundredth of the spacing spares one that
        came a rounding error early)."""
        return not len(self._times) or now - self.newest(1)[0] >= 0.99 * spacing

    def add(self, now: float) -> None:
        self._times.append(now)
        self._ordered = None
        self.taken += 1

    def newest(self, n: int) -> memoryview:
        """The newest `n` times, oldest first: a view, no copy."""
        if self._ordered is None:
            self._ordered = self._times.values()
        view = memoryview(self._ordered)
        return view[len(view) - n:] if n else view[:0]

    def resize(self, capacity: int) -> None:
        self._times.resize(capacity)
        self._ordered = None


class ProcessHistory:
    """What the history keeps of one process: its lineage and states, and its samples (RSS,
    GPU memory, and USS once read), in rings taken whole at its first sight (Ring), at the
    times the history's SampleClock keeps for every process."""

    __slots__ = ("_clock", "_gpu_memory", "_rss", "_uss", "capacity", "disk_sleep_since",
                 "first_ppid", "first_seen", "held_gpu", "job_key", "last_seen", "name",
                 "parent_comm", "parent_name", "parent_start", "pid",
                 "quiet", "reparented_at", "start_time", "steps", "steps_refused",
                 "uid", "zombie_since")

    def __init__(self, p: HostProcess, parent: Optional[HostProcess], job_key: Optional[JobKey],
                 first_seen: float, capacity: int, clock: SampleClock) -> None:
        self.pid = p.pid
        self.start_time = p.start_time
        self.name = p.name
        #: Whose it is: the history's room is shared by user (History._trim).
        self.uid = p.uid
        #: The launching parent, as first seen: if it goes, this process is orphaned.
        self.first_ppid = p.ppid
        self.parent_start = parent.start_time if parent is not None else None
        #: As a sentence names it: "torchrun (pt_elastic)" (launch_env.process_title).
        self.parent_name = (process_title(parent.name, parent.cmdline)
                            if parent is not None else None)
        #: Its kernel name (`comm`) alone, for a finding's summary (no command line in it).
        self.parent_comm = parent.name if parent is not None else None
        #: The job as first seen; kept after reparenting, which is when it matters.
        self.job_key = job_key
        self.first_seen = first_seen
        self.last_seen = first_seen
        self.reparented_at: Optional[float] = None
        self.zombie_since: Optional[float] = None
        self.disk_sleep_since: Optional[float] = None
        self.held_gpu = False
        #: Step-aligned figures, once the process reports through the agent.
        self.steps: Optional[StepSeries] = None
        #: The budget refused it a step history (counted once until one is granted).
        self.steps_refused = False
        self.capacity = capacity
        #: The history's: when its samples were taken.
        self._clock = clock
        self._rss = FigureRing(capacity)
        self._gpu_memory = FigureRing(capacity)
        #: USS at each sample (NaN where unknown), once the poll has read one for the process
        #: (forked workers of GPU jobs): None until then, so other processes pay nothing for it.
        self._uss: Optional[FigureRing] = None
        #: What the time-based leak test (gpuwatch.detectors.leaks) found no growth in: the
        #: `sampled` and settings it last ran on, so that it runs again only on new samples.
        self.quiet: Optional[tuple[tuple[int, int], object]] = None

    @property
    def sampled(self) -> tuple[int, int]:
        """Which samples the process has: it changes with each one taken (and a resize)."""
        return (self._clock.taken, len(self._rss))

    @property
    def identity(self) -> Identity:
        return (self.pid, self.start_time)

    @property
    def times(self) -> memoryview:
        """When each sample was taken, oldest first."""
        return self._clock.newest(len(self._rss))

    @property
    def rss(self) -> array[float]:
        return self._rss.values()

    @property
    def gpu_memory(self) -> array[float]:
        return self._gpu_memory.values()

    def rss_every(self, stride: int) -> array[float]:
        """rss[::stride], without copying the rest."""
        return self._rss.every(stride)

    def gpu_memory_every(self, stride: int) -> array[float]:
        """gpu_memory[::stride], without copying the rest."""
        return self._gpu_memory.every(stride)

    def rises(self, i: int) -> tuple[float, float]:
        """How much its RSS and its GPU memory rose from the oldest sample to sample `i` (NaN
        where either end is unknown), read in place: the time-based leak test's pre-check, for
        every process at every sample."""
        return self._rss.rise(i), self._gpu_memory.rise(i)

    @property
    def uss(self) -> Optional[array[float]]:
        return self._uss.values() if self._uss is not None else None

    def observe(self, p: HostProcess, taken_at: float, sample: bool = True) -> None:
        """Record what one poll saw; with `sample` (a poll the history samples, at the
        SampleClock's time), its figures too."""
        self.last_seen = taken_at
        if self.reparented_at is None and p.ppid != self.first_ppid:
            self.reparented_at = taken_at
        state = p.state
        # (Most processes are in neither state, and were not: nothing to change.)
        if state == ProcState.ZOMBIE or self.zombie_since is not None:
            self.zombie_since = _since(self.zombie_since, state == ProcState.ZOMBIE, taken_at)
        if state == ProcState.DISK_SLEEP or self.disk_sleep_since is not None:
            self.disk_sleep_since = _since(self.disk_sleep_since,
                                           state == ProcState.DISK_SLEEP, taken_at)
        if not self.held_gpu and p.gpu_usage:
            self.held_gpu = True
        if not sample:
            return
        rss, gpu = p.rss_bytes, p.gpu_memory_bytes
        self._rss.append(_NAN if rss is None else float(rss))
        self._gpu_memory.append(_NAN if gpu is None else float(gpu))
        if self._uss is None and p.uss_bytes is not None:
            self._uss = FigureRing(self.capacity, unknown=len(self._rss) - 1)
        if self._uss is not None:
            self._uss.append(_NAN if p.uss_bytes is None else float(p.uss_bytes))

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self.quiet = None
        for ring in (self._rss, self._gpu_memory, self._uss):
            if ring is not None:
                ring.resize(capacity)

    def samples(self) -> Iterator[Sample]:
        for t, rss, gpu in zip(self.times, self.rss, self.gpu_memory):
            yield Sample(t, None if math.isnan(rss) else int(rss),
                         None if math.isnan(gpu) else int(gpu))

    def __len__(self) -> int:
        return len(self._rss)


def _since(since: Optional[float], now_in_state: bool, taken_at: float) -> Optional[float]:
    if not now_in_state:
        return None
    return since if since is not None else taken_at
