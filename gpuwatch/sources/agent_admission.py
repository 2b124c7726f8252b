"""What the receiver admits and keeps of agent reports: the report rate, the slots, the
pending points and the memory budget, each shared fairly by user (gpuwatch.sources.agent_socket
says the bounds; docs/agent.md why the budget is shared as it is).

`RateLimiter`: `max_reports_per_second` shared by the users that sent in the last 10 s, and
each user's share by its processes that did (at least PROCESS_REPORTS_PER_SECOND_MIN each), in
token buckets of one second's worth; checked before a report is parsed.

`AgentStore`: at most `max_processes` reporting processes (a user under its share takes the
least recently reporting slot of the user holding the most), at most `max_points` pending points
each and `max_pending` entries in all (over it, a user at its share loses its own oldest points),
and everything kept charged to the agent memory budget, taken back at each poll from the users
above their share by forgetting their least recently reporting processes.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Callable, Optional

from gpuwatch.agent_budget import AgentBudget
from gpuwatch.model import NO_DISCOVERY, AgentReading, BufferSize, StepPoint, TraceReport
from gpuwatch.protocol import MAX_BUFFERS, TRACE_STATUSES
from gpuwatch.sources.agent_reports import Rejected, Report
from gpuwatch.vocabulary import TraceStatus

#: Distinct buffer names a process may use over its whole life (the protocol's per-report bound).
MAX_NAMES_PER_PROCESS = MAX_BUFFERS
MAX_DISCOVERED_NAMES_PER_PROCESS = 256
#: Global cap on pending entries (a step point counts 1, plus 1 per buffer in it).
DEFAULT_MAX_PENDING = 131_072
DEFAULT_MAX_PROCESSES = 1024
#: A process may always send this many a second, however many its user runs.
PROCESS_REPORTS_PER_SECOND_MIN = 50
#: A sender (process or user) silent this long no longer counts among those sharing the rate.
_RATE_IDLE_SECONDS = 10.0

# What the receiver keeps, in bytes charged to the agent memory budget (measured with
# tracemalloc, rounded up): a slot (the _Agent, its deque, dictionaries and reply address); an
# interned buffer name of up to 64 characters and its entry; a discovered name of up to 128; a
# pending "entry" (a point counts 1, plus 1 per buffer and per discovered container in it: the
# StepPoint, its mappings and a BufferSize with its two integers each).
AGENT_BYTES = 2048
NAME_BYTES = 192
DISCOVERED_NAME_BYTES = 240
ENTRY_BYTES = 160

_NO_BUFFERS: Mapping[str, BufferSize] = MappingProxyType({})


class _Agent:
    __slots__ = ("charged", "discovered_names", "exit_report", "finished_at", "first_seen",
                 "last_seen", "latest", "names", "pending", "pending_cost", "reply_to",
                 "reply_via", "step", "step_changed_at", "trace", "uid")

    def __init__(self, uid: int, now: float, max_points: int) -> None:
        self.uid = uid
        #: Bytes charged to the budget's "receiver" part (pending points are charged apart).
        self.charged = 0
        self.first_seen = now
        self.last_seen = now
        self.step: Optional[int] = None
        self.step_changed_at: Optional[float] = None
        self.finished_at: Optional[float] = None
        self.exit_report: Optional[Mapping[str, Any]] = None
        self.pending: deque[StepPoint] = deque(maxlen=max_points)
        self.pending_cost = 0
        self.latest: Optional[StepPoint] = None
        # Accepted names, each mapping to itself: every stored point shares one string per name.
        self.names: dict[str, str] = {}
        # The same for discovered names, least recently reported first.
        self.discovered_names: dict[str, str] = {}
        #: The abstract address its newest accepted report came from, None when it had none.
        self.reply_to: Optional[bytes] = None
        #: The daemon's socket that report came in on: the one a request goes out from (the
        #: agent accepts requests only from the path it reports to).
        self.reply_via: Optional[socket.socket] = None
        self.trace: Optional[TraceReport] = None


def _cost(point: Optional[StepPoint]) -> int:
    return 0 if point is None else 1 + len(point.buffers) + len(point.discovered)


def _trace_bytes(trace: Optional[TraceReport]) -> int:
    if trace is None:
        return 0
    return (512 + len(trace.why) + sum(160 + len(site.file) for site in trace.sites)
            + sum(128 + len(file) for file, _ in trace.traceback))


def _exit_bytes(report: Optional[Mapping[str, Any]]) -> int:
    if report is None:
        return 0
    # A thread pool: its mapping, its proxy and its tuple of names (about 300 B, measured with
    # tracemalloc), then each name as a thread's.
    return (512 + sum(64 + len(name) for name in report.get("threads", ()))
            + sum(400 + sum(64 + len(name) for name in pool.get("threads", ()))
                  for pool in report.get("thread_pools", ())))


class _Rate:
    """A token bucket: `tokens` as of `at` (monotonic seconds), refilled at a rate a second up
    to one second's worth; a report takes one."""

    __slots__ = ("at", "key", "tokens")

    def __init__(self, key: int, tokens: float, at: float) -> None:
        self.key = key  # the UID, for a process's bucket
        self.tokens = tokens
        self.at = at

    def refill(self, now: float, rate: float) -> bool:
        """Refill to `now` at `rate`; whether a report's token is there (the caller takes it
        once every bucket a report passes has one)."""
        tokens = self.tokens + (now - self.at) * rate
        self.tokens = tokens if tokens < rate else rate
        self.at = now
        return self.tokens >= 1.0


