"""Asking an instrumented process to search harder for its leak's culprit: a faster search for
growing containers, and a trace of its allocations.

When neither a watched buffer nor a discovered container explains a leak, the agent in the
leaking process can look harder (docs/agent-protocol.md):

- a faster search: for `agent.search_seconds` its discovery takes a larger share of the training
  thread (the agent's SEARCH_SHARE instead of 1%), so that the library's modules, walked at a
  lower rate than the program's own, are gone through several times a minute. Asked for a leak
  of RSS or of GPU memory (a container of tensors explains either) as soon as it is raised
  without a culprit, of a process whose agent can be answered, at most once per process per
  `agent.trace_cooldown` seconds (the agent also ignores a second one within its own cooldown);
- a trace: tracemalloc over a few steps, answered with the allocation sites that grew. Tracing
  slows the program's own Python allocations while it runs, so the daemon asks sparingly:

- only for a leak of RSS whose culprit is unknown (Python's allocations cannot explain GPU
  memory), only a process whose agent can be answered (`AgentReading.can_reply`);
- only once the leak has stayed unexplained for `agent.trace_after` seconds (by default 0: as
  soon as it is raised; discovery names a container of the program's own code before that, and
  a culprit in the library's may take the faster search a minute);
- at most once per process per `agent.trace_cooldown` seconds, whatever the outcome: sent,
  failed (its queue full, its socket gone) or not made because `agent.tracing` is off;
- at most `agent.trace_max_pending` requests awaiting an answer on the node, shared by user (the
  kernel's UID of the reports): when all are taken, a process of a user holding fewer than its
  share (`trace_max_pending` / users with requests, its own counted) takes the place of the
  oldest request of the user holding the most, which stops counting as pending; one of a user
  holding its share waits. A user whose processes leak and never answer cannot hold every
  request for a cooldown. A request is answered by the process's next trace report; one
  unanswered for `agent.trace_cooldown` seconds stops counting as pending.

Trace requests are counted by result: `sent`, `failed`, `rate_limited` (held back by the pending
limit: counted once until it goes out) and `disabled` (`agent.tracing` off: counted once per
cooldown); search requests `sent` or `failed`. A leak that stays unexplained is not counted again
on every poll: the counts say what was decided, not how often it was looked at.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Callable, Optional, Protocol

from gpuwatch.config import AgentConfig
from gpuwatch.evidence import LeakEvidence
from gpuwatch.model import AgentReading, Kind, NodeReport, NodeSnapshot, TraceReport
from gpuwatch.units import human_bytes
from gpuwatch.vocabulary import Series, TraceStatus

log = logging.getLogger(__name__)

SENT = "sent"
FAILED = "failed"
RATE_LIMITED = "rate_limited"
DISABLED = "disabled"
RESULTS = (SENT, FAILED, RATE_LIMITED, DISABLED)
SEARCH_RESULTS = (SENT, FAILED)
#: The series of a leak that a discovered container can explain: host memory, or GPU memory (a
#: container of CUDA tensors).
_SEARCHED_SERIES = frozenset({Series.RSS, Series.GPU_MEMORY})


class TraceSender(Protocol):
    def request_trace(self, pid: int, steps: int) -> bool: ...

    def request_search(self, pid: int, seconds: int) -> bool: ...


class _Pending:
    __slots__ = ("previous", "sent_at", "steps", "uid")

    def __init__(self, sent_at: float, steps: int, previous: Optional[TraceReport],
                 uid: int) -> None:
        self.sent_at = sent_at
        self.steps = steps
        self.uid = uid
        #: The trace report the process had sent before: the answer is the next one.
        self.previous = previous


class TraceRequests:
    """Decides which processes to ask for a trace after each poll's findings, and asks them.

    `before_assess` settles the requests the poll's agent readings answer and puts those still
    pending into the snapshot (the leak detector shows them as requested); `after_assess` asks
    for new ones. `config` may be replaced on reload.
    """

    def __init__(self, sender: TraceSender, config: AgentConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sender = sender
        self.config = config
        self._clock = clock
        self._pending: dict[int, _Pending] = {}
        #: When each process was last asked (or found not to be askable), for the cooldown.
        self._asked: dict[int, float] = {}
        #: Processes the pending limit holds back, counted once as rate_limited until asked.
        self._held: set[int] = set()
        self._counts = dict.fromkeys(RESULTS, 0)
        #: When each process was last asked for a faster search, for the cooldown.
        self._searched: dict[int, float] = {}
        self._search_counts = dict.fromkeys(SEARCH_RESULTS, 0)

    @property
    def counts(self) -> Mapping[str, int]:
        """Requests by result since start: sent, failed, rate_limited, disabled."""
        return MappingProxyType(dict(self._counts))

    @property
    def search_counts(self) -> Mapping[str, int]:
        """Search requests by result since start: sent, failed."""
        return MappingProxyType(dict(self._search_counts))

    @property
    def pending(self) -> Mapping[int, int]:
        """Processes asked and not answered yet: PID -> the steps asked for."""
        return MappingProxyType({pid: p.steps for pid, p in self._pending.items()})

    def before_assess(self, snapshot: NodeSnapshot) -> NodeSnapshot:
        """Settle the requests this snapshot answers (or whose process is gone, or that waited
        too long); the snapshot with those still pending in `traces_pending`."""
        now = self._clock()
        agents = snapshot.agents
        for pid, request in list(self._pending.items()):
            agent = agents.get(pid)
            if agent is None:
                del self._pending[pid]
            elif agent.trace is not None and agent.trace != request.previous:
                del self._pending[pid]
                _log_answer(pid, _name(snapshot, pid), agent.trace)
            elif now - request.sent_at >= self.config.trace_cooldown:
                del self._pending[pid]
                log.info("PID %d (%s) did not answer its trace request in %g s", pid,
                         _name(snapshot, pid), self.config.trace_cooldown)
        # Whatever is known of a process goes with it: a PID reused later starts afresh.
        self._asked = {pid: at for pid, at in self._asked.items() if pid in agents}
        self._searched = {pid: at for pid, at in self._searched.items() if pid in agents}
        self._held &= agents.keys()
        return replace(snapshot, traces_pending=self.pending)

    def after_assess(self, report: NodeReport) -> None:
        """Ask the processes whose leak has no culprit to search faster, and those whose
        host-memory leak has none to trace, within the limits."""
        config = self.config
        now = self._clock()
        agents = report.snapshot.agents
        for f in report.findings:
            if f.kind != Kind.LEAK or f.pid is None:
                continue
            leak = f.details
            if not isinstance(leak, LeakEvidence) or leak.culprit is not None:
                continue
            if leak.series in _SEARCHED_SERIES:
                self._search(f.pid, report, now)
            if leak.series != Series.RSS:
                continue
            if f.since is not None and report.snapshot.taken_at - f.since < config.trace_after:
                continue
            pid = f.pid
            agent = agents.get(pid)
            if agent is None or not agent.can_reply or pid in self._pending:
                continue
            asked = self._asked.get(pid)
            if asked is not None and now - asked < config.trace_cooldown:
                continue
            if not config.tracing:
                self._asked[pid] = now
                self._counts[DISABLED] += 1
                continue
            if (len(self._pending) >= config.trace_max_pending
                    and not self._make_room(agent.uid, report.snapshot)):
                if pid not in self._held:
                    self._held.add(pid)
                    self._counts[RATE_LIMITED] += 1
                continue
            self._held.discard(pid)
            self._asked[pid] = now
            self._request(pid, agent, report, now)

    def _make_room(self, uid: int, snapshot: NodeSnapshot) -> bool:
        """With every pending request taken: whether `uid` holds fewer than its share of them,
        in which case the oldest request of the user holding the most stops counting."""
        by_uid: dict[int, list[int]] = {}
        for pid, request in self._pending.items():
            by_uid.setdefault(request.uid, []).append(pid)
        users = len(by_uid) + (uid not in by_uid)
        if len(by_uid.get(uid, ())) >= self.config.trace_max_pending // users:
            return False
        most = max(by_uid.values(), key=len)
        victim = min(most, key=lambda pid: self._pending[pid].sent_at)
        del self._pending[victim]
        log.info("PID %d (%s): its trace request, unanswered, gives way to another user's "
                 "(its user holds more than its share of agent.trace_max_pending)", victim,
                 _name(snapshot, victim))
        return True

    def _search(self, pid: int, report: NodeReport, now: float) -> None:
        seconds = self.config.search_seconds
        agent = report.snapshot.agents.get(pid)
        if not seconds or agent is None or not agent.can_reply:
            return
        asked = self._searched.get(pid)
        if asked is not None and now - asked < self.config.trace_cooldown:
            return
        self._searched[pid] = now
        name = _name(report.snapshot, pid)
        if self.sender.request_search(pid, seconds):
            self._search_counts[SENT] += 1
            log.info("asked PID %d (%s) to search for growing containers at a higher share of "
                     "its time for %d s: its memory grows every step and nothing it reports "
                     "explains it", pid, name, seconds)
        else:
            self._search_counts[FAILED] += 1
            log.info("could not ask PID %d (%s) to search faster: the request could not be "
                     "sent; trying again in %g s", pid, name, self.config.trace_cooldown)

    def _request(self, pid: int, agent: AgentReading, report: NodeReport, now: float) -> None:
        steps = self.config.trace_steps
        name = _name(report.snapshot, pid)
        if self.sender.request_trace(pid, steps):
            self._pending[pid] = _Pending(now, steps, agent.trace, agent.uid)
            self._counts[SENT] += 1
            log.info("asked PID %d (%s) to trace its allocations for %d steps: its RSS grows "
                     "every step and nothing it reports explains it", pid, name, steps)
        else:
            self._counts[FAILED] += 1
            log.info("could not ask PID %d (%s) to trace its allocations: the request could "
                     "not be sent; trying again in %g s", pid, name, self.config.trace_cooldown)


def _name(snapshot: NodeSnapshot, pid: int) -> str:
    p = snapshot.processes.get(pid)
    return (p.name if p is not None else None) or "?"


def _log_answer(pid: int, name: str, trace: TraceReport) -> None:
    if trace.status != TraceStatus.DONE:
        log.info("PID %d (%s) answered its trace request: %s%s", pid, name, trace.status,
                 f" ({trace.why})" if trace.why else "")
        return
    if not trace.sites or not trace.steps:
        log.info("PID %d (%s) traced %s steps: no allocation site grew", pid, name,
                 trace.steps or 0)
        return
    top = max(trace.sites, key=lambda s: s.bytes)
    log.info("PID %d (%s) traced %d steps: top allocation site %s:%d, +%s/step", pid, name,
             trace.steps, top.file, top.line, human_bytes(round(top.bytes / trace.steps)))
