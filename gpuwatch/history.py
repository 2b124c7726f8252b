"""Bounded history: what detectors need to see change over time.

Per process identity (PID + start time, so a reused PID starts afresh): its parent and job as
first seen (an orphan is a process whose recorded launcher is gone, whoever adopted it), when it
was reparented, since when it has been a zombie or in uninterruptible sleep, and its RSS and GPU
memory samples. Per job: its members and trainers (GPU holders), and when the last trainer exited
(what is still alive after that is a leftover). Per GPU: its recent unattributed memory, and
since when NVML has listed each PID that /proc lacks (a ghost must outlast process churn).

Everything is capped and whatever is absent from a poll is forgotten, so the daemon's memory stays
flat however long it runs. Samples are rings of doubles (8 bytes a figure, NaN for unknown) taken
whole at a process's first sight, so the history's memory is the processes' count times
history.samples x 16 bytes from the first poll on, not a climb over the history's span; every
process is sampled at the same polls, so their times are kept once (SampleClock).

An instrumented process's RSS series is the kernel's figure (/proc) at each poll, against the
step it had reached, as its GPU memory is NVML's: the RSS its agent reports is its own word,
which any process can make up (docs/security.md, rule 4); it is only compared with the kernel's,
and disagreements counted.

What agent reports make it keep (each reporting process's step series) is charged to the
reporting user in the agent memory budget (gpuwatch.agent_budget), at the size each series can
reach, when it is created: a series the budget refuses is not kept (and counted), and at each
poll the budget takes back from users above their share the step histories of their processes,
those without an open finding and reporting least recently first. A process whose agent slot is
gone (evicted, or the process exited) loses its step history at the next poll.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple, Optional

from gpuwatch.agent_budget import AgentBudget, fair_shares
from gpuwatch.jobs.key import JobKey
from gpuwatch.jobs.records import Identity, JobRecord, JobTrees
from gpuwatch.launch_env import process_title
from gpuwatch.ledger import FindingsLedger
from gpuwatch.model import (
    NO_DISCOVERY,
    BufferSize,
    HostProcess,
    Job,
    NodeSnapshot,
    StepPoint,
)
from gpuwatch.protocol import MAX_BUFFERS  # buffer names followed per process
from gpuwatch.vocabulary import ProcState

_NAN = math.nan
#: How many exited processes are remembered (for "parent 4121 (torchrun) exited" reasons).
_DEPARTED = 4096
#: Step points kept per instrumented process for its step, RSS, CUDA and GPU series: the leak
#: test's window and then some, and the seconds per step over a long stretch.
STEP_POINTS = 512
#: Points kept per watched buffer and per discovered container, two series each (items, bytes).
#: The leak test reads at most the newest 2 x detectors.leak_window points of a series (128 at
#: the default window of 64); these are most of what a process with many buffers costs.
SERIES_POINTS = 160
#: Unattributed-memory readings kept per GPU: enough to cover a ghost grace at a fast interval.
GPU_READINGS = 64


class Sample(NamedTuple):
    taken_at: float
    rss_bytes: Optional[int]
    gpu_memory_bytes: Optional[int]


class Departed(NamedTuple):
    name: Optional[str]
    #: Last poll that saw it alive; it exited between then and the next poll.
    last_seen: float


def series_bytes(capacity: int) -> int:
    """Memory of a Series filled to `capacity`: two arrays of doubles (8 bytes a point, and
    the array's over-allocation) and the object (measured with tracemalloc: 17.2 a point)."""
    return 96 + 18 * capacity


#: A StepSeries with its four step-aligned series full, its dictionaries and the object.
STEP_BYTES = 640 + 4 * series_bytes(STEP_POINTS)
#: One buffer's or discovered container's two series (items, bytes) and their entries.
PAIR_BYTES = 160 + 2 * series_bytes(SERIES_POINTS)
#: An agent's RSS and the kernel's at the next poll differ by the allocations in between: by
#: more than this share of the kernel's figure and RSS_SLACK_BYTES, they disagree.
RSS_TOLERANCE = 0.25
RSS_SLACK_BYTES = 64 << 20
#: Names a StepSeries remembers as refused, so that each is counted once.
_REFUSED_NAMES = 256


class Series:
    """A bounded, step- or time-aligned run of one figure: parallel packed arrays."""

    __slots__ = ("capacity", "xs", "ys")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.xs = array("d")
        self.ys = array("d")

    def add(self, x: float, y: Optional[float]) -> None:
        self.xs.append(x)
        self.ys.append(_NAN if y is None else float(y))
        if len(self.xs) > self.capacity:
            del self.xs[0]
            del self.ys[0]

    def __len__(self) -> int:
        return len(self.xs)


#: Discovered containers followed per process. The agent names its current top growers (8 at a
#: time), and those change over a run; the least recently reported are dropped beyond this.
MAX_DISCOVERED = 32


class StepSeries:
    """What an instrumented process reported, by training step (docs/agent-protocol.md).

    Discovered containers' series hold a point only at the steps of reports that followed a
    discovery pass: they are sparse, each point a fresh measurement.

    With a `budget`, every buffer's and discovered container's pair of series is charged to
    `uid` (PAIR_BYTES) before it is created, and not created when the budget refuses; the
    caller charges STEP_BYTES for the rest. `release()` gives all of it back.
    """

    __slots__ = ("budget", "buffer_bytes", "buffer_items", "capacity", "charged", "cuda",
                 "discovered_bytes", "discovered_items", "discovered_latest", "gpu",
                 "refused_names", "rss", "series_points", "ticking", "times", "uid")

    def __init__(self, capacity: int, budget: Optional[AgentBudget] = None, uid: int = 0,
                 charged: int = 0, series_points: int = SERIES_POINTS) -> None:
        self.capacity = capacity
        self.series_points = series_points
        self.budget = budget
        self.uid = uid
        #: Bytes charged to the budget for this process, STEP_BYTES included.
        self.charged = charged
        self.refused_names: set[str] = set()
        self.times = Series(capacity)  # step -> receive time, for seconds per step
        #: The kernel's RSS (/proc) at each poll, against the step reached by then: never the
        #: agent's own figure (docs/design-notes.md, "RSS from /proc").
        self.rss = Series(capacity)
        #: torch's allocated bytes: what tensors hold, which a GPU leak is decided on.
        self.cuda = Series(capacity)
        #: NVML's figure at each poll, against the step the process had reached by then.
        self.gpu = Series(capacity)
        self.buffer_items: dict[str, Series] = {}
        self.buffer_bytes: dict[str, Series] = {}
        # Least recently reported first, in both.
        self.discovered_items: OrderedDict[str, Series] = OrderedDict()
        self.discovered_bytes: OrderedDict[str, Series] = OrderedDict()
        #: The names in the newest report that carried a discovery pass: what grows now.
        self.discovered_latest: frozenset[str] = frozenset()
        #: Its points are `tick` reports (a process that has not stepped): every series is by
        #: the time received, not by step. Its first step report starts the series afresh.
        self.ticking = False

    @property
    def last_report_at(self) -> float:
        """When the newest step point was received (0 before any)."""
        return self.times.ys[-1] if len(self.times) else 0.0

    def _reserve(self, name: str) -> bool:
        """Charge a new pair of series, or count it refused (once per name)."""
        if self.budget is None:
            return True
        reason = self.budget.grant(self.uid, "history", PAIR_BYTES)
        if reason is None:
            self.charged += PAIR_BYTES
            self.refused_names.discard(name)
            return True
        if name not in self.refused_names and len(self.refused_names) < _REFUSED_NAMES:
            self.refused_names.add(name)
            self.budget.refused("series", reason)
        return False

    def _unreserve(self) -> None:
        if self.budget is not None:
            self.budget.release(self.uid, "history", PAIR_BYTES)
            self.charged -= PAIR_BYTES

    def release(self) -> int:
        """Give back everything charged for this process; the bytes."""
        charged, self.charged = self.charged, 0
        if self.budget is not None:
            self.budget.release(self.uid, "history", charged)
        return charged

    def add(self, point: StepPoint) -> None:
        if point.ticked:
            self.ticking = True
            step = point.at
        else:
            step = float(point.step)
        self.times.add(step, point.at)
        self.cuda.add(step, point.cuda_allocated_bytes)
        items, sizes = self.buffer_items, self.buffer_bytes
        for name, size in point.buffers.items():
            item_series = items.get(name)
            if item_series is None:
                if len(items) >= MAX_BUFFERS or not self._reserve(name):
                    continue
                item_series = items[name] = Series(self.series_points)
                sizes[name] = Series(self.series_points)
            item_series.add(step, size.items)
            sizes[name].add(step, size.bytes)
        if point.discovered is not NO_DISCOVERY:
            self._add_discovered(step, point.discovered)

    def _add_discovered(self, step: float, discovered: Mapping[str, BufferSize]) -> None:
        self.discovered_latest = frozenset(discovered)
        items, sizes = self.discovered_items, self.discovered_bytes
        for name, size in discovered.items():
            if name in items:
                items.move_to_end(name)
                sizes.move_to_end(name)
            elif self._reserve(name):
                items[name] = Series(self.series_points)
                sizes[name] = Series(self.series_points)
            else:
                continue
            items[name].add(step, size.items)
            sizes[name].add(step, size.bytes)
        while len(items) > MAX_DISCOVERED:
            items.popitem(last=False)
            sizes.popitem(last=False)
            self._unreserve()

    def add_gpu(self, step: int, gpu_memory: Optional[int]) -> None:
        if len(self.gpu) and self.gpu.xs[-1] >= step:
            return  # no step since the last poll: nothing new to align
        self.gpu.add(float(step), gpu_memory)

    def add_rss(self, step: int, rss: Optional[int]) -> None:
        """The kernel's RSS of the process at a poll, against the step it had reached."""
        if len(self.rss) and self.rss.xs[-1] >= step:
            return
        self.rss.add(float(step), rss)


class Ring:
    """The newest `capacity` figures, in one array of doubles taken whole when the ring is made:
    a process's samples cost their memory at its first sight, never more as they fill, and the
    oldest is overwritten in place."""

    __slots__ = ("_data", "_size", "_start")

    def __init__(self, capacity: int, unknown: int = 0) -> None:
        self._data = array("d", [_NAN]) * max(1, capacity)
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

    def resize(self, capacity: int) -> None:
        kept = self.values()[-max(1, capacity):]
        self._data = array("d", [_NAN]) * max(1, capacity)
        self._data[:len(kept)] = kept
        self._start, self._size = 0, len(kept)


class SampleClock:
    """When the history's samples were taken: one time for every process sampled then.

    Every process is sampled at the same polls (those at least `sample_spacing` after the last
    one), so the times are kept once, not once per process: a process's samples are the newest
    of these, as many as it has."""

    __slots__ = ("_ordered", "_times")

    def __init__(self, capacity: int) -> None:
        self._times = Ring(capacity)
        self._ordered: Optional[array[float]] = None

    def due(self, now: float, spacing: float) -> bool:
        """Whether a poll at `now` is a sample (a hundredth of the spacing spares one that
        came a rounding error early)."""
        return not len(self._times) or now - self.newest(1)[0] >= 0.99 * spacing

    def add(self, now: float) -> None:
        self._times.append(now)
        self._ordered = None

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
                 "reparented_at", "start_time", "steps", "steps_refused",
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
        self._rss = Ring(capacity)
        self._gpu_memory = Ring(capacity)
        #: USS at each sample (NaN where unknown), once the poll has read one for the process
        #: (forked workers of GPU jobs): None until then, so other processes pay nothing for it.
        self._uss: Optional[Ring] = None

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

    @property
    def uss(self) -> Optional[array[float]]:
        return self._uss.values() if self._uss is not None else None

    def observe(self, p: HostProcess, taken_at: float, sample: bool = True) -> None:
        """Record what one poll saw; with `sample` (a poll the history samples, at the
        SampleClock's time), its figures too."""
        self.last_seen = taken_at
        if self.reparented_at is None and p.ppid != self.first_ppid:
            self.reparented_at = taken_at
        self.zombie_since = _since(self.zombie_since, p.state == ProcState.ZOMBIE, taken_at)
        self.disk_sleep_since = _since(self.disk_sleep_since, p.state == ProcState.DISK_SLEEP,
                                       taken_at)
        self.held_gpu = self.held_gpu or p.holds_gpu
        if not sample:
            return
        rss, gpu = p.rss_bytes, p.gpu_memory_bytes
        self._rss.append(_NAN if rss is None else float(rss))
        self._gpu_memory.append(_NAN if gpu is None else float(gpu))
        if self._uss is None and p.uss_bytes is not None:
            self._uss = Ring(self.capacity, unknown=len(self._rss) - 1)
        if self._uss is not None:
            self._uss.append(_NAN if p.uss_bytes is None else float(p.uss_bytes))

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
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


class History:
    """`sample_spacing`: the least seconds between two samples kept of a process (0: every
    poll's), so that `samples` of them span a stretch of time whatever the poll interval
    (gpuwatch.config.sample_spacing: what the time-based leak test needs)."""

    def __init__(self, samples: int = 300, max_processes: int = 4096,
                 budget: Optional[AgentBudget] = None, sample_spacing: float = 0.0) -> None:
        self.samples = samples
        self.sample_spacing = sample_spacing
        self.max_processes = max_processes
        self.polls = 0
        #: Where step histories are charged; shared with the agent receiver in the daemon.
        self.budget = budget if budget is not None else AgentBudget()
        self.budget.add_reclaimer(self._reclaim, order=0)
        self._by_identity: OrderedDict[Identity, ProcessHistory] = OrderedDict()
        #: When the samples were taken: every process is sampled at the same polls.
        self._clock = SampleClock(samples)
        #: The processes that have a step history, for the poll's pass over them.
        self._stepped: dict[Identity, ProcessHistory] = {}
        self._departed: OrderedDict[Identity, Departed] = OrderedDict()
        self._jobs = JobTrees()
        #: The findings open at the last poll (gpuwatch.ledger).
        self.findings = FindingsLedger()
        self._unattributed: dict[int, deque[tuple[float, Optional[int]]]] = {}
        self._unlisted_since: dict[int, float] = {}
        #: Polls at which a process's newest step report claimed an RSS the kernel's figure did
        #: not bear out (gpuwatch_agent_rss_disagreements_total): the leak test never uses the
        #: agent's figure, this only shows an agent that lies (or measures something else).
        self.rss_disagreements = 0

    def __len__(self) -> int:
        return len(self._by_identity)

    def get(self, identity: Identity) -> Optional[ProcessHistory]:
        return self._by_identity.get(identity)

    def departed(self, identity: Identity) -> Optional[Departed]:
        return self._departed.get(identity)

    def job(self, key: Optional[JobKey]) -> Optional[JobRecord]:
        return self._jobs.get(key)

    def jobs(self) -> Iterable[JobRecord]:
        return self._jobs

    def job_of(self, p: HostProcess) -> Optional[JobRecord]:
        h = self._by_identity.get(p.identity)
        return self.job(h.job_key) if h is not None else None

    def job_label(self, p: HostProcess) -> Optional[Job]:
        """The process's own job, else the label of the job tree it was first seen in: a
        launcher or a helper carries no job variables, yet it belongs to its workers' job."""
        if p.job is not None:
            return p.job
        record = self.job_of(p)
        return record.label if record is not None else None

    def unattributed_held(self, gpu: int, min_bytes: int, seconds: float, now: float) -> bool:
        """Whether GPU `gpu` has had at least `min_bytes` of unattributed memory at every
        reading over the last `seconds` (or over every reading kept, when they cover less). A
        holder that exits between NVML's memory figure and its process list leaves such an
        excess for a poll or two; a dead context keeps it."""
        readings = self._unattributed.get(gpu)
        if not readings:
            return False
        for at, unattributed in reversed(readings):
            if unattributed is None or unattributed < min_bytes:
                return False
            if at <= now - seconds:
                return True
        return len(readings) == readings.maxlen

    def unlisted_since(self, pid: int) -> Optional[float]:
        """Since when NVML has listed `pid` as holding GPU memory while /proc has no such PID."""
        return self._unlisted_since.get(pid)

    def watch_pids(self) -> set[int]:
        """Members of jobs that have had trainers: read them every poll, even reparented."""
        return self._jobs.watch_pids()

    # -- one poll ------------------------------------------------------------------------------
    def record(self, snapshot: NodeSnapshot) -> None:
        self.polls += 1
        now = snapshot.taken_at
        procs = snapshot.processes
        seen: set[Identity] = set()
        sample = self._clock.due(now, self.sample_spacing)
        if sample:
            self._clock.add(now)
        for p in procs.values():
            if not p.in_procfs or p.start_time is None:
                continue
            key = p.identity
            seen.add(key)
            h = self._by_identity.get(key)
            if h is None:
                parent = procs.get(p.ppid) if p.ppid else None
                h = ProcessHistory(p, parent, self._first_job_key(p, parent, snapshot), now,
                                   self.samples, self._clock)
                self._by_identity[key] = h
            h.observe(p, now, sample)
            self._by_identity.move_to_end(key)
        for key in [k for k in self._by_identity if k not in seen]:
            gone = self._by_identity.pop(key)
            self._drop_steps(gone)
            self._departed[key] = Departed(gone.name, gone.last_seen)
        while len(self._departed) > _DEPARTED:
            self._departed.popitem(last=False)
        self._trim()
        self._record_agents(snapshot)
        self._jobs.update(snapshot, lambda p: self._by_identity.get(p.identity))
        self._record_gpus(snapshot)

    def _record_gpus(self, snapshot: NodeSnapshot) -> None:
        now = snapshot.taken_at
        readings = {}
        for g in snapshot.gpus:  # a GPU missing from a poll starts afresh when it is back
            kept = self._unattributed.get(g.index) or deque(maxlen=GPU_READINGS)
            kept.append((now, g.unattributed_memory_bytes))
            readings[g.index] = kept
        self._unattributed = readings
        since = self._unlisted_since
        self._unlisted_since = {p.pid: since.get(p.pid, now)
                                for p in snapshot.processes.values()
                                if not p.in_procfs and p.holds_gpu}

    def _record_agents(self, snapshot: NodeSnapshot) -> None:
        agents = snapshot.agents
        for h in list(self._stepped.values()):
            agent = agents.get(h.pid)
            if agent is None or h.steps is None or agent.uid != h.steps.uid:
                self._drop_steps(h)  # its slot is gone: evicted, or a PID reused
        budget = self.budget
        for pid, agent in agents.items():
            p = snapshot.processes.get(pid)
            h = self._by_identity.get(p.identity) if p is not None else None
            if h is None:
                continue
            if h.steps is None:
                reason = budget.grant(agent.uid, "history", STEP_BYTES)
                if reason is not None:
                    if not h.steps_refused:
                        h.steps_refused = True
                        budget.refused("history", reason)
                    continue
                h.steps_refused = False
                h.steps = StepSeries(STEP_POINTS, budget, agent.uid, STEP_BYTES)
                self._stepped[h.identity] = h
            if h.steps.ticking and any(not point.ticked for point in agent.points):
                # Its first step: the series by time give way to series by step.
                uid = h.steps.uid
                self._drop_steps(h)
                if budget.grant(uid, "history", STEP_BYTES) is not None:
                    continue
                h.steps = StepSeries(STEP_POINTS, budget, uid, STEP_BYTES)
                self._stepped[h.identity] = h
            for point in agent.points:
                if point.ticked and len(h.steps.times) and not h.steps.ticking:
                    continue  # a tick after a step (reordered): the series are by step now
                h.steps.add(point)
            if p is not None and agent.step is not None:
                h.steps.add_rss(agent.step, p.rss_bytes)
                if p.holds_gpu:
                    h.steps.add_gpu(agent.step, p.gpu_memory_bytes)
            if p is not None and agent.points:
                self._compare_rss(agent.points[-1].rss_bytes, p.rss_bytes)
        budget.reclaim()
        budget.give_pages_back()

    def _compare_rss(self, claimed: Optional[int], kernel: Optional[int]) -> None:
        """Count an agent's RSS that the kernel's, read at this poll, does not bear out: off by
        more than RSS_TOLERANCE of it and RSS_SLACK_BYTES."""
        if claimed is None or kernel is None:
            return
        if abs(claimed - kernel) > max(RSS_TOLERANCE * kernel, RSS_SLACK_BYTES):
            self.rss_disagreements += 1

    def _drop_steps(self, h: ProcessHistory) -> int:
        self._stepped.pop(h.identity, None)
        steps, h.steps = h.steps, None
        return steps.release() if steps is not None else 0

    def _reclaim(self, uid: int, nbytes: int, reason: str) -> int:
        """The budget's reclaimer: drop `uid`'s step histories until `nbytes` are freed,
        those of processes without an open finding first, then the least recently reporting."""
        flagged = self.findings.processes()
        candidates = sorted(
            (h for h in self._stepped.values() if h.steps is not None and h.steps.uid == uid),
            key=lambda h: (h.identity in flagged, h.steps.last_report_at if h.steps else 0.0))
        return self.budget.free("history", reason, nbytes, candidates, self._drop_steps)

    def _first_job_key(self, p: HostProcess, parent: Optional[HostProcess],
                       snapshot: NodeSnapshot) -> Optional[JobKey]:
        """The job a process first seen belongs to: the tree the snapshot puts it in, except
        under a trainer seen before it forked (its data loader's workers): the trainer is the
        root of their tree now that it has children, but it and they are the job the trainer
        was first seen in, whose trainer it is."""
        key = JobKey.of(p.pid, snapshot)
        if parent is None or snapshot.job_roots.get(p.pid) != parent.pid:
            return key
        known = self._by_identity.get(parent.identity)
        if known is None or not known.held_gpu or known.job_key is None:
            return key
        return known.job_key

    def _trim(self) -> None:
        """Forget processes past `max_processes`, shared by user (max-min fair): a user with
        more processes than the room leaves another user's histories, and with them the
        lineage that shows an orphan, in place. Within a user's share its GPU holders are kept
        first, then the most recently seen."""
        if len(self._by_identity) <= self.max_processes:
            return
        by_user: dict[Optional[int], list[Identity]] = {}
        for key, h in self._by_identity.items():  # the oldest seen first
            by_user.setdefault(h.uid, []).append(key)
        shares = fair_shares({uid: len(keys) for uid, keys in by_user.items()},
                             self.max_processes)
        for uid, keys in by_user.items():
            over = len(keys) - shares[uid]
            if over <= 0:
                continue
            for key in sorted(keys, key=lambda k: self._by_identity[k].held_gpu)[:over]:
                self._drop_steps(self._by_identity.pop(key))

    def resize(self, samples: int, max_processes: int,
               sample_spacing: Optional[float] = None) -> None:
        """Apply a reloaded configuration without losing what fits."""
        if sample_spacing is not None:
            self.sample_spacing = sample_spacing
        if samples != self.samples:
            self._clock.resize(samples)
            for h in self._by_identity.values():
                h.resize(samples)
        self.samples = samples
        self.max_processes = max_processes
        self._trim()
