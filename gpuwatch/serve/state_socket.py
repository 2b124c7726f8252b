"""The daemon's state socket: `gpuwatch status` asks the running daemon instead of polling.

A Unix stream socket in the runtime directory. The client sends one request line (`status`), the
daemon answers with the status document as JSON and closes. The socket is mode 0660, owned by
root and the `gpuwatch` group: the document names processes, users and command lines. A client
must send its request within 10 s and read the answer within 10 s more; one that does not is
closed and counted (`gpuwatch_connections_total{socket="state"}`), with a debug line, no traceback.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Callable, Optional

from gpuwatch.runtime_dir import FileIdentity, TrustedDir, open_private_dir
from gpuwatch.serve.connections import ConnectionStats
from gpuwatch.serve.listener import (
    REQUEST_TIMEOUT,
    RESPONSE_TIMEOUT,
    Conn,
    Handler,
    Job,
    Listener,
    Outcome,
)

# The client half lives apart so that `gpuwatch status` reads the socket without importing the
# server's (threads, selectors, ssl, prometheus_client); re-exported for the server's users.
from gpuwatch.serve.state_client import STATE_SOCKET_NAME, StateUnavailable, fetch_status

log = logging.getLogger(__name__)

__all__ = ["STATE_SOCKET_NAME", "StateServer", "StateUnavailable", "fetch_status"]

_MAX_REQUEST = 256
#: Its clients are root and the gpuwatch group: fewer than the metrics port's.
_MAX_CONNECTIONS = 64


class _StateHandler(Handler):
    max_request = _MAX_REQUEST
    eof_ends_request = True  # "status" and a half-close, without the newline, is a request too

    def __init__(self, document: Callable[[], Optional[bytes]]) -> None:
        self._document = document

    def request_end(self, buf: bytearray) -> int:
        end = buf.find(b"\n")
        return end + 1 if end >= 0 else -1

    def dispatch(self, request: Optional[bytes], conn: Conn) -> Outcome:
        request = (request or b"")[:_MAX_REQUEST].strip()
        if request != b"status":
            return json.dumps(
                {"error": f"unknown request {request[:40]!r}; known: status"}).encode()
        return Job("render", self._answer)

    def _answer(self) -> bytes:
        body = self._document()
        return body if body is not None else \
            b'{"error": "the daemon has not finished its first poll"}'

    def failure(self) -> bytes:
        return b'{"error": "the daemon failed to render its status; its log says why"}'


class StateServer:
    """The state socket, served by a `Listener`: idle clients and clients that stop reading
    cost no thread and are closed when their time runs out (see listener.py)."""

    def __init__(self, path: Path, document: Callable[[], Optional[bytes]],
                 group: Optional[str] = "gpuwatch", stats: Optional[ConnectionStats] = None,
                 *, directory: Optional[TrustedDir] = None,
                 max_connections: int = _MAX_CONNECTIONS,
                 request_timeout: float = REQUEST_TIMEOUT,
                 response_timeout: float = RESPONSE_TIMEOUT) -> None:
        self.path = path
        self._document = document
        self._group = group
        self.stats = stats if stats is not None else ConnectionStats()
        self._limits = {"max_connections": max_connections, "request_timeout": request_timeout,
                        "response_timeout": response_timeout}
        self._listener: Optional[Listener] = None
        self._inode: Optional[FileIdentity] = None
        #: The runtime directory (checked, held open): handed over by the daemon, or opened at
        #: start() and closed at stop().
        self._given_dir = directory
        self._dir: Optional[TrustedDir] = None

    def start(self) -> None:
        directory = self._given_dir or open_private_dir(self.path.parent)
        name = self.path.name
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # A stale socket from an earlier run: the caller makes sure no live server owns it
            # (the daemon holds the runtime directory's lock).
            directory.unlink(name)
            old_umask = os.umask(0o117)  # created 0660, never briefly world-readable
            try:
                sock.bind(str(directory.path / name))
            finally:
                os.umask(old_umask)
            # The socket bind made, opened without following a link: its identity, and the
            # group given to it, are that file's, not what the path names a moment later.
            with directory.node(name, stat.S_IFSOCK) as made:
                st = os.stat(made)
                self._inode = (st.st_dev, st.st_ino)
                self._restrict_group(made)
            sock.listen(128)
        except BaseException:
            sock.close()
            if directory is not self._given_dir:
                directory.close()
            raise
        self._dir = directory
        self._listener = Listener(sock, "state", _StateHandler(self._document), self.stats,
                                  max_answering=4, **self._limits)
        self._listener.start()

    def _restrict_group(self, made: str) -> None:
        if os.geteuid() != 0 or not self._group:
            return
        try:
            gid = grp.getgrnam(self._group).gr_gid
        except KeyError:
            log.info("group %r does not exist: state socket %s is for root only",
                     self._group, self.path)
            return
        os.chown(made, 0, gid)

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.stop()
            self._listener = None
        # Only the socket this server bound: whoever put another file at the path since owns it.
        inode, self._inode = self._inode, None
        directory, self._dir = self._dir, None
        if directory is not None:
            directory.unlink_if_same(self.path.name, inode)
            if directory is not self._given_dir:
                directory.close()
