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
bind; for that instant a sender of another user may see ENOENT or EACCES, as it would while the
daemon restarts. The process umask, shared with every other thread, is never touched.

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
- at most `max_processes` reporting processes (`too_many_processes` for a new one beyond), each
  forgotten when the daemon sees it exit (`forget`);
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
- and, across all processes, at most `max_pending` pending "entries" (a point counts 1 plus one per
  buffer and one per discovered container; one entry is about 170 bytes). Without this global
  cap the per-process bounds multiply out to about 3 GB (1,024 processes x 256 points x 73
  entries). When a report would exceed it, the oldest pending
  points of the process that sent it are dropped first, so a flooding process pays for its own
  flood, and every process keeps at least its newest point.
What a process keeps beyond its pending points (the newest point, 64 buffer names, 256 discovered
names of up to 128 characters, the newest trace report of up to 24 file names of up to 256
characters, the reply address, the exit report) is bounded by the protocol limits, so the total
is bounded by `max_processes x (per-process fixed part, ~100 KiB at most, over half of it
discovered names) + max_pending x (one entry)`: about 120 MiB with the defaults, reachable only by
1,024 live processes all sending maximal reports.

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
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Optional

from gpuwatch.model import (
    NO_DISCOVERY,
    AgentReading,
    BufferSize,
    StepPoint,
    TraceReport,
    TraceSite,
)
from gpuwatch.runtime_dir import FileIdentity, file_identity, unlink_if_same

log = logging.getLogger(__name__)

AGENT_SOCKET_NAME = "agent.sock"
PROTOCOL_VERSION = 1
MAX_DATAGRAM = 16_384
MAX_BUFFERS = 64
MAX_NAMES_PER_PROCESS = 64
MAX_EXIT_THREADS = 64
MAX_THREAD_NAME = 64
MAX_DISCOVERED = 8
MAX_DISCOVERED_NAMES_PER_PROCESS = 256
MAX_TRACE_SITES = 8
MAX_TRACEBACK = 16
MAX_TRACE_FILE = 256
MAX_TRACE_WHY = 200
MAX_TRACE_STEPS = 100
TRACE_STATUSES = ("done", "refused", "failed")
#: Global cap on pending entries (a step point counts 1, plus 1 per buffer in it).
DEFAULT_MAX_PENDING = 131_072

REASONS = ("malformed", "version", "oversized", "too_many_buffers", "bad_name", "bad_value",
           "bad_type", "no_credentials", "too_many_processes")

