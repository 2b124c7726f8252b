"""The agent's socket: reports out to the daemon, and the daemon's rare requests back.

Reports are one non-blocking `sendto` each on a Unix datagram socket: a training loop never waits
for its monitor. Without a daemon the agent backs off (1 s, doubling to 30 s) so that a node
without gpuwatch costs one failed `sendto` now and then, and a `stat` of the socket path twice
a second: a daemon that starts again (a new socket file there) is reported to at the next step.

A socket of the user's own: once the daemon has seen a report from this user on agent.sock, it
makes `agent.d/<uid>.sock` beside it, which only this user may send to, so that its kernel queue
(10 datagrams where `net.unix.max_dgram_qlen` is the kernel's default) is not shared with another
user's flood. The agent looks for it at most once a second while it reports to agent.sock, sends
there once it exists, and goes back to agent.sock if it is gone (a daemon restarted).

The socket is bound to a kernel-chosen abstract address (autobind), which the daemon sees as the
sender's address and can answer to. An answer is accepted only from the socket the reports go to:
its source address must be that path, and the kernel's credentials (SO_PASSCRED) must name root or
the owner of the socket file. Any local user can send to an abstract address; nobody else can
send from the daemon's bound path.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import struct
import time
from typing import Any, Optional

from gpuwatch.protocol import (
    DEFAULT_RUNTIME_DIR,
    MAX_REQUEST_DATAGRAM,
    PRIVATE_SOCKET_DIR,
    RUNTIME_DIR_VARIABLE,
    SOCKET_NAME,
)

__all__ = ["BACKOFF_FIRST", "BACKOFF_MAX", "DEFAULT_RUNTIME_DIR", "SOCKET_NAME", "Transport"]

#: How often, at most, the agent looks for its user's own socket while it has none.
PRIVATE_CHECK_EVERY = 1.0
#: With no daemon, one failed send, then silence for this long, doubling up to BACKOFF_MAX.
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 30.0
#: Datagrams read per check: a flood of forged requests costs the loop at most this many reads.
READS_PER_CHECK = 4

# Below this the receiver's queue was full or the kernel short of buffers: the daemon is there,
# so the report is dropped without backing off.
_TRANSIENT = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.EINTR})
_UCRED = struct.Struct("iII")  # pid_t, uid_t, gid_t
_ANCILLARY = socket.CMSG_SPACE(_UCRED.size) if hasattr(socket, "CMSG_SPACE") else 0


class Transport:
    """One socket to the daemon, with the backoff that keeps a node without one cheap."""

    __slots__ = ("attempts", "backoff", "dropped", "failed", "failed_on", "path", "private",
                 "private_checked", "sent", "sock")

    def __init__(self) -> None:
        self.sock: Optional[socket.socket] = None
        self.path: Optional[str] = None
        self.backoff = 0.0
        self.attempts = self.sent = self.failed = self.dropped = 0
        #: The socket file the last failed send met (device, inode), None where there was none.
        self.failed_on: Optional[tuple[int, int]] = None
        #: The user's own socket, when the daemon made one; reports go there instead.
        self.private: Optional[str] = None
        self.private_checked = -PRIVATE_CHECK_EVERY

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def resolve(self, configured: Optional[str]) -> str:
        if self.path is None:
            self.path = configured or os.path.join(
                os.environ.get(RUNTIME_DIR_VARIABLE) or DEFAULT_RUNTIME_DIR, SOCKET_NAME)
        return self.path

    def send(self, data: bytes, configured_path: Optional[str]) -> float:
        """Send one datagram; returns how long to wait before the next step report (0: no
        extra wait). Never raises: anything going wrong is treated as no daemon."""
        self.attempts += 1
        try:
            sock = self.sock
            if sock is None:
                sock = self.sock = _open()
            shared = self.path or self.resolve(configured_path)
            target = self.private or self._look_for_private(shared)
            if target is not None:
                try:
                    sock.sendto(data, target)
                except OSError as e:
                    if e.errno in _TRANSIENT:
                        raise
                    self.private = None  # gone (a daemon restarted): agent.sock again
                    self.private_checked = time.monotonic()
                    sock.sendto(data, shared)
            else:
                sock.sendto(data, shared)
        except Exception as e:
            if getattr(e, "errno", None) in _TRANSIENT:
                self.dropped += 1
                return 0.0
            # No daemon (ENOENT, ECONNREFUSED), no permission, a path too long...
            self.failed += 1
            self.backoff = min(self.backoff * 2, BACKOFF_MAX) if self.backoff else BACKOFF_FIRST
            self.failed_on = _file_of(self.path)
            return self.backoff
        self.sent += 1
        self.backoff = 0.0
        return 0.0

    def _look_for_private(self, shared: str) -> Optional[str]:
        now = time.monotonic()
        if now - self.private_checked < PRIVATE_CHECK_EVERY or self.backoff:
            return None
        self.private_checked = now
        path = os.path.join(os.path.dirname(shared), PRIVATE_SOCKET_DIR, f"{os.geteuid()}.sock")
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                self.private = path
        except OSError:
            pass
        return self.private

    def daemon_returned(self) -> bool:
        """While backing off: whether the socket path is another file now than when the send
        failed, as when a daemon starts again and binds it. A stat, for a daemon restarted in
        seconds not to wait out a backoff that grew while it was away."""
        if not self.backoff or self.path is None:
            return False
        now = _file_of(self.path)
        return now is not None and now != self.failed_on

    def requests(self) -> list[dict[str, Any]]:
        """The daemon's requests waiting, oldest first: a few non-blocking reads. Datagrams not
        from the daemon are dropped unread."""
        sock, path = self.sock, self.path
        if sock is None or path is None or not _ANCILLARY:
            return []
        found = []
        for _ in range(READS_PER_CHECK):
            try:
                data, ancillary, flags, source = sock.recvmsg(MAX_REQUEST_DATAGRAM + 1, _ANCILLARY,
                                                              socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            _close_passed_fds(ancillary)
            if flags & socket.MSG_TRUNC or not _from_daemon(ancillary, source,
                                                            (path, self.private)):
                continue
            with contextlib.suppress(ValueError):
                request = json.loads(data.decode("utf-8"))
                if type(request) is dict and request.get("v") == 1:
                    found.append(request)
        return found


def _open() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        with contextlib.suppress(OSError, AttributeError):
            # The daemon's answers carry its credentials; an abstract address gives it somewhere
            # to answer to. Where either is missing, reports still go out.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind("")
    except BaseException:
        sock.close()
        raise
    return sock


def _from_daemon(ancillary: list[tuple[int, int, bytes]], source: Any,
                 paths: tuple[str, Optional[str]]) -> bool:
    if source is None or source not in paths:
        return False
    path = source
    for level, kind, cdata in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS \
                and len(cdata) >= _UCRED.size:
            _, uid, _ = _UCRED.unpack_from(cdata)
            if uid == 0:
                return True
            try:
                return bool(os.stat(path).st_uid == uid)
            except OSError:
                return False
    return False


def _close_passed_fds(ancillary: list[tuple[int, int, bytes]]) -> None:
    # Descriptors anyone passed along (SCM_RIGHTS) would otherwise leak into the training process.
    for level, kind, cdata in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            for fd in struct.unpack(f"{len(cdata) // 4}i", cdata[:len(cdata) // 4 * 4]):
                with contextlib.suppress(OSError):
                    os.close(fd)


def _file_of(path: Optional[str]) -> Optional[tuple[int, int]]:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
