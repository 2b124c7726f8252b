"""The daemon's receiver for agent reports (docs/agent-protocol.md).

Training processes that use `gpuwatch.agent` send small JSON reports (their step, memory and
buffer sizes, and what was still alive at exit) to `agent.sock` in the runtime directory. This
module receives them, validates them and keeps what the poll thread needs, within fixed bounds.

Why datagrams: one report is one `sendto`, with no connection to set up, keep or lose. A training
loop must never block on its monitor; the agent sends non-blocking and drops a report when the
queue is full, and a dead or restarting daemon costs it nothing but a failed `sendto`. On this side,
no per-client state exists before a report has been accepted, so a misbehaving client cannot hold
the daemon's resources by connecting.

Why SCM_CREDENTIALS: any local user may send (the socket file is 0666), so the payload cannot be
trusted to say who sent it. With SO_PASSCRED the kernel attaches the sender's PID and UID to every
datagram (translated into this PID namespace; 0 when the sender's PID is not visible here, which is
counted as `no_credentials`). A report can therefore only ever speak for the process that sent it;
anything in the payload naming a process is ignored.

The socket is bound at its final path, not under a temporary name renamed into place: a Unix
socket keeps the name it was bound under, and that name is the source address of every trace
request the daemon sends from it, which agents accept only when it is the path they report to. A
stale socket from an earlier run is unlinked first, and the file is chmod-ed to 0666 right after
bind (the file it opened by name in the checked runtime directory, never a path followed again);
for that instant a sender of another user may see ENOENT or EACCES, as it would while the daemon
restarts. The process umask, shared with every other thread, is never touched.

Why the daemon can answer: an agent binds its socket to a kernel-chosen abstract address, which
arrives here as the sender's address (`recvmsg`). The newest one from an accepted report is kept
per process and `request_trace` sends one small datagram to it, non-blocking, from the bound
socket: the kernel attaches the daemon's credentials, and the source address is agent.sock, which
no other process can send from. Only abstract addresses are kept: a path would let a sender point
the daemon at any socket file it can name.

Bounds, whatever is sent:
- a datagram is at most 16,384 bytes (`oversized` beyond), a report at most 64 buffers and 8
  discovered containers (`too_many_buffers`), a trace report at most 8 sites and 16 traceback
  frames, each file name at most 256 characters, and a `why` of at most 200 (`bad_value`);
- at most `max_processes` reporting processes, each forgotten when the daemon sees it exit
  (`forget`). When all slots are taken, a user holding fewer than its share (`max_processes` /
  users holding slots) takes the least recently reporting slot of the user holding the most;
  one holding its share or more is rejected (`user_share`, or `too_many_processes` when its
  user holds them all): one user's idle processes cannot lock the others out;
- at most 64 distinct buffer names per process over its whole life, not only per report: a report
  that would bring a process's set of names past 64 is rejected as `too_many_buffers`. With only
  the per-report limit, a process sending 64 new names each time would grow the names the daemon
  keeps (and the buffer series it exports) without end;
- at most 256 interned discovered names per process, the least recently reported evicted beyond
  that: discovered containers come and go (the agent sends its current top growers), so a
  lifetime cap like the buffers' would end discovery in a long run, and a name evicted and sent
  again only costs its regex check again;
- at most `max_points` pending step points per process between two `drain()` calls (older ones
  are dropped: the drain after a pause still sees the newest);
- across all processes, at most `max_pending` pending "entries" (a point counts 1 plus one per
  buffer and one per discovered container). Without this global cap the per-process bounds
  multiply out to about 3 GB (1,024 processes x 256 points x 73 entries). When a report would
  exceed it, a user holding its share of the entries or more loses its own oldest pending
  points, so a flood costs only the flooder its history; a user under its share takes them from
  the user holding the most. Every process keeps at least its newest point;
- no figure beyond what the node could hold (`implausible`): bytes and counts above MemTotal plus
  the GPUs' memory (`note_node_memory`, from the daemon after each poll), any figure above the
  protocol's MAX_FIGURE;
- `max_reports_per_second` shared by the users that sent in the last 10 s, and each user's share
  by its processes that did (at least PROCESS_REPORTS_PER_SECOND_MIN each), in token buckets of
  one second's worth: a datagram beyond is rejected as `rate_limited` before it is parsed;
- and what all this keeps is charged to the agent memory budget (gpuwatch.agent_budget), shared
  with the history's step series: a slot, each interned name, the newest point, the trace and
  exit reports (`AGENT_BYTES` and the rest below, upper estimates measured with tracemalloc)
  when a report adds them, pending points as they come. Past the budget a report that would add
  to what its user keeps while the user holds its share is rejected (`user_share`, or
  `memory_budget` for a user alone or over the budget's ceiling), and pending points give way to
  their own process's newer ones. At each poll the budget takes back from users above their
  share, the receiver's part by forgetting their least recently reporting processes (`_reclaim`;
  such a process's next report is a new process's).
The per-process part (the newest point, 64 buffer names, 256 discovered names of up to 128
characters, the newest trace report of up to 24 file names of up to 256 characters, the reply
address, the exit report) is at most ~105 KiB, so without the budget 1,024 processes sending
maximal reports could make the receiver alone keep 125 MiB; with it, the receiver and the
history together keep what docs/agent-protocol.md ("Daemon side bounds") derives.

A PID that reports under a new UID is another process that reused the PID before the daemon
forgot the old one: its state starts afresh. The receiving thread never dies of a datagram: an
exception while handling one is counted as `malformed` and the loop goes on.

Validation is written for speed (the goal is over 20,000 reports/s on one core): one strict UTF-8
decode, one `json.loads`, type checks with `type(x) is int` (a bool is not an int), and the
buffer-name regex only for names not already accepted from the same process. The optional parts
(`discovered`, the CUDA allocator's counts, `trace` reports, the reply address) cost a report
without them a dictionary lookup or a comparison each.

Where the protocol leaves a choice open, this receiver decides: a report without `v` is rejected as
`version`; one without `kind`, or a `step` report without `step`, is `malformed`; an unknown `kind`
is `bad_value`; a JSON `null` for an optional figure means the same as leaving it out (unknown);
`exit` is read on `exit` reports only, `trace` on `trace` reports only (one without it is
`malformed`); every field of a trace site or traceback frame is required (`bad_type` when
missing); text in a trace report (file names, `why`) may not hold control characters
(`bad_value`), since it ends up in log lines; a second `finished` keeps the first time.

The receiver is four parts, each in a module of its own, behind this facade: the transport
(`agent_transport`: the sockets, their files and ACLs, the receiving thread), the reading of a
report (`agent_reports`: validation into a `Report`), admission (`agent_admission`: the rate
limiter, and the store of admitted processes with its fair shares and budget charges) and the
requests to agents (`agent_requests`: trace and search).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Optional

from gpuwatch.agent_budget import AgentBudget
from gpuwatch.forwarded import Forwarded
from gpuwatch.model import AgentReading, BufferSize
from gpuwatch.protocol import MAX_DATAGRAM, MAX_FIGURE, TRACE_STATUSES
from gpuwatch.runtime_dir import TrustedDir
from gpuwatch.sources.agent_admission import (
    AGENT_BYTES,
    DEFAULT_MAX_PENDING,
    DEFAULT_MAX_PROCESSES,
    DISCOVERED_NAME_BYTES,
    ENTRY_BYTES,
    MAX_DISCOVERED_NAMES_PER_PROCESS,
    MAX_NAMES_PER_PROCESS,
    NAME_BYTES,
    PROCESS_REPORTS_PER_SECOND_MIN,
    AgentStore,
    RateLimiter,
)
from gpuwatch.sources.agent_reports import Rejected, parse_report
from gpuwatch.sources.agent_requests import AgentRequests
from gpuwatch.sources.agent_transport import MAX_PRIVATE_SOCKETS, RECEIVE_BATCH, AgentTransport

__all__ = [
    "AGENT_BYTES", "DEFAULT_MAX_PENDING", "DEFAULT_MAX_PROCESSES", "DISCOVERED_NAME_BYTES",
    "ENTRY_BYTES", "MAX_DATAGRAM", "MAX_DISCOVERED_NAMES_PER_PROCESS", "MAX_NAMES_PER_PROCESS",
    "MAX_PRIVATE_SOCKETS", "NAME_BYTES", "PROCESS_REPORTS_PER_SECOND_MIN", "REASONS",
    "RECEIVE_BATCH", "TRACE_STATUSES", "AgentReceiver", "BufferSize",
]

#: Why a report was rejected: the `reason` label of gpuwatch_agent_reports_rejected_total.
REASONS = ("malformed", "version", "oversized", "too_many_buffers", "bad_name", "bad_value",
           "bad_type", "no_credentials", "too_many_processes", "rate_limited", "user_share",
           "memory_budget", "implausible")


class AgentReceiver:
    """Receives agent reports on a Unix datagram socket in a daemon thread: the transport, the
    rate limiter, the store and the requests, wired together, and the counters of what was
    accepted and rejected."""

    def __init__(self, path: Path, *, max_processes: int = DEFAULT_MAX_PROCESSES,
                 max_points: int = 256, clock: Callable[[], float] = time.time,
                 max_pending: int = DEFAULT_MAX_PENDING, budget: Optional[AgentBudget] = None,
                 max_reports_per_second: Optional[float] = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        #: The most GPU memory NVML has shown (None before it has answered).
        self._gpu_memory_total: Optional[int] = None
        #: The most a byte figure or count of a report may be: more than the node could hold is
        #: `implausible` (agent_reports). MAX_FIGURE until the node's memory is known.
        self.max_bytes = MAX_FIGURE
        # Guards the store and the counters: the receiving thread writes, the poll thread drains.
        self._lock = threading.Lock()
        self.store = AgentStore(max_processes=max_processes, max_points=max_points,
                                max_pending=max_pending, budget=budget, lock=self._lock)
        self.rates = RateLimiter(max_reports_per_second, monotonic)
        self.transport = AgentTransport(self.path, self.handle, self._count)
        self.requests = AgentRequests(self.store, self.transport)
        self._clock = clock
        self._accepted = 0
        self._rejected = dict.fromkeys(REASONS, 0)

    # -- limits ------------------------------------------------------------------------------
    #: The memory budget everything agent reports create is charged to (docs/agent.md).
    budget = Forwarded[AgentBudget]("store")
    max_processes = Forwarded[int]("store")
    max_points = Forwarded[int]("store")
    max_pending = Forwarded[int]("store")
    #: None: no rate limit (the daemon always sets one, agent.max_reports_per_second).
    max_reports_per_second = Forwarded[Optional[float]]("rates")

    def configure(self, max_processes: int, memory_budget: int,
                  max_reports_per_second: Optional[float]) -> None:
        """Apply [agent] limits (at start and on reload). Lowered limits refuse what is new;
        what is kept beyond them goes as the budget reclaims it or as processes exit."""
        with self._lock:
            self.store.max_processes = max_processes
            self.rates.max_reports_per_second = max_reports_per_second
        self.budget.max_bytes = memory_budget

    def note_node_memory(self, mem_total: Optional[int], gpu_total: Optional[int]) -> None:
        """What the node could hold, as the daemon read it: MemTotal, and the GPUs' total
        memory at the latest poll (None: NVML did not answer). The largest GPU total seen is
        kept (a GPU missing from one poll still exists); once both are known, `max_bytes` is
        their sum. Before NVML has answered a report's CUDA figures cannot be weighed against
        the node, and only MAX_FIGURE bounds them."""
        if gpu_total is not None and (self._gpu_memory_total is None
                                      or gpu_total > self._gpu_memory_total):
            self._gpu_memory_total = gpu_total
        if mem_total is not None and self._gpu_memory_total is not None:
            self.max_bytes = min(MAX_FIGURE, mem_total + self._gpu_memory_total)

    # -- counters ----------------------------------------------------------------------------
    @property
    def rejected(self) -> Mapping[str, int]:
        with self._lock:
            return MappingProxyType(dict(self._rejected))

    @property
    def accepted(self) -> int:
        return self._accepted

    @property
    def trace_reports(self) -> Mapping[str, int]:
        """Accepted trace reports by status (done, refused, failed)."""
        with self._lock:
            return MappingProxyType(dict(self.store.trace_reports))

    def _count(self, reason: str) -> None:
        with self._lock:
            self._rejected[reason] += 1

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, directory: Optional[TrustedDir] = None) -> None:
        """`directory`: the runtime directory, checked and held open by the daemon; without it
        the receiver checks and opens the directory of its path itself."""
        self.transport.start(directory)

    def stop(self) -> None:
        self.transport.stop()

    # -- one report --------------------------------------------------------------------------
    def handle(self, payload: bytes, pid: int, uid: int, truncated: bool = False,
               address: Any = None, via: Optional[socket.socket] = None) -> None:
        """Validate one report from `pid`/`uid` (kernel credentials); store it or count why not.

        `address` is the sender's, as recvmsg gave it: an abstract one (bytes starting with a NUL
        byte) is where `request_trace` can reach the process.
        """
        try:
            # Before any parsing: a flood over its share costs two dictionary lookups each.
            if self.rates.max_reports_per_second is not None and not self.rates.allow(pid, uid):
                raise Rejected("rate_limited")
            agent = self.store.known(pid)
            if agent is None:
                report = parse_report(payload, truncated, max_bytes=self.max_bytes)
            else:
                report = parse_report(payload, truncated, agent.names, agent.discovered_names,
                                      self.max_bytes)
            now = self._clock()
            with self._lock:
                self.store.store(pid, uid, now, report, address, via)
                self._accepted += 1
        except Rejected as rejected:
            self._count(rejected.reason)

    # -- what the poll thread reads ----------------------------------------------------------
    def drain(self) -> dict[int, AgentReading]:
        """Every known agent; `points` are the step reports accepted since the previous drain."""
        return self.store.drain()

    def forget(self, pids: Iterable[int]) -> None:
        """Drop processes that exited (their PIDs may be reused by unrelated processes)."""
        self.store.forget(pids)

    # -- what the daemon sends ---------------------------------------------------------------
    def request_trace(self, pid: int, steps: int) -> bool:
        """Ask `pid`'s agent to trace its allocations over the next `steps` steps (1 to 100);
        see AgentRequests.request_trace."""
        return self.requests.request_trace(pid, steps)

    def request_search(self, pid: int, seconds: int) -> bool:
        """Ask `pid`'s agent to search for growing containers faster, for `seconds`; see
        AgentRequests.request_search."""
        return self.requests.request_search(pid, seconds)