_INT_LIMIT = 1 << 63
_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")
_DISCOVERED_NAME = re.compile(r"[A-Za-z0-9_.:/<>-]{1,128}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_KINDS = ("step", "finished", "exit", "trace")
_UCRED = struct.Struct("iII")  # pid_t, uid_t, gid_t: the size of "3i", unsigned ids
_ANCILLARY_SIZE = socket.CMSG_SPACE(struct.calcsize("3i"))
# A kernel-side receive timeout, so the thread sees its stop flag even if a wake-up is missed;
# unlike settimeout() it adds no poll() syscall before every receive.
_RECEIVE_TIMEOUT = struct.pack("ll", 0, 200_000)


_NO_BUFFERS: Mapping[str, BufferSize] = MappingProxyType({})
_EMPTY_EXIT: Mapping[str, Any] = MappingProxyType({})


class _Rejected(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Agent:
    __slots__ = ("discovered_names", "exit_report", "finished_at", "first_seen", "last_seen",
                 "latest", "names", "pending", "pending_cost", "reply_to", "step",
                 "step_changed_at", "trace", "uid")

    def __init__(self, uid: int, now: float, max_points: int) -> None:
        self.uid = uid
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
        self.trace: Optional[TraceReport] = None


def _optional_int(value: Any) -> Optional[int]:
    if value is None:
        return None
    if type(value) is not int:
        raise _Rejected("bad_type")
    if value < 0 or value >= _INT_LIMIT:
        raise _Rejected("bad_value")
    return value


def _cost(point: StepPoint) -> int:
    return 1 + len(point.buffers) + len(point.discovered)


class AgentReceiver:
    """Receives agent reports on a Unix datagram socket in a daemon thread."""

    def __init__(self, path: Path, *, max_processes: int = 1024, max_points: int = 256,
                 clock: Callable[[], float] = time.time,
                 max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.path = Path(path)
        self.max_processes = max_processes
        self.max_points = max_points
        self.max_pending = max_pending
        self._clock = clock
        self._agents: dict[int, _Agent] = {}
        self._pending_total = 0
        self._accepted = 0
        self._rejected = dict.fromkeys(REASONS, 0)
        self._trace_reports = dict.fromkeys(TRACE_STATUSES, 0)
        # Guards the agents and the counters: the receiving thread writes, the poll thread drains.
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._inode: Optional[FileIdentity] = None

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
            return MappingProxyType(dict(self._trace_reports))

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the agent receiver is already running")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.settimeout(None)  # blocking, whatever socket.setdefaulttimeout() says
            # Before the socket can be reached: no datagram may ever arrive without credentials.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _RECEIVE_TIMEOUT)
            # Sending to a datagram socket needs write permission on its file. bind creates the
            # file with the socket's mode less the umask: with a permissive umask it is final at
            # once, otherwise the chmod below makes it so.
            with contextlib.suppress(OSError):
                os.fchmod(sock.fileno(), 0o666)
            # A stale socket from an earlier run; the runtime directory's lock rules out a live
            # daemon's.
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            sock.bind(str(self.path))
            try:
                os.chmod(self.path, 0o666)
                identity = file_identity(self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    self.path.unlink()
                raise
        except BaseException:
            sock.close()
            raise
        self._inode = identity
        self._sock = sock
        self._stopping.clear()
        self._thread = threading.Thread(target=self._receive_loop, args=(sock,),
                                        name="agent-socket", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        sock, thread = self._sock, self._thread
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked recvmsg at once
        if thread is not None:
            thread.join(timeout=5)
        if sock is not None:
            sock.close()
        self._sock = None
        self._thread = None
        # Only our own socket: a daemon started since may have put its own at this path.
        inode, self._inode = self._inode, None
        unlink_if_same(self.path, inode)

    def _receive_loop(self, sock: socket.socket) -> None:
        recvmsg = sock.recvmsg
        stopping = self._stopping.is_set
        handle = self.handle
        while not stopping():
            try:
                data, ancillary, flags, address = recvmsg(MAX_DATAGRAM + 1, _ANCILLARY_SIZE)
            except (BlockingIOError, InterruptedError):
                continue  # the receive timeout: look at the stop flag
            except OSError as exc:
                if stopping():
                    break
                log.warning("agent socket: receive failed: %s", exc)
                if exc.errno in (errno.EBADF, errno.ENOTSOCK, errno.EINVAL):
                    break  # the socket is gone; nothing will ever arrive on it again
                time.sleep(0.01)  # a transient error (ENOMEM, ENOBUFS): do not spin on it
                continue
            if stopping():
                break
            try:
                pid = uid = None
                for level, kind, cdata in ancillary:
                    if level != socket.SOL_SOCKET:
                        continue
                    if kind == socket.SCM_CREDENTIALS and len(cdata) >= _UCRED.size:
                        pid, uid, _ = _UCRED.unpack_from(cdata)
                    elif kind == socket.SCM_RIGHTS:
                        _close_passed_fds(cdata)
                if pid is None or uid is None or pid <= 0:
                    self._count("no_credentials")
                    continue
                handle(data, pid, uid, bool(flags & socket.MSG_TRUNC), address)
            except Exception:
                # One bad datagram must never end the receiving thread.
                log.debug("agent socket: report handling failed", exc_info=True)
                self._count("malformed")

    # -- validation and storage --------------------------------------------------------------
    def handle(self, payload: bytes, pid: int, uid: int, truncated: bool = False,
               address: Any = None) -> None:
        """Validate one report from `pid`/`uid` (kernel credentials); store it or count why not.

        `address` is the sender's, as recvmsg gave it: an abstract one (bytes starting with a NUL
        byte) is where `request_trace` can reach the process.
        """
        try:
            if truncated or len(payload) > MAX_DATAGRAM:
                raise _Rejected("oversized")
            try:
                doc = json.loads(payload.decode("utf-8"))
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                raise _Rejected("malformed") from None
            if type(doc) is not dict:
                raise _Rejected("malformed")
            version = doc.get("v")
            if type(version) is not int or version != PROTOCOL_VERSION:
                raise _Rejected("version")
            kind = _choice(doc.get("kind"), _KINDS)
            _optional_int(doc.get("seq"))
            step = _optional_int(doc.get("step"))
            if step is None and kind == "step":
                raise _Rejected("malformed")
            rss = _optional_int(doc.get("rss"))
            allocated = reserved = active = allocations = None
            cuda = doc.get("cuda")
            if cuda is not None:
                if type(cuda) is not dict:
                    raise _Rejected("bad_type")
                allocated = _optional_int(cuda.get("allocated"))
                reserved = _optional_int(cuda.get("reserved"))
                active = _optional_int(cuda.get("active"))
                allocations = _optional_int(cuda.get("allocations"))
            raw_buffers = doc.get("buffers")
            buffers: Optional[dict[str, BufferSize]] = None
            if raw_buffers is not None:
                # Read without the lock: only this thread adds names, and any set of names that
                # were once valid is still a valid cache of the regex's answers.
                agent = self._agents.get(pid)
                buffers = _sizes(raw_buffers, MAX_BUFFERS, agent.names if agent is not None else {},
                                 _NAME)
            raw_discovered = doc.get("discovered")
            discovered = None
            if raw_discovered is not None:
                agent = self._agents.get(pid)
                discovered = _sizes(raw_discovered, MAX_DISCOVERED,
                                    agent.discovered_names if agent is not None else {},
                                    _DISCOVERED_NAME)
            exit_report = trace = None
            if kind != "step":
                if kind == "exit":
                    exit_report = _exit_report(doc.get("exit"))
                elif kind == "trace":
                    trace = _trace(doc.get("trace"))
            now = self._clock()
            with self._lock:
                self._store(pid, uid, now, kind, step, rss, allocated, reserved, buffers,
                            exit_report, active, allocations, discovered, trace, address)
                self._accepted += 1
        except _Rejected as rejected:
            self._count(rejected.reason)

    def _store(self, pid: int, uid: int, now: float, kind: str, step: Optional[int],
               rss: Optional[int], allocated: Optional[int], reserved: Optional[int],
               buffers: Optional[dict[str, BufferSize]],
               exit_report: Optional[Mapping[str, Any]], active: Optional[int],
               allocations: Optional[int], discovered: Optional[dict[str, BufferSize]],
               trace: Optional[_TraceFields], address: Any) -> None:
        agent = self._agents.get(pid)
        if agent is not None and agent.uid != uid:
            # The PID was reused by another user's process before the poll forgot the old one.
            self._discard(pid)
            agent = None
        if agent is None:
            if len(self._agents) >= self.max_processes:
                raise _Rejected("too_many_processes")
            agent = _Agent(uid, now, self.max_points)
        stored: Mapping[str, BufferSize] = _NO_BUFFERS
        if buffers:
            names = agent.names
            added = [name for name in buffers if name not in names]
            if added:
                if len(names) + len(added) > MAX_NAMES_PER_PROCESS:
                    raise _Rejected("too_many_buffers")
                for name in added:
                    names[name] = name
            stored = MappingProxyType({names[name]: size for name, size in buffers.items()})
        self._agents[pid] = agent
        agent.last_seen = now
        # The newest socket it sends from is the one it listens on; a report from an unbound or
        # path-bound socket leaves nowhere to answer.
        agent.reply_to = address if type(address) is bytes and address[:1] == b"\0" else None
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
        elif kind == "finished":
            if agent.finished_at is None:
                agent.finished_at = now
        elif kind == "trace":
            assert trace is not None
            status, why, steps, sites, traceback = trace
            agent.trace = TraceReport(status, why, steps, sites, traceback, now, step)
            self._trace_reports[status] += 1
        else:
            agent.exit_report = exit_report

    def _add_pending(self, agent: _Agent, point: StepPoint) -> None:
        pending = agent.pending
        cost = _cost(point)
        if len(pending) == pending.maxlen:
            dropped = _cost(pending.popleft())
            agent.pending_cost -= dropped
            self._pending_total -= dropped
        # Over the global cap, the sender's own backlog goes first: a flood costs only the
        # flooder its history.
        while pending and self._pending_total + cost > self.max_pending:
            dropped = _cost(pending.popleft())
            agent.pending_cost -= dropped
            self._pending_total -= dropped
        pending.append(point)
        agent.pending_cost += cost
        self._pending_total += cost

    def _discard(self, pid: int) -> None:
        agent = self._agents.pop(pid, None)
        if agent is not None:
            self._pending_total -= agent.pending_cost

    def _count(self, reason: str) -> None:
        with self._lock:
            self._rejected[reason] += 1

    # -- what the poll thread reads ----------------------------------------------------------
    def drain(self) -> dict[int, AgentReading]:
        """Every known agent; `points` are the step reports accepted since the previous drain."""
        with self._lock:
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
            return readings

    def forget(self, pids: Iterable[int]) -> None:
        """Drop processes that exited (their PIDs may be reused by unrelated processes)."""
        with self._lock:
            for pid in pids:
                self._discard(pid)

    # -- what the daemon sends ---------------------------------------------------------------
    def request_trace(self, pid: int, steps: int) -> bool:
        """Ask `pid`'s agent to trace its allocations over the next `steps` steps (1 to 100).

        One datagram, `{"v": 1, "kind": "trace", "steps": K}`, to the abstract address its newest
        report came from, sent from agent.sock with MSG_DONTWAIT: the poll thread never waits
        on a training process. False when there is nowhere to send (no such process, no
        abstract address, the receiver stopped) or the send failed (the agent's queue full, its
        socket closed); never raises.
        """
        if type(steps) is not int or not 1 <= steps <= MAX_TRACE_STEPS:
            return False
        with self._lock:
            agent = self._agents.get(pid)
            address = agent.reply_to if agent is not None else None
        sock = self._sock
        if address is None or sock is None:
            return False
        payload = json.dumps({"v": PROTOCOL_VERSION, "kind": "trace", "steps": steps},
                             separators=(",", ":")).encode()
        try:
            sock.sendto(payload, socket.MSG_DONTWAIT, address)
        except (OSError, ValueError, TypeError) as exc:
            log.debug("agent socket: trace request to PID %d failed: %s", pid, exc)
            return False
        return True


_TraceFields = tuple[str, str, Optional[int], tuple[TraceSite, ...], tuple[tuple[str, int], ...]]


def _sizes(value: Any, limit: int, known: Mapping[str, str], pattern: re.Pattern[str]
           ) -> dict[str, BufferSize]:
    """At most `limit` name -> {"items", "bytes"}, each name either `known` (accepted before)
    or matching `pattern`."""
    if type(value) is not dict:
        raise _Rejected("bad_type")
    if len(value) > limit:
        raise _Rejected("too_many_buffers")
    sizes = {}
    for name, size in value.items():
        if name not in known and pattern.fullmatch(name) is None:
            raise _Rejected("bad_name")
        if type(size) is not dict:
            raise _Rejected("bad_type")
        sizes[name] = BufferSize(_optional_int(size.get("items")),
                                 _optional_int(size.get("bytes")))
    return sizes


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


def _required_int(value: Any) -> int:
    if value is None:
        raise _Rejected("bad_type")
    return _optional_int(value)  # type: ignore[return-value]


def _text(value: Any, limit: int) -> str:
    if type(value) is not str:
        raise _Rejected("bad_type")
    if len(value) > limit or _CONTROL.search(value) is not None:
        raise _Rejected("bad_value")
    return value


def _choice(value: Any, choices: tuple[str, ...]) -> str:
    """One of `choices`: missing is malformed, another type bad_type, another string bad_value."""
    if value is None:
        raise _Rejected("malformed")
    if type(value) is not str:
        raise _Rejected("bad_type")
    if value not in choices:
        raise _Rejected("bad_value")
    return value


def _trace(value: Any) -> _TraceFields:
    if value is None:
        raise _Rejected("malformed")
    if type(value) is not dict:
        raise _Rejected("bad_type")
    status = _choice(value.get("status"), TRACE_STATUSES)
    why = value.get("why")
    why = "" if why is None else _text(why, MAX_TRACE_WHY)
    steps = _optional_int(value.get("steps"))
    sites = tuple(TraceSite(_file(site.get("file")), _required_int(site.get("line")),
                            _required_int(site.get("bytes")), _required_int(site.get("count")))
                  for site in _items(value.get("sites"), MAX_TRACE_SITES, dict))
    frames = tuple((_file(frame.get("file")), _required_int(frame.get("line")))
                   for frame in _items(value.get("traceback"), MAX_TRACEBACK, dict))
    return status, why, steps, sites, frames


def _items(value: Any, limit: int, item_type: type) -> list[Any]:
    """A list of at most `limit` items of `item_type` (absent: none)."""
    if value is None:
        return []
    if type(value) is not list:
        raise _Rejected("bad_type")
    if len(value) > limit:
        raise _Rejected("bad_value")
    for item in value:
        if type(item) is not item_type:
            raise _Rejected("bad_type")
    return value


def _file(value: Any) -> str:
    name = _text(value, MAX_TRACE_FILE)
    if not name:
        raise _Rejected("bad_value")
    return name


def _exit_report(value: Any) -> Mapping[str, Any]:
    if value is None:
        return _EMPTY_EXIT
    if type(value) is not dict:
        raise _Rejected("bad_type")
    report: dict[str, Any] = {}
    threads = value.get("threads")
    if threads is not None:
        for name in _items(threads, MAX_EXIT_THREADS, str):
            if len(name) > MAX_THREAD_NAME:
                raise _Rejected("bad_value")
        report["threads"] = tuple(threads)
    executors = _optional_int(value.get("executors"))
    if executors is not None:
        report["executors"] = executors
    process_group = value.get("process_group")
    if process_group is not None:
        if type(process_group) is not bool:
            raise _Rejected("bad_type")
        report["process_group"] = process_group
    return MappingProxyType(report)


def _close_passed_fds(cdata: bytes) -> None:
    # Descriptors a sender passed along (SCM_RIGHTS) would otherwise leak into the daemon.
    count = len(cdata) // 4
    for fd in struct.unpack(f"{count}i", cdata[:count * 4]):
        with contextlib.suppress(OSError):
            os.close(fd)
