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

Only to the daemon: reports name buffers, culprits and threads, and a socket's reader may ask for
traces. So before its first report, and again after any failed send or when its own socket
appears, the agent checks where it sends, as `gpuwatch status` checks state.sock
(gpuwatch.runtime_dir.open_daemon_dir): the runtime directory and every directory above it,
looked up one component at a time without trusting a link's path, must be owned by root or this
user and writable by no one else (a sticky directory such as /tmp may lie above it; the runtime
directory itself may be its owner's where the directory above it is writable by root or this
user alone: /run/gpuwatch, the gpuwatch account's, in /run); `agent.d` must be such a directory
of one of those users, and the socket file (lstat) a socket of one of them. Reports then go to
the path with its links resolved: no one else can change what it names. SO_PEERCRED would name
who bound the socket, but Linux gives it for stream sockets only (a connected datagram socket
reads uid -1), so the file and the directories above it are what is judged. A socket refused is
treated as no daemon (backoff), and said once on stderr. Costs a few lstat calls per check, none
per report.
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

from gpuwatch.agent._exit import say
from gpuwatch.protocol import (
    DEFAULT_RUNTIME_DIR,
    MAX_REQUEST_DATAGRAM,
    PRIVATE_SOCKET_DIR,
    RUNTIME_DIR_VARIABLE,
    SOCKET_NAME,
    user_named,
    users_named,
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
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
#: Symbolic links followed on the way to the runtime directory, as the kernel's own limit.
_MAX_LINKS = 40


class Refused(Exception):
    """A socket the agent does not send to: the message says why, for the user."""


class Transport:
    """One socket to the daemon, with the backoff that keeps a node without one cheap."""

    __slots__ = ("attempts", "backoff", "dropped", "failed", "failed_on", "path", "private",
                 "private_checked", "refused", "said", "sent", "sock", "target", "trusted")

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
        #: agent.sock as checked (its directory's links resolved), None until checked again.
        self.target: Optional[str] = None
        #: The users whose sockets in the runtime directory are believed, as last checked.
        self.trusted: frozenset[int] = frozenset()
        #: Sockets refused (each counted as a failed send too); whether the agent said why.
        self.refused = 0
        self.said = False

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
            shared = self.target
            if shared is None:
                shared = self._check(self.path or self.resolve(configured_path))
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
            # No daemon (ENOENT, ECONNREFUSED), no permission, a path too long, a socket
            # refused: checked again at the next try.
            self.target = None
            if isinstance(e, Refused):
                self.refused += 1
                self._say(str(e))
            self.failed += 1
            self.backoff = min(self.backoff * 2, BACKOFF_MAX) if self.backoff else BACKOFF_FIRST
            self.failed_on = _file_of(self.path)
            return self.backoff
        self.sent += 1
        self.backoff = 0.0
        return 0.0

    def _check(self, path: str) -> str:
        """agent.sock at `path` checked (Refused, or OSError where it is missing): the path to
        send to, its directory's links resolved."""
        directory, self.trusted = checked_directory(os.path.dirname(path))
        target = os.path.join(directory, os.path.basename(path))
        check_socket(target, self.trusted)
        self.target = target
        return target

    def _look_for_private(self, shared: str) -> Optional[str]:
        now = time.monotonic()
        if now - self.private_checked < PRIVATE_CHECK_EVERY or self.backoff:
            return None
        self.private_checked = now
        directory = os.path.join(os.path.dirname(shared), PRIVATE_SOCKET_DIR)
        path = os.path.join(directory, f"{os.geteuid()}.sock")
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                check_private_dir(directory, self.trusted)
                check_socket(path, self.trusted)
                self.private = path
        except Refused as refused:
            self.refused += 1
            self._say(str(refused))  # agent.sock passed: reports go on there
        except OSError:
            pass
        return self.private

    def _say(self, why: str) -> None:
        if not self.said:
            self.said = True
            say([f"gpuwatch: reports not sent: {why} (docs/security.md, rule 3)"])

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
            if flags & socket.MSG_TRUNC or not _from_daemon(
                    ancillary, source, (path, self.target, self.private, _private_of(path))):
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


def checked_directory(directory: str) -> tuple[str, frozenset[int]]:
    """The runtime directory `directory` as the agent believes it: (its path with links
    resolved, the users whose sockets in it are believed). Refused where another user could
    put a socket in it or replace it; OSError where it is missing or cannot be looked into.

    Looked up from / one component at a time (lstat): a link is followed only where it lies in a
    directory that passed, and the path returned has none, so what it names can be changed by
    those users alone. Every directory above must be owned by root or this user and writable by
    no one else, or sticky; the directory itself writable by neither group nor others, and owned
    by root, this user, or anyone where the directory above it is writable by those alone (who
    put it there: root made /run/gpuwatch in /run and gave it to the daemon's account). The
    rule `gpuwatch status` applies (gpuwatch.runtime_dir.open_daemon_dir)."""
    me = os.geteuid()
    mine = (0, me)
    if not directory.startswith("/"):
        directory = os.path.join(os.getcwd(), directory)
    parts = [p for p in directory.split("/") if p and p != "."]
    walked: list[tuple[str, os.stat_result]] = [("/", os.lstat("/"))]
    links = 0
    while parts:
        name = parts.pop(0)
        if name == "..":
            if len(walked) > 1:
                walked.pop()
            continue
        above, above_st = walked[-1]
        if above_st.st_uid not in mine:
            raise Refused(f"{above} is owned by {user_named(above_st.st_uid)}, who could replace "
                          f"what lies below it ({directory})")
        if above_st.st_mode & _WRITABLE_BY_OTHERS and not above_st.st_mode & stat.S_ISVTX:
            raise Refused(f"{above} is writable by {_whom(above_st)} (mode "
                          f"{stat.S_IMODE(above_st.st_mode):04o}, not sticky): another user "
                          f"could replace what lies below it ({directory})")
        here = os.path.join(above, name)
        st = os.lstat(here)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise Refused(f"{directory}: too many symbolic links")
            target = os.readlink(here)
            parts[:0] = [p for p in target.split("/") if p and p != "."]
            if target.startswith("/"):
                del walked[1:]
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(f"{here} is not a directory")
        walked.append((here, st))
    path, st = walked[-1]
    if st.st_mode & _WRITABLE_BY_OTHERS:
        raise Refused(f"the runtime directory {path} is writable by {_whom(st)} (mode "
                      f"{stat.S_IMODE(st.st_mode):04o}): another user could put a socket "
                      "there and read the reports")
    placed = len(walked) > 1 and not walked[-2][1].st_mode & _WRITABLE_BY_OTHERS
    if st.st_uid not in mine and not placed:
        raise Refused(f"the runtime directory {path} is owned by {user_named(st.st_uid)} in a "
                      "directory any user may create in: not the daemon's")
    return path, frozenset({*mine, st.st_uid})


def check_private_dir(directory: str, trusted: frozenset[int]) -> None:
    """`agent.d` in a checked runtime directory: a directory (never a link) of one of `trusted`,
    writable by neither group nor others; Refused otherwise."""
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{directory} is not a directory")
    if st.st_uid not in trusted:
        raise Refused(f"{directory} is owned by {user_named(st.st_uid)}, not by "
                      f"{users_named(trusted)}")
    if st.st_mode & _WRITABLE_BY_OTHERS:
        raise Refused(f"{directory} is writable by {_whom(st)} (mode "
                      f"{stat.S_IMODE(st.st_mode):04o})")


def check_socket(path: str, trusted: frozenset[int]) -> None:
    """The socket file at `path` (lstat: never a link's target) must be a socket of one of
    `trusted`, the users who may have bound it; Refused otherwise, OSError where missing."""
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode):
        raise Refused(f"{path} is not a socket")
    if st.st_uid not in trusted:
        raise Refused(f"{path} is owned by {user_named(st.st_uid)}, not by {users_named(trusted)}: "
                      "another user's socket would read the reports")


def _whom(st: os.stat_result) -> str:
    return "others" if st.st_mode & stat.S_IWOTH else "its group"


def _private_of(path: str) -> str:
    return os.path.join(os.path.dirname(path), PRIVATE_SOCKET_DIR, f"{os.geteuid()}.sock")


def _from_daemon(ancillary: list[tuple[int, int, bytes]], source: Any,
                 paths: tuple[Optional[str], ...]) -> bool:
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
