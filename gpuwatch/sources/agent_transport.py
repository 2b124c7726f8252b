"""The agent receiver's transport: agent.sock and the users' own sockets, and the thread that
receives on them (gpuwatch.sources.agent_socket says why datagrams and SCM_CREDENTIALS).

Each datagram is handed, with the sender's PID and UID as the kernel gives them and its address,
to `handle`; one without credentials, or one whose handling raised, is counted (`count`) and the
loop goes on: the receiving thread never dies of a datagram. Descriptors a sender passes along
are closed at once.

The socket is bound at its final path, not under a temporary name renamed into place: a Unix
socket keeps the name it was bound under, and that name is the source address of every request
the daemon sends from it, which agents accept only when it is the path they report to. A stale
socket from an earlier run is unlinked first, and the file is chmod-ed to 0666 right after bind;
for that instant a sender of another user may see ENOENT or EACCES, as it would while the daemon
restarts. The process umask, shared with every other thread, is never touched. Every name in the
runtime directory is looked up through its descriptor (gpuwatch.runtime_dir.TrustedDir: checked
to be writable by root and the daemon's user alone), and the chmod, chown and ACL go to the file
bind made, opened O_NOFOLLOW, never to a path followed again.

A user's first datagram on agent.sock makes `agent.d/<uid>.sock`, mode 0600 with a POSIX ACL
that lets only that user send to it, so that its kernel queue is that user's alone (at most
MAX_PRIVATE_SOCKETS; without ACL support every user shares agent.sock). The sockets are served
in turn, RECEIVE_BATCH datagrams of each ready one at a time.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from gpuwatch.protocol import MAX_DATAGRAM, PRIVATE_SOCKET_DIR
from gpuwatch.runtime_dir import FileIdentity, TrustedDir, UnsafeDirectory, open_private_dir
from gpuwatch.threads import start_without_signals

log = logging.getLogger("gpuwatch.sources.agent_socket")

#: Users given a socket of their own, at most; any further user shares agent.sock.
MAX_PRIVATE_SOCKETS = 64
#: Datagrams read from one socket before the next ready one is served: the sockets are drained
#: in turn, so a user flooding its own socket delays the others' by at most this many reports.
RECEIVE_BATCH = 32

_UCRED = struct.Struct("iII")  # pid_t, uid_t, gid_t: the size of "3i", unsigned ids
_ANCILLARY_SIZE = socket.CMSG_SPACE(struct.calcsize("3i"))
# A kernel-side receive timeout, so the thread sees its stop flag even if the shutdown() that
# stop() wakes it with is missed; unlike settimeout() it adds no poll() syscall before every
# receive. Long: each wake-up of an idle daemon takes the interpreter's lock from its poll.
_RECEIVE_TIMEOUT = struct.pack("ll", 2, 0)
_POLL_TIMEOUT_MS = 2000
_ACL_XATTR = "system.posix_acl_access"
_ACL_UNDEFINED_ID = 0xFFFFFFFF

#: handle(payload, pid, uid, truncated, address, via=socket)
Handler = Callable[..., None]


class AgentTransport:
    """agent.sock and the users' own sockets, received on in a daemon thread."""

    def __init__(self, path: Path, handle: Handler, count: Callable[[str], None]) -> None:
        self.path = Path(path)
        self._handle = handle
        self._count = count
        self._sock: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._inode: Optional[FileIdentity] = None
        #: uid -> its own socket, and each one's file (to remove only our own at stop).
        self._private: dict[int, socket.socket] = {}
        self._private_files: list[tuple[str, Optional[FileIdentity]]] = []
        #: The runtime directory, while receiving; whether it is ours to close (opened here,
        #: not handed over by the daemon).
        self._dir: Optional[TrustedDir] = None
        self._own_dir = False
        #: False once the file system refused an ACL: every user shares agent.sock.
        self._private_supported = True

    @property
    def sock(self) -> Optional[socket.socket]:
        """agent.sock's socket while receiving, else None."""
        return self._sock

    def start(self, directory: Optional[TrustedDir] = None) -> None:
        if self._thread is not None:
            raise RuntimeError("the agent receiver is already running")
        own = directory is None
        if directory is None:
            directory = open_private_dir(self.path.parent)
        name = self.path.name
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
            directory.unlink(name)
            sock.bind(str(directory.path / name))
            try:
                # The socket bind made, opened without following a link: not what a path
                # names a moment later.
                with directory.node(name, stat.S_IFSOCK) as made:
                    os.chmod(made, 0o666)
                    identity = _identity_of(made)
            except BaseException:
                directory.unlink(name)
                raise
        except BaseException:
            sock.close()
            if own:
                directory.close()
            raise
        self._dir, self._own_dir = directory, own
        self._inode = identity
        self._sock = sock
        self._stopping.clear()
        self._thread = threading.Thread(target=self._receive_loop, args=(sock,),
                                        name="agent-socket", daemon=True)
        start_without_signals(self._thread)

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
        # Only our own sockets: a daemon started since may have put its own at these paths.
        inode, self._inode = self._inode, None
        directory, own, self._dir = self._dir, self._own_dir, None
        if directory is not None and self._private_files:
            with contextlib.suppress(OSError, UnsafeDirectory), \
                    directory.subdir(PRIVATE_SOCKET_DIR) as private:
                for name, identity in self._private_files:
                    private.unlink_if_same(name, identity)
        self._private_files.clear()
        if directory is not None:
            directory.unlink_if_same(self.path.name, inode)
            if own:
                directory.close()

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
        handle = self._handle
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
        if self._dir is None:
            return None
        name = f"{uid}.sock"
        path = self._dir.path / PRIVATE_SOCKET_DIR / name
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        directory: Optional[TrustedDir] = None
        try:
            # Made, or found, in the checked runtime directory: a directory of this user's
            # (never a link), given 0755 through its own descriptor.
            directory = self._dir.subdir(PRIVATE_SOCKET_DIR, 0o755)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            directory.unlink(name)  # a stale one from an earlier run
            sock.bind(str(path))
            with directory.node(name, stat.S_IFSOCK) as made:
                identity = _identity_of(made)
                os.chmod(made, 0o600)
                if uid not in (0, os.geteuid()):
                    os.setxattr(made, _ACL_XATTR, _acl_granting(uid))
        except (OSError, UnsafeDirectory) as exc:
            sock.close()
            if directory is not None:
                with contextlib.suppress(OSError):
                    directory.unlink(name)
            if isinstance(exc, UnsafeDirectory):
                self._private_supported = False
                log.warning("agent socket: no socket of their own for users: %s; all share %s",
                            exc, self.path)
            elif exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.EACCES,
                               errno.EROFS):
                self._private_supported = False
                log.info("agent socket: no socket of their own for users (%s: %s); all "
                         "share %s", path, exc.strerror, self.path)
            else:
                log.warning("agent socket: cannot make %s: %s", path, exc.strerror)
            return None
        finally:
            if directory is not None:
                directory.close()
        self._private[uid] = sock
        self._private_files.append((name, identity))
        return sock


def _identity_of(path: str) -> FileIdentity:
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def _acl_granting(uid: int) -> bytes:
    """A POSIX access ACL (the kernel's xattr form, as setfacl writes it) giving the owner and
    `uid` read and write, and nobody else anything: `user::rw-,user:<uid>:rw-,group::---,
    mask::rw-,other::---`."""
    entries = ((0x01, 6, _ACL_UNDEFINED_ID), (0x02, 6, uid), (0x04, 0, _ACL_UNDEFINED_ID),
               (0x10, 6, _ACL_UNDEFINED_ID), (0x20, 0, _ACL_UNDEFINED_ID))
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


def _close_passed_fds(cdata: bytes) -> None:
    # Descriptors a sender passed along (SCM_RIGHTS) would otherwise leak into the daemon.
    count = len(cdata) // 4
    for fd in struct.unpack(f"{count}i", cdata[:count * 4]):
        with contextlib.suppress(OSError):
            os.close(fd)
