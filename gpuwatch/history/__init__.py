"""Bounded history: what detectors need to see change over time.

Per process identity (PID + start time, so a reused PID starts afresh): its parent and job as
first seen (an orphan is a process whose recorded launcher is gone, whoever adopted it), when it
was reparented, since when it has been a zombie or in uninterruptible sleep, and its RSS and GPU
memory samples (gpuwatch.history.samples). Per job: its members and trainers (GPU holders), and
when the last trainer exited (what is still alive after that is a leftover). Per GPU: its recent
unattributed memory, and since when NVML has listed each PID that /proc lacks (a ghost must
outlast process churn).

Everything is capped and whatever is absent from a poll is forgotten, so the daemon's memory stays
flat however long it runs.

An instrumented process's step series (gpuwatch.history.steps) hold the kernel's RSS at each
poll, against the step it had reached: the RSS its agent reports is only compared with the
kernel's, and disagreements counted.

What agent reports make it keep (each reporting process's step series) is charged to the
reporting user in the agent memory budget (gpuwatch.agent_budget), at the size each series can
reach, when it is created: a series the budget refuses is not kept (and counted), and at each
poll the budget takes back from users above their share the step histories of their processes,
those without an open finding and reporting least recently first. A process whose agent slot is
gone (evicted, or the process exited) loses its step history at the next poll.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from typing import NamedTuple, Optional

from gpuwatch.agent_budget import AgentBudget, fair_shares
from gpuwatch.history.samples import FigureRing, ProcessHistory, Ring, Sample, SampleClock
from gpuwatch.history.steps import (
    MAX_DISCOVERED,
    PAIR_BYTES,
    SERIES_POINTS,
    STEP_BYTES,
    STEP_POINTS,
    Series,
    StepSeries,
    series_bytes,
)
from gpuwatch.jobs.key import JobKey
from gpuwatch.jobs.records import Identity, JobRecord, JobTrees
from gpuwatch.ledger import FindingsLedger
from gpuwatch.model import HostProcess, Job, NodeSnapshot

__all__ = [
    "GPU_READINGS", "MAX_DISCOVERED", "PAIR_BYTES", "RSS_SLACK_BYTES", "RSS_TOLERANCE",
    "SERIES_POINTS", "STEP_BYTES", "STEP_POINTS", "Departed", "FigureRing", "History",
    "ProcessHistory",
    "Ring", "Sample", "SampleClock", "Series", "StepSeries", "series_bytes",
]

#: How many exited processes are remembered (for "parent 4121 (torchrun) exited" reasons).
_DEPARTED = 4096
#: Unattributed-memory readings kept per GPU: enough to cover a ghost grace at a fast interval.
GPU_READINGS = 64


class Departed(NamedTuple):
    name: Optional[str]
    #: Last poll that saw it alive; it exited between then and the next poll.
    last_seen: float


#: An agent's RSS and the kernel's at the next poll differ by the allocations in between: by
#: more than this share of the kernel's figure and RSS_SLACK_BYTES, they disagree.
RSS_TOLERANCE = 0.25
RSS_SLACK_BYTES = 64 << 20


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

    def job_labels(self, processes: Mapping[int, HostProcess]) -> dict[int, Job]:
        """job_label of each of `processes` that has one, by PID (one pass, for a report)."""
        by_identity, jobs = self._by_identity, self._jobs
        labels: dict[int, Job] = {}
        for pid, p in processes.items():
            job = p.job
            if job is None:
                h = by_identity.get(p.identity)
                record = jobs.get(h.job_key) if h is not None else None
                job = record.label if record is not None else None
            if job is not None:
                labels[pid] = job
        return labels

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
        by_identity = self._by_identity
        #: Each process recorded, with its identity and history, for the job trees.
        recorded: list[tuple[HostProcess, Identity, ProcessHistory]] = []
        for p in procs.values():
            if not p.in_procfs or p.start_time is None:
                continue
            key = (p.pid, p.start_time)
            seen.add(key)
            h = by_identity.get(key)
            if h is None:
                parent = procs.get(p.ppid) if p.ppid else None
                h = ProcessHistory(p, parent, self._first_job_key(p, parent, snapshot), now,
                                   self.samples, self._clock)
                by_identity[key] = h
            h.observe(p, now, sample)
            by_identity.move_to_end(key)
            recorded.append((p, key, h))
        for key in [k for k in by_identity if k not in seen]:
            gone = self._by_identity.pop(key)
            self._drop_steps(gone)
            self._departed[key] = Departed(gone.name, gone.last_seen)
        while len(self._departed) > _DEPARTED:
            self._departed.popitem(last=False)
        if self._trim():
            recorded = [r for r in recorded if r[1] in by_identity]
        self._record_agents(snapshot)
        self._jobs.update(snapshot, recorded)
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

    def _trim(self) -> bool:
        """Forget processes past `max_processes`, shared by user (max-min fair): a user with
        more processes than the room leaves another user's histories, and with them the
        lineage that shows an orphan, in place. Within a user's share its GPU holders are kept
        first, then the most recently seen. Whether any was forgotten."""
        if len(self._by_identity) <= self.max_processes:
            return False
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
        return True

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
