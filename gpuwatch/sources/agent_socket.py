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
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Optional

from gpuwatch.agent_budget import AgentBudget
from gpuwatch.model import (
    NO_DISCOVERY,
    AgentReading,
    BufferSize,
    StepPoint,
    TraceReport,
    TraceSite,
)
from gpuwatch.protocol import (
    BUFFER_NAME_PATTERN,
    DISCOVERED_NAME_PATTERN,
    INT_LIMIT,
    MAX_BUFFERS,
    MAX_DATAGRAM,
    MAX_DISCOVERED_PER_REPORT,
    MAX_EXIT_THREADS,
    MAX_SEARCH_SECONDS,
    MAX_THREAD_NAME,
    MAX_TRACE_FILE,
    MAX_TRACE_SITES,
    MAX_TRACE_STEPS,
    MAX_TRACE_WHY,
    MAX_TRACEBACK,
    PRIVATE_SOCKET_DIR,
    PROTOCOL_VERSION,
    REPORT_KINDS,
    TRACE_STATUSES,
)
from gpuwatch.runtime_dir import FileIdentity, file_identity, unlink_if_same

log = logging.getLogger(__name__)

#: Users given a socket of their own, at most; any further user shares agent.sock.
MAX_PRIVATE_SOCKETS = 64
#: Datagrams read from one socket before the next ready one is served: the sockets are drained
#: in turn, so a user flooding its own socket delays the others' by at most this many reports.
RECEIVE_BATCH = 32
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

REASONS = ("malformed", "version", "oversized", "too_many_buffers", "bad_name", "bad_value",
           "bad_type", "no_credentials", "too_many_processes", "rate_limited", "user_share",
           "memory_budget")

_INT_LIMIT = INT_LIMIT
_NAME = re.compile(BUFFER_NAME_PATTERN)
_DISCOVERED_NAME = re.compile(DISCOVERED_NAME_PATTERN)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_KINDS = REPORT_KINDS
_UCRED = struct.Struct("iII")  # pid_t, uid_t, gid_t: the size of "3i", unsigned ids
_ANCILLARY_SIZE = socket.CMSG_SPACE(struct.calcsize("3i"))
# A kernel-side receive timeout, so the thread sees its stop flag even if the shutdown() that
# stop() wakes it with is missed; unlike settimeout() it adds no poll() syscall before every
# receive. Long: each wake-up of an idle daemon takes the interpreter's lock from its poll.
_RECEIVE_TIMEOUT = struct.pack("ll", 2, 0)
_POLL_TIMEOUT_MS = 2000
_ACL_XATTR = "system.posix_acl_access"
_ACL_UNDEFINED_ID = 0xFFFFFFFF


_NO_BUFFERS: Mapping[str, BufferSize] = MappingProxyType({})
_EMPTY_EXIT: Mapping[str, Any] = MappingProxyType({})


