"""Serving a listening socket without a thread per connection.

One thread runs a `selectors` loop over the listening socket and every open connection: it
accepts, completes TLS handshakes, reads requests and writes answers, all without blocking, so an
idle or slow client costs a file descriptor and a few hundred bytes, never a thread. Work that
may take time (rendering /metrics or the status document, checking a bcrypt password) runs on
small pools of one thread each, created when first used.

What a client can hold is bounded:

- `max_connections` open at once. A connection beyond it closes the oldest one that has not yet
  sent its whole request ("evicted"), or, if every open one already has, is closed at once
  ("refused"). A scraper sends its request as soon as it connects, so a flood of idle
  connections evicts its own members, not the scrape.
- `request_timeout`, from accept to the end of the request (TLS handshake included): a
  connection that sends nothing, or a byte now and then, is closed when it runs out.
- `response_timeout`, from the end of the request to the last byte handed to the kernel: a
  client that stops reading is closed, quietly (one debug line and a count).
- `max_answering` answers in flight (rendered or being written) at once: the memory held for
  clients that do not read is at most that many bodies. Further requests wait their turn. Work
  that comes before an answer (checking a password) waits on its own pool, not in that line: a
  flood of requests needing it delays none of the others.

Each connection ends with one result, counted per socket in `ConnectionStats`: `answered`,
`refused`, `evicted`, `timed_out` or `failed` (reset or closed by the client before the answer,
a failed TLS handshake).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import math
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from gpuwatch.serve.connections import ConnectionStats
from gpuwatch.serve.work_pool import WorkPool
from gpuwatch.threads import start_without_signals

if TYPE_CHECKING:
    import ssl

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 10.0
RESPONSE_TIMEOUT = 10.0
MAX_CONNECTIONS = 256
MAX_ANSWERING = 16

_ACCEPT_BATCH = 64
_SEND_CHUNK = 256 << 10
_RECV_CHUNK = 64 << 10
_EXPIRY_CHECK = 0.1
_NO_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
#: What a non-blocking socket's call raises when it would block (`_waits_for`); a listener
#: with TLS adds ssl's SSLWantReadError and SSLWantWriteError. ssl is imported only by a
#: listener with TLS (or a web config): 5 MiB of a daemon's memory without one.
_WOULD_BLOCK: tuple[type[BaseException], ...] = (BlockingIOError, InterruptedError)

# Connection states.
_HANDSHAKE = "handshake"
_READING = "reading"
_WAITING = "waiting"  # request complete, waiting for an answering slot
_WORKING = "working"  # its answer is being prepared on a pool
_CHECKING = "checking"  # on a pool, before it may take an answering slot (a password check)
_HELD = "held"  # its answer held back until `release` (Later)
_WRITING = "writing"
_BUSY = (_WORKING, _WRITING)


#: The bytes of an answer: whole, or in parts written one after the other (a header, then a body
#: kept elsewhere for the next request, which is thus never copied onto the header).
Answer = Union[bytes, tuple[bytes, ...]]


@dataclass(frozen=True)
class Job:
    """Work for a pool: `run()` returns the answer, or another Job.

    `answering`: whether it takes one of the `max_answering` slots (a render holds a body in
    memory until it is written); a Job that does not (a password check) goes to its pool at
    once, never into the line of requests waiting for a slot, and never delays one. `priority`
    orders the Jobs waiting in one pool, lowest first, first come first served among equals.
    """

    pool: str
    run: Callable[[], Union[Answer, Job]]
    answering: bool = True
    priority: int = 0


@dataclass(frozen=True)
class Later:
    """An answer held back `delay` seconds (a tarpit): the connection waits, holding no slot
    and no thread, and is the first to be evicted when connections run short."""

    answer: Answer
    delay: float


Outcome = Union[Answer, Job, Later]


class Handler:
    """What a listener asks of its protocol. `dispatch` runs on the loop thread and must be
    quick: whatever may take time goes in a Job."""

    def request_end(self, buf: bytearray) -> int:
        """The length of the complete request at the start of `buf`, or -1."""
        raise NotImplementedError

    max_request = 8192
    #: whether a client closing its side after part of a request ends the request
    eof_ends_request = False

    def dispatch(self, request: Optional[bytes], conn: Conn) -> Outcome:
        """The answer to `request` (None: it was larger than `max_request`)."""
        raise NotImplementedError

    def failure(self) -> Answer:
        """The answer when preparing one raised."""
        raise NotImplementedError

    def after_handshake(self, sock: ssl.SSLSocket) -> Optional[str]:
        """A reason to refuse the TLS peer, or None."""
        return None


class Conn:
    __slots__ = ("born", "buf", "deadline", "events", "id", "off", "out", "peer", "release",
                 "sock", "state")

    def __init__(self, cid: int, sock: socket.socket, peer: Any, state: str,
                 deadline: float) -> None:
        self.id = cid
        self.sock = sock
        self.peer = peer
        self.state = state
        self.deadline = deadline
        self.born = time.monotonic()
        self.buf = bytearray()
        #: What is left to write, part by part; `off` bytes of the first are written.
        self.out: Optional[list[memoryview]] = None
        self.off = 0
        self.events = 0
        self.release = 0.0


class Listener:
    """Serves `sock` (bound and listening) with `handler` from one thread; see the module."""

    def __init__(self, sock: socket.socket, name: str, handler: Handler,
                 stats: Optional[ConnectionStats] = None,
                 tls: Optional[Callable[[], Optional[ssl.SSLContext]]] = None, *,
                 max_connections: int = MAX_CONNECTIONS, max_answering: int = MAX_ANSWERING,
                 request_timeout: float = REQUEST_TIMEOUT,
                 response_timeout: float = RESPONSE_TIMEOUT) -> None:
        self.sock = sock
        self.name = name
        self.handler = handler
        self.stats = stats if stats is not None else ConnectionStats((name,))
        self._tls = tls
        #: What this listener's sockets raise when they would block, and when a TLS peer
        #: closed (ssl's errors only with TLS: without it, ssl is not imported).
        self._would_block = _WOULD_BLOCK
        self._tls_closed: tuple[type[BaseException], ...] = ()
        if tls is not None:
            import ssl
            self._would_block = (*_WOULD_BLOCK, ssl.SSLWantReadError, ssl.SSLWantWriteError)
            self._tls_closed = (ssl.SSLEOFError, ssl.SSLZeroReturnError)
        self.max_connections = max_connections
        self.max_answering = max_answering
        self.request_timeout = request_timeout
        self.response_timeout = response_timeout
        self._conns: dict[int, Conn] = {}
        self._waiting: collections.deque[tuple[int, Job]] = collections.deque()
        self._busy = 0
        self._next_id = 0
        self._pools: dict[str, WorkPool] = {}
        self._results: collections.deque[tuple[int, Any]] = collections.deque()
        self._stopping = False
        self._accept_paused_until: Optional[float] = None
        self._next_expiry = 0.0
        #: Turns of the loop: each wake-up, for whatever reason (for tests).
        self.turns = 0
        self._thread: Optional[threading.Thread] = None
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w, sock):
            s.setblocking(False)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._sel.register(self.sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-listener",
                                        daemon=True)
        start_without_signals(self._thread)

    def stop(self) -> None:
        """Close every connection and the listening socket; return once the loop has ended."""
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        else:
            self._close_everything()

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    # -- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                now = time.monotonic()
                # With no connection open nothing can expire: the loop sleeps until a client
                # connects or it is woken (a daemon nobody scrapes does not wake every second).
                timeout: Optional[float] = max(0.0, self._next_expiry - now)
                if self._accept_paused_until is not None:
                    timeout = min(timeout, max(0.0, self._accept_paused_until - now))
                ready = self._sel.select(None if timeout == math.inf else timeout)
                self.turns += 1
                for key, _ in ready:
                    if key.data is None:
                        self._accept()
                    elif key.data is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._service(key.data)
                self._take_results()
                self._expire()
                self._resume_accepting()
                self.stats.set_open(self.name, len(self._conns))
        except Exception:  # a bug: log it, and leave the socket closed rather than half-served
            log.exception("%s listener failed; it no longer accepts connections", self.name)
        finally:
            self._close_everything()

    def _close_everything(self) -> None:
        for conn in list(self._conns.values()):
            self._forget(conn)
        self.stats.set_open(self.name, 0)
        for pool in self._pools.values():
            pool.stop()
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(self.sock)
        self._sel.close()
        for s in (self.sock, self._wake_r, self._wake_w):
            s.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: the loop is awake already
            self._wake_w.send(b"\0")

    # -- accepting ---------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _NO_DESCRIPTORS:
                    # No descriptor to accept with: free the oldest idle one, and stop accepting
                    # for a moment instead of spinning on a listening socket that stays readable.
                    if not self._evict_one():
                        self._pause_accepting()
                    log.debug("%s: cannot accept: %s", self.name, exc.strerror)
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue
                log.warning("%s: cannot accept connections: %s", self.name, exc)
                self._pause_accepting()
                return
            if len(self._conns) >= self.max_connections and not self._evict_one():
                self.stats.ended(self.name, "refused")
                sock.close()
                continue
            self._open(sock, peer)

    def _open(self, sock: socket.socket, peer: Any) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # An answer goes out as a header, then its body: without this, Nagle's algorithm
            # holds the body's last segment until the client acknowledges the header, which
            # a client that delays its acknowledgements makes wait 40 ms.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        deadline = time.monotonic() + self.request_timeout
        state = _READING
        context = self._tls() if self._tls is not None else None
        if context is not None:
            try:
                sock = context.wrap_socket(sock, server_side=True,
                                           do_handshake_on_connect=False)
            except OSError:
                sock.close()
                self.stats.ended(self.name, "failed")
                return
            state = _HANDSHAKE
        self._next_id += 1
        conn = Conn(self._next_id, sock, peer, state, deadline)
        self._conns[conn.id] = conn
        self._want(conn, selectors.EVENT_READ)
        self._next_expiry = min(self._next_expiry, deadline)

    def _pause_accepting(self) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(self.sock)
        self._accept_paused_until = time.monotonic() + 0.1

    def _resume_accepting(self) -> None:
        if self._accept_paused_until is not None and time.monotonic() >= \
                self._accept_paused_until:
            self._accept_paused_until = None
            self._sel.register(self.sock, selectors.EVENT_READ, None)

    def _evict_one(self) -> bool:
        """Close the oldest connection whose answer is held back, else the oldest still short
        of a complete request."""
        for conn in self._conns.values():
            if conn.state == _HELD:
                self._end(conn, "evicted")
                return True
        for conn in self._conns.values():  # insertion order: oldest first
            if conn.state in (_HANDSHAKE, _READING):
                self._end(conn, "evicted")
                return True
        return False

    # -- serving one connection ---------------------------------------------------------------
    def _service(self, conn: Conn) -> None:
        try:
            if conn.state == _HANDSHAKE:
                self._handshake(conn)
            elif conn.state == _READING:
                self._read(conn)
            elif conn.state == _WRITING:
                self._write(conn)
        except OSError as exc:  # reset, broken pipe, TLS alert: the client's doing
            self._end(conn, "failed", exc)
        except Exception:  # a bug: it ends this connection, not the listener
            log.exception("%s: serving a connection failed", self.name)
            self._end(conn, "failed")

    def _handshake(self, conn: Conn) -> None:
        sock: ssl.SSLSocket = conn.sock  # type: ignore[assignment]
        try:
            sock.do_handshake()
        except self._would_block as exc:
            self._want(conn, _waits_for(exc, selectors.EVENT_READ))
            return
        refusal = self.handler.after_handshake(sock)
        if refusal is not None:
            self._end(conn, "failed", refusal)
            return
        conn.state = _READING
        self._want(conn, selectors.EVENT_READ)
        self._read(conn)

    def _read(self, conn: Conn) -> None:
        while True:
            try:
                data = conn.sock.recv(_RECV_CHUNK)
            except self._would_block as exc:
                self._want(conn, _waits_for(exc, selectors.EVENT_READ))
                return
            except self._tls_closed:
                data = b""
            if not data:
                if conn.buf and self.handler.eof_ends_request:
                    self._request(conn, bytes(conn.buf))
                else:
                    self._end(conn, "failed", "closed before its request was complete")
                return
            conn.buf += data
            end = self.handler.request_end(conn.buf)
            if end >= 0:
                self._request(conn, bytes(conn.buf[:end]))
                return
            if len(conn.buf) > self.handler.max_request:
                self._request(conn, None)
                return

    def _request(self, conn: Conn, request: Optional[bytes]) -> None:
        conn.buf = bytearray()
        conn.deadline = time.monotonic() + self.response_timeout
        self._next_expiry = min(self._next_expiry, conn.deadline)
        self._want(conn, 0)
        try:
            outcome = self.handler.dispatch(request, conn)
        except Exception:
            log.exception("%s: answering a request failed", self.name)
            outcome = self.handler.failure()
        self._proceed(conn, outcome)

    def _proceed(self, conn: Conn, outcome: Outcome) -> None:
        if isinstance(outcome, Later):
            self._set_state(conn, _HELD)
            conn.out = _parts(outcome.answer)
            conn.release = time.monotonic() + outcome.delay
            conn.deadline = max(conn.deadline, conn.release + self.response_timeout)
            self._next_expiry = min(self._next_expiry, conn.release)
            return
        if isinstance(outcome, Job):
            if not outcome.answering:
                self._set_state(conn, _CHECKING)
                self._pool(outcome.pool).submit(conn.id, outcome.run, outcome.priority)
            elif conn.state in _BUSY or self._busy < self.max_answering:
                self._set_state(conn, _WORKING)
                self._pool(outcome.pool).submit(conn.id, outcome.run, outcome.priority)
            else:
                self._set_state(conn, _WAITING)
                self._waiting.append((conn.id, outcome))
            return
        self._set_state(conn, _WRITING)
        conn.out = _parts(outcome)
        conn.off = 0
        self._write(conn)

    def _write(self, conn: Conn) -> None:
        out = conn.out
        assert out is not None
        while out:
            part = out[0]
            while conn.off < len(part):
                try:
                    conn.off += conn.sock.send(part[conn.off:conn.off + _SEND_CHUNK])
                except self._would_block as exc:
                    self._want(conn, _waits_for(exc, selectors.EVENT_WRITE))
                    return
                except OSError as exc:  # the client reset or went away before the end
                    self._end(conn, "failed", exc)
                    return
            del out[0]
            conn.off = 0
        self._end(conn, "answered")

    # -- pools -------------------------------------------------------------------------------
    def _pool(self, name: str) -> WorkPool:
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = WorkPool(f"{self.name}-{name}", self._done)
        return pool

    def _done(self, cid: int, result: Any) -> None:  # on a pool's thread
        self._results.append((cid, result))
        self._wake()

    def _take_results(self) -> None:
        while self._results:
            cid, result = self._results.popleft()
            conn = self._conns.get(cid)
            if conn is None:
                continue  # closed meanwhile (timed out)
            if isinstance(result, BaseException):
                log.error("%s: answering a request failed", self.name, exc_info=result)
                result = self.handler.failure()
            try:
                self._proceed(conn, result)
            except Exception:
                log.exception("%s: serving a connection failed", self.name)
                self._end(conn, "failed")

    def _start_waiting(self) -> None:
        while self._waiting and self._busy < self.max_answering:
            cid, job = self._waiting.popleft()
            conn = self._conns.get(cid)
            if conn is not None and conn.state == _WAITING:
                self._proceed(conn, job)

    # -- bookkeeping -------------------------------------------------------------------------
    def _set_state(self, conn: Conn, state: str) -> None:
        self._busy += (state in _BUSY) - (conn.state in _BUSY)
        conn.state = state

    def _want(self, conn: Conn, events: int) -> None:
        if events == conn.events:
            return
        if conn.events == 0:
            self._sel.register(conn.sock, events, conn)
        elif events == 0:
            self._sel.unregister(conn.sock)
        else:
            self._sel.modify(conn.sock, events, conn)
        conn.events = events

    def _expire(self) -> None:
        now = time.monotonic()
        if now < self._next_expiry:
            return
        soonest = math.inf
        for conn in list(self._conns.values()):
            if conn.state == _HELD:
                if conn.release <= now:
                    self._set_state(conn, _WRITING)
                    conn.off = 0
                    self._write(conn)
                else:
                    soonest = min(soonest, conn.release)
            elif conn.deadline <= now:
                self._end(conn, "timed_out", f"no complete {_phase(conn)} in time")
            else:
                soonest = min(soonest, conn.deadline)
        self._next_expiry = max(soonest, now + _EXPIRY_CHECK)

    def _end(self, conn: Conn, result: str, why: Any = None) -> None:
        if conn.id not in self._conns:
            return
        if result == "answered":
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_WR)
        self._forget(conn)
        self.stats.ended(self.name, result)
        if why is not None:
            log.debug("%s: connection from %s %s: %s", self.name, conn.peer or "a local client",
                      result.replace("_", " "), why)
        self._start_waiting()

    def _forget(self, conn: Conn) -> None:
        del self._conns[conn.id]
        self._set_state(conn, "closed")
        if conn.events:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(conn.sock)
            conn.events = 0
        with contextlib.suppress(OSError):
            conn.sock.close()
        conn.out = None


def _parts(answer: Answer) -> list[memoryview]:
    """An answer's parts, to write one after the other."""
    return [memoryview(part) for part in answer] if isinstance(answer, tuple) \
        else [memoryview(answer)]


def _phase(conn: Conn) -> str:
    if conn.state == _HANDSHAKE:
        return "TLS handshake"
    if conn.state == _READING:
        return "request"
    return "answer read by the client"


def _waits_for(exc: BaseException, events: int) -> int:
    """The selector event a call that would block (`_WOULD_BLOCK`) waits for: `events`, its own
    direction, unless TLS must first read to write or write to read."""
    ssl = sys.modules.get("ssl")  # not imported: no TLS socket raised it
    if ssl is not None and isinstance(exc, ssl.SSLWantReadError):
        return selectors.EVENT_READ
    if ssl is not None and isinstance(exc, ssl.SSLWantWriteError):
        return selectors.EVENT_WRITE
    return events