class RateLimiter:
    """The report rate, shared by user and then by process, checked before a report is parsed:
    two dictionary lookups and two token buckets a datagram. Only the receiving thread calls
    `allow`."""

    def __init__(self, max_reports_per_second: Optional[float],
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        #: None: no rate limit (the daemon always sets one, agent.max_reports_per_second).
        self.max_reports_per_second = max_reports_per_second
        self._monotonic = monotonic
        # Token buckets by UID and by PID.
        self._user_rates: dict[int, _Rate] = {}
        self._process_rates: dict[int, _Rate] = {}
        self._processes_by_uid: dict[int, int] = {}
        self._rates_pruned_at = monotonic()

    def allow(self, pid: int, uid: int) -> bool:  # max_reports_per_second is set
        """Whether the process and its user are within their rates. A user's rate is
        `max_reports_per_second` shared by the users that sent in the last 10 s; a process's
        is its user's shared by its processes that did, and at least
        PROCESS_REPORTS_PER_SECOND_MIN. Each bucket holds one second's worth."""
        now = self._monotonic()
        if now - self._rates_pruned_at >= 1.0:
            self._prune_rates(now)
        users = self._user_rates
        user = users.get(uid)
        if user is None:
            user = users[uid] = _Rate(uid, math.inf, now)
        process = self._process_rates.get(pid)
        if process is None or process.key != uid:
            if process is not None:  # the PID reused by another user's process
                self._uncount_process(process.key)
            process = self._process_rates[pid] = _Rate(uid, math.inf, now)
            self._processes_by_uid[uid] = self._processes_by_uid.get(uid, 0) + 1
        user_rate = self.max_reports_per_second / len(users)  # type: ignore[operator]
        rate = user_rate / self._processes_by_uid[uid]
        if rate < PROCESS_REPORTS_PER_SECOND_MIN:
            rate = PROCESS_REPORTS_PER_SECOND_MIN
        if not process.refill(now, rate):
            return False
        # A user's bucket refills at least as fast as one of its processes' (the minimum).
        if not user.refill(now, user_rate if user_rate > rate else rate):
            return False
        process.tokens -= 1.0
        user.tokens -= 1.0
        return True

    def _prune_rates(self, now: float) -> None:
        idle = now - _RATE_IDLE_SECONDS
        for uid in [uid for uid, rate in self._user_rates.items() if rate.at < idle]:
            del self._user_rates[uid]
        for pid in [pid for pid, rate in self._process_rates.items() if rate.at < idle]:
            self._uncount_process(self._process_rates.pop(pid).key)
        self._rates_pruned_at = now

    def _uncount_process(self, uid: int) -> None:
        counts = self._processes_by_uid
        counts[uid] -= 1
        if not counts[uid]:
            del counts[uid]



class AgentStore:
    """The reporting processes admitted and what each keeps, within the slots, the pending
    entries and the memory budget, each shared fairly by user. The receiving thread stores,
    the poll thread drains and forgets; `lock` guards all of it."""

    def __init__(self, *, max_processes: int = DEFAULT_MAX_PROCESSES, max_points: int = 256,
                 max_pending: int = DEFAULT_MAX_PENDING, budget: Optional[AgentBudget] = None,
                 lock: Optional[threading.Lock] = None) -> None:
        self.max_processes = max_processes
        self.max_points = max_points
        self.max_pending = max_pending
        #: The memory budget everything agent reports create is charged to (docs/agent.md).
        self.budget = budget if budget is not None else AgentBudget()
        self.budget.add_reclaimer(self._reclaim, order=1)
        self.lock = lock if lock is not None else threading.Lock()
        self._agents: dict[int, _Agent] = {}
        #: Slots and pending entries held by each user.
        self._slots_by_uid: dict[int, int] = {}
        self._pending_by_uid: dict[int, int] = {}
        self._pending_total = 0
        self.trace_reports = dict.fromkeys(TRACE_STATUSES, 0)

    def known(self, pid: int) -> Optional[_Agent]:
        """The process's slot, read without the lock by the receiving thread (only it adds
        names, and any set of names once valid is still a valid cache of the regex's
        answers)."""
        return self._agents.get(pid)

    def reply_route(self, pid: int) -> tuple[Optional[bytes], Optional[socket.socket]]:
        """Where `pid`'s newest report came from, and the socket it came in on."""
        with self.lock:
            agent = self._agents.get(pid)
            if agent is None:
                return None, None
            return agent.reply_to, agent.reply_via

    def _admit(self, uid: int) -> None:
        """Make room for a new process of `uid`, or refuse it. While slots are free anyone
        gets one; when all are taken, a user holding fewer than its share (max_processes /
        users holding slots) takes the least recently reporting slot of the user holding
        the most, and one holding its share or more is refused."""
        if len(self._agents) < self.max_processes:
            return
        slots = self._slots_by_uid
        users = len(slots) + (uid not in slots)
        if users == 1:
            raise Rejected("too_many_processes")
        if slots.get(uid, 0) >= self.max_processes // users:
            raise Rejected("user_share")
        most = max(slots, key=slots.__getitem__)
        victim = min((pid for pid, a in self._agents.items() if a.uid == most),
                     key=lambda pid: self._agents[pid].last_seen)
        self._discard(victim)
        self.budget.evicted("process", "user_share")

    def store(self, pid: int, uid: int, now: float, report: Report, address: Any,
              via: Optional[socket.socket] = None) -> None:
        """Keep an accepted report (the caller holds `lock`); raises Rejected when the process
        cannot be admitted or what it would add is over its share of the budget."""
        (kind, step, rss, allocated, reserved, active, allocations, buffers, discovered,
         exit_report, trace) = report
        agent = self._agents.get(pid)
        if agent is not None and agent.uid != uid:
            # The PID was reused by another user's process before the poll forgot the old one.
            self._discard(pid)
            agent = None
        new = agent is None
        if agent is None:
            self._admit(uid)
            agent = _Agent(uid, now, self.max_points)
        # What this report adds to what the process keeps, checked before anything is stored.
        growth = AGENT_BYTES if new else 0
        added: list[str] = []
        if buffers:
            names = agent.names
            added = [name for name in buffers if name not in names]
            if len(names) + len(added) > MAX_NAMES_PER_PROCESS:
                raise Rejected("too_many_buffers")
            growth += len(added) * NAME_BYTES
        if discovered:
            known = agent.discovered_names
            fresh = sum(1 for name in discovered if name not in known)
            growth += (min(len(known) + fresh, MAX_DISCOVERED_NAMES_PER_PROCESS)
                       - len(known)) * DISCOVERED_NAME_BYTES
        report_trace: Optional[TraceReport] = None
        if kind == "step" or kind == "tick":
            entries = 1 + len(buffers or ()) + len(discovered or ())
            growth += (entries - _cost(agent.latest)) * ENTRY_BYTES
        elif kind == "trace":
            assert trace is not None
            status, why, steps, sites, traceback = trace
            report_trace = TraceReport(TraceStatus(status), why, steps, sites, traceback, now,
                                       step)
            growth += _trace_bytes(report_trace) - _trace_bytes(agent.trace)
        elif kind == "exit":
            growth += _exit_bytes(exit_report) - _exit_bytes(agent.exit_report)
        if growth > 0:
            reason = self.budget.grant(uid, "receiver", growth)
            if reason is not None:
                raise Rejected(reason)
        elif growth < 0:
            self.budget.release(uid, "receiver", -growth)
        agent.charged += growth
        if new:
            self._agents[pid] = agent
            self._slots_by_uid[uid] = self._slots_by_uid.get(uid, 0) + 1
        stored: Mapping[str, BufferSize] = _NO_BUFFERS
        if buffers:
            names = agent.names
            for name in added:
                names[name] = name
            stored = MappingProxyType({names[name]: size for name, size in buffers.items()})
        agent.last_seen = now
        # The newest socket it sends from is the one it listens on; a report from an unbound or
        # path-bound socket leaves nowhere to answer.
        agent.reply_to = address if type(address) is bytes and address[:1] == b"\0" else None
        agent.reply_via = via
        if step is not None and step != agent.step:
            agent.step = step
            agent.step_changed_at = now
        if kind == "step":
            assert step is not None
            point = StepPoint(step, now, rss, allocated, reserved, stored, active, allocations,
                              NO_DISCOVERY if discovered is None
                              else _intern_discovered(agent.discovered_names, discovered))
            agent.latest = point
            self._add_pending(agent, point)
        elif kind == "tick":
            point = StepPoint(0, now, rss, allocated, reserved, stored, active, allocations,
                              NO_DISCOVERY if discovered is None
                              else _intern_discovered(agent.discovered_names, discovered),
                              ticked=True)
            agent.latest = point
            self._add_pending(agent, point)
        elif kind == "finished":
            if agent.finished_at is None:
                agent.finished_at = now
        elif kind == "trace":
            assert report_trace is not None
            agent.trace = report_trace
            self.trace_reports[report_trace.status] += 1
        else:
            agent.exit_report = exit_report

    def _add_pending(self, agent: _Agent, point: StepPoint) -> None:
        pending = agent.pending
        cost = _cost(point)
        if len(pending) == pending.maxlen:
            self._shed(agent)
        # Over the global cap, a user holding its share of it or more loses its own oldest
        # points (a flood costs only the flooder its history); a user under its share takes
        # them from the user holding the most.
        while self._pending_total + cost > self.max_pending:
            victim = self._pending_victim(agent, cost)
            if victim is None:
                break
            self._shed(victim)
        # The same against the memory budget, where a process keeps at least its newest point.
        nbytes = cost * ENTRY_BYTES
        while self.budget.grant(agent.uid, "pending", nbytes, force=not pending) is not None:
            self._shed(agent)
        pending.append(point)
        agent.pending_cost += cost
        self._pending_total += cost
        self._pending_by_uid[agent.uid] = self._pending_by_uid.get(agent.uid, 0) + cost

    def _pending_victim(self, sender: _Agent, cost: int) -> Optional[_Agent]:
        by_uid = self._pending_by_uid
        users = len(by_uid) + (sender.uid not in by_uid)
        if by_uid.get(sender.uid, 0) + cost >= self.max_pending // users:
            return sender if sender.pending else None
        most = max(by_uid, key=by_uid.__getitem__)
        victims = [a for a in self._agents.values() if a.uid == most and len(a.pending) > 1]
        if not victims:
            return sender if sender.pending else None
        return max(victims, key=lambda a: a.pending_cost)

    def _shed(self, agent: _Agent) -> None:
        """Drop the agent's oldest pending point."""
        dropped = _cost(agent.pending.popleft())
        agent.pending_cost -= dropped
        self._pending_total -= dropped
        self._pending_by_uid[agent.uid] -= dropped
        if not self._pending_by_uid[agent.uid]:
            del self._pending_by_uid[agent.uid]
        self.budget.release(agent.uid, "pending", dropped * ENTRY_BYTES)

    def _discard(self, pid: int) -> int:
        """Forget a process and give back what it was charged; the bytes."""
        agent = self._agents.pop(pid, None)
        if agent is None:
            return 0
        uid = agent.uid
        self._slots_by_uid[uid] -= 1
        if not self._slots_by_uid[uid]:
            del self._slots_by_uid[uid]
        if agent.pending_cost:
            self._pending_total -= agent.pending_cost
            self._pending_by_uid[uid] -= agent.pending_cost
            if not self._pending_by_uid[uid]:
                del self._pending_by_uid[uid]
        pending_bytes = agent.pending_cost * ENTRY_BYTES
        self.budget.release(uid, "pending", pending_bytes)
        self.budget.release(uid, "receiver", agent.charged)
        return agent.charged + pending_bytes

    def _reclaim(self, uid: int, nbytes: int, reason: str) -> int:
        """The budget's reclaimer: forget `uid`'s least recently reporting processes until
        `nbytes` are freed (their next report is a new process, admitted as any other)."""
        with self.lock:
            candidates = sorted((pid for pid, a in self._agents.items() if a.uid == uid),
                                key=lambda pid: self._agents[pid].last_seen)
            return self.budget.free("process", reason, nbytes, candidates, self._discard)

    # -- what the poll thread reads ----------------------------------------------------------
    def drain(self) -> dict[int, AgentReading]:
        """Every known agent; `points` are the step reports accepted since the previous drain."""
        with self.lock:
            readings = {}
            for pid, agent in self._agents.items():
                readings[pid] = AgentReading(
                    pid=pid, uid=agent.uid, first_seen=agent.first_seen,
                    last_seen=agent.last_seen, step=agent.step,
                    step_changed_at=agent.step_changed_at, finished_at=agent.finished_at,
                    exit_report=agent.exit_report, points=tuple(agent.pending),
                    latest=agent.latest, trace=agent.trace,
                    can_reply=agent.reply_to is not None)
                agent.pending.clear()
                agent.pending_cost = 0
            self._pending_total = 0
            for uid, entries in self._pending_by_uid.items():
                self.budget.release(uid, "pending", entries * ENTRY_BYTES)
            self._pending_by_uid.clear()
            return readings

    def forget(self, pids: Iterable[int]) -> None:
        """Drop processes that exited (their PIDs may be reused by unrelated processes)."""
        with self.lock:
            for pid in pids:
                self._discard(pid)



def _intern_discovered(names: dict[str, str], discovered: dict[str, BufferSize]
                       ) -> Mapping[str, BufferSize]:
    """`discovered` keyed by the process's interned names, which it refreshes: a name reported
    now moves to the end, and beyond the bound the least recently reported go."""
    interned = {}
    for name, size in discovered.items():
        kept = names.pop(name, name)
        names[kept] = kept
        interned[kept] = size
    while len(names) > MAX_DISCOVERED_NAMES_PER_PROCESS:
        del names[next(iter(names))]
    # A pass that found nothing growing is an empty mapping, yet not NO_DISCOVERY.
    return MappingProxyType(interned)