class _Rejected(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


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


def _optional_int(value: Any) -> Optional[int]:
    if value is None:
        return None
    if type(value) is not int:
        raise _Rejected("bad_type")
    if value < 0 or value >= _INT_LIMIT:
        raise _Rejected("bad_value")
    return value


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
    return 512 + sum(64 + len(name) for name in report.get("threads", ()))


class _Rate:
    """A token bucket: `tokens` as of `at` (monotonic seconds), refilled at a rate a second up
    to one second's worth; a report takes one."""

    __slots__ = ("at", "key", "tokens")

    def __init__(self, key: int, tokens: float, at: float) -> None:
        self.key = key  # the UID, for a process's bucket
        self.tokens = tokens
        self.at = at


class AgentReceiver:
    """Receives agent reports on a Unix datagram socket in a daemon thread."""

    def __init__(self, path: Path, *, max_processes: int = DEFAULT_MAX_PROCESSES,
                 max_points: int = 256, clock: Callable[[], float] = time.time,
                 max_pending: int = DEFAULT_MAX_PENDING, budget: Optional[AgentBudget] = None,
                 max_reports_per_second: Optional[float] = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.max_processes = max_processes
        self.max_points = max_points
        self.max_pending = max_pending
        #: None: no rate limit (the daemon always sets one, agent.max_reports_per_second).
        self.max_reports_per_second = max_reports_per_second
        #: The memory budget everything agent reports create is charged to (docs/agent.md).
        self.budget = budget if budget is not None else AgentBudget()
        self.budget.add_reclaimer(self._reclaim, order=1)
        self._clock = clock
        self._monotonic = monotonic
        self._agents: dict[int, _Agent] = {}
        #: Slots and pending entries held by each user.
        self._slots_by_uid: dict[int, int] = {}
        self._pending_by_uid: dict[int, int] = {}
        self._pending_total = 0
        # Token buckets by UID and by PID; only the receiving thread touches them.
        self._user_rates: dict[int, _Rate] = {}
        self._process_rates: dict[int, _Rate] = {}
        self._processes_by_uid: dict[int, int] = {}
        self._rates_pruned_at = monotonic()
        self._accepted = 0
        self._rejected = dict.fromkeys(REASONS, 0)
        self._trace_reports = dict.fromkeys(TRACE_STATUSES, 0)
        # Guards the agents and the counters: the receiving thread writes, the poll thread drains.
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._inode: Optional[FileIdentity] = None
        #: uid -> its own socket, and each one's file (to remove only our own at stop).
        self._private: dict[int, socket.socket] = {}
        self._private_files: list[tuple[Path, Optional[FileIdentity]]] = []
        #: False once the file system refused an ACL: every user shares agent.sock.
        self._private_supported = True

    def configure(self, max_processes: int, memory_budget: int,
                  max_reports_per_second: Optional[float]) -> None:
        """Apply [agent] limits (at start and on reload). Lowered limits refuse what is new;
        what is kept beyond them goes as the budget reclaims it or as processes exit."""
        with self._lock:
            self.max_processes = max_processes
            self.max_reports_per_second = max_reports_per_second
        self.budget.max_bytes = memory_budget

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
                sock.shutdown(socket.SHUT_RDWR)  # wakes the receiving thread's poll at once
        if thread is not None:
            thread.join(timeout=5)
        if sock is not None:
            sock.close()
        self._sock = None
        self._thread = None
        for private in self._private.values():
            private.close()
        self._private.clear()
        for path, identity in self._private_files:
            unlink_if_same(path, identity)
        self._private_files.clear()
        # Only our own socket: a daemon started since may have put its own at this path.
        inode, self._inode = self._inode, None
        unlink_if_same(self.path, inode)

    def _receive_loop(self, sock: socket.socket) -> None:
        """Serve agent.sock and the users' own sockets in turn, RECEIVE_BATCH datagrams of
        each ready one at a time, until stop()."""
        stopping = self._stopping.is_set
        poller = select.poll()
        by_fd = {sock.fileno(): sock}
        poller.register(sock, select.POLLIN)
        while not stopping():
            try:
                ready = poller.poll(_POLL_TIMEOUT_MS)
            except InterruptedError:
                continue
            for fd, events in ready:
                ready_sock = by_fd.get(fd)
                if ready_sock is None or stopping():
                    continue
                if events & (select.POLLERR | select.POLLNVAL) and ready_sock is not sock:
                    poller.unregister(fd)
                    del by_fd[fd]
                    continue
                for uid in self._receive_batch(ready_sock, shared=ready_sock is sock):
                    private = self._open_private(uid)
                    if private is not None:
                        by_fd[private.fileno()] = private
                        poller.register(private, select.POLLIN)

    def _receive_batch(self, sock: socket.socket, shared: bool) -> list[int]:
        """Read and handle up to RECEIVE_BATCH datagrams waiting on `sock`; the users, seen on
        the shared socket, who have no socket of their own yet."""
        recvmsg = sock.recvmsg
        handle = self.handle
        newcomers: list[int] = []
        for _ in range(RECEIVE_BATCH):
            try:
                data, ancillary, flags, address = recvmsg(MAX_DATAGRAM + 1, _ANCILLARY_SIZE,
                                                          socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if self._stopping.is_set():
                    break
                log.warning("agent socket: receive failed: %s", exc)
                if exc.errno in (errno.EBADF, errno.ENOTSOCK, errno.EINVAL):
                    break
                time.sleep(0.01)  # a transient error (ENOMEM, ENOBUFS): do not spin on it
                break
            if self._stopping.is_set():
                break
            if not data and not ancillary and address is None:
                break  # shut down (stop())
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
                if shared and uid not in self._private and uid not in newcomers:
                    newcomers.append(uid)
                handle(data, pid, uid, bool(flags & socket.MSG_TRUNC), address, via=sock)
            except Exception:
                # One bad datagram must never end the receiving thread.
                log.debug("agent socket: report handling failed", exc_info=True)
                self._count("malformed")
        return newcomers

    def _open_private(self, uid: int) -> Optional[socket.socket]:
        """A socket of `uid`'s own, `agent.d/<uid>.sock`, mode 0600 and a POSIX ACL letting
        `uid` (and only it, besides the daemon's user and root) send to it; None when the
        limit is reached or the file system takes no ACL (then agent.sock serves it)."""
        if not self._private_supported or len(self._private) >= MAX_PRIVATE_SOCKETS \
                or uid in self._private:
            return None
        directory = self.path.parent / PRIVATE_SOCKET_DIR
        path = directory / f"{uid}.sock"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(FileExistsError):
                directory.mkdir(mode=0o755)
            os.chmod(directory, 0o755)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a stale one from an earlier run
            sock.bind(str(path))
            identity = file_identity(path)
            os.chmod(path, 0o600)
            if uid not in (0, os.geteuid()):
                os.setxattr(path, _ACL_XATTR, _acl_granting(uid))
        except OSError as exc:
            sock.close()
            with contextlib.suppress(OSError):
                path.unlink()
            if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.EACCES,
                             errno.EROFS):
                self._private_supported = False
                log.info("agent socket: no socket of their own for users (%s: %s); all "
                         "share %s", path, exc.strerror, self.path)
            else:
                log.warning("agent socket: cannot make %s: %s", path, exc.strerror)
            return None
        self._private[uid] = sock
        self._private_files.append((path, identity))
        return sock

    # -- validation and storage --------------------------------------------------------------
    def handle(self, payload: bytes, pid: int, uid: int, truncated: bool = False,
               address: Any = None, via: Optional[socket.socket] = None) -> None:
        """Validate one report from `pid`/`uid` (kernel credentials); store it or count why not.

        `address` is the sender's, as recvmsg gave it: an abstract one (bytes starting with a NUL
        byte) is where `request_trace` can reach the process.
        """
        try:
            # Before any parsing: a flood over its share costs two dictionary lookups each.
            if self.max_reports_per_second is not None and not self._within_rate(pid, uid):
                raise _Rejected("rate_limited")
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
                discovered = _sizes(raw_discovered, MAX_DISCOVERED_PER_REPORT,
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
                            exit_report, active, allocations, discovered, trace, address, via)
                self._accepted += 1
        except _Rejected as rejected:
            self._count(rejected.reason)

    def _within_rate(self, pid: int, uid: int) -> bool:  # max_reports_per_second is set
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
        # Two token buckets (_Rate.take, inlined: this runs for every datagram).
        tokens = process.tokens + (now - process.at) * rate
        process.tokens = tokens if tokens < rate else rate
        process.at = now
        if process.tokens < 1.0:
            return False
        if user_rate < rate:
            user_rate = rate
        tokens = user.tokens + (now - user.at) * user_rate
        user.tokens = tokens if tokens < user_rate else user_rate
        user.at = now
        if user.tokens < 1.0:
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
            raise _Rejected("too_many_processes")
        if slots.get(uid, 0) >= self.max_processes // users:
            raise _Rejected("user_share")
        most = max(slots, key=slots.__getitem__)
        victim = min((pid for pid, a in self._agents.items() if a.uid == most),
                     key=lambda pid: self._agents[pid].last_seen)
        self._discard(victim)
        self.budget.evicted("process", "user_share")

    def _store(self, pid: int, uid: int, now: float, kind: str, step: Optional[int],
               rss: Optional[int], allocated: Optional[int], reserved: Optional[int],
               buffers: Optional[dict[str, BufferSize]],
               exit_report: Optional[Mapping[str, Any]], active: Optional[int],
               allocations: Optional[int], discovered: Optional[dict[str, BufferSize]],
               trace: Optional[_TraceFields], address: Any,
               via: Optional[socket.socket] = None) -> None:
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
                raise _Rejected("too_many_buffers")
            growth += len(added) * NAME_BYTES
        if discovered:
            known = agent.discovered_names
            fresh = sum(1 for name in discovered if name not in known)
            growth += (min(len(known) + fresh, MAX_DISCOVERED_NAMES_PER_PROCESS)
                       - len(known)) * DISCOVERED_NAME_BYTES
        report_trace: Optional[TraceReport] = None
        if kind == "step":
            entries = 1 + len(buffers or ()) + len(discovered or ())
            growth += (entries - _cost(agent.latest)) * ENTRY_BYTES
        elif kind == "trace":
            assert trace is not None
            status, why, steps, sites, traceback = trace
            report_trace = TraceReport(status, why, steps, sites, traceback, now, step)
            growth += _trace_bytes(report_trace) - _trace_bytes(agent.trace)
        elif kind == "exit":
            growth += _exit_bytes(exit_report) - _exit_bytes(agent.exit_report)
        if growth > 0:
            reason = self.budget.grant(uid, "receiver", growth)
            if reason is not None:
                raise _Rejected(reason)
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
        elif kind == "finished":
            if agent.finished_at is None:
                agent.finished_at = now
        elif kind == "trace":
            assert report_trace is not None
            agent.trace = report_trace
            self._trace_reports[report_trace.status] += 1
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
        with self._lock:
            candidates = sorted((pid for pid, a in self._agents.items() if a.uid == uid),
                                key=lambda pid: self._agents[pid].last_seen)
            freed = evicted = 0
            for pid in candidates:
                if freed >= nbytes:
                    break
                freed += self._discard(pid)
                evicted += 1
        if evicted:
            self.budget.evicted("process", reason, evicted)
        return freed

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
            for uid, entries in self._pending_by_uid.items():
                self.budget.release(uid, "pending", entries * ENTRY_BYTES)
            self._pending_by_uid.clear()
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
        return self._request(pid, {"v": PROTOCOL_VERSION, "kind": "trace", "steps": steps})

    def request_search(self, pid: int, seconds: int) -> bool:
        """Ask `pid`'s agent to search for growing containers faster, for `seconds` (1 to
        MAX_SEARCH_SECONDS): `{"v": 1, "kind": "search", "seconds": S}`, sent as a trace
        request is."""
        if type(seconds) is not int or not 1 <= seconds <= MAX_SEARCH_SECONDS:
            return False
        return self._request(pid, {"v": PROTOCOL_VERSION, "kind": "search", "seconds": seconds})

    def _request(self, pid: int, request: dict[str, Any]) -> bool:
        with self._lock:
            agent = self._agents.get(pid)
            address = agent.reply_to if agent is not None else None
            via = agent.reply_via if agent is not None else None
        sock = self._sock if via is None or via.fileno() < 0 else via
        if address is None or sock is None:
            return False
        payload = json.dumps(request, separators=(",", ":")).encode()
        try:
            sock.sendto(payload, socket.MSG_DONTWAIT, address)
        except (OSError, ValueError, TypeError) as exc:
            log.debug("agent socket: %s request to PID %d failed: %s", request["kind"], pid, exc)
            return False
        return True


_TraceFields = tuple[str, str, Optional[int], tuple[TraceSite, ...], tuple[tuple[str, int], ...]]


def _acl_granting(uid: int) -> bytes:
    """A POSIX access ACL (the kernel's xattr form, as setfacl writes it) giving the owner and
    `uid` read and write, and nobody else anything: `user::rw-,user:<uid>:rw-,group::---,
    mask::rw-,other::---`."""
    entries = ((0x01, 6, _ACL_UNDEFINED_ID), (0x02, 6, uid), (0x04, 0, _ACL_UNDEFINED_ID),
               (0x10, 6, _ACL_UNDEFINED_ID), (0x20, 0, _ACL_UNDEFINED_ID))
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


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
