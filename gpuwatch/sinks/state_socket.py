"""The daemon's state socket: `gpuwatch status` asks the running daemon instead of polling.

A Unix stream socket in the runtime directory. The client sends one request line (`status`), the
daemon answers with the status document as JSON and closes. The socket is mode 0660, owned by
root and the `gpuwatch` group: the document names processes, users and command lines.
"""

from __future__ import annotations

import contextlib
import grp
import json
import logging
import os
import socket
import socketserver
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from gpuwatch.runtime_dir import FileIdentity, file_identity, unlink_if_same

log = logging.getLogger(__name__)

STATE_SOCKET_NAME = "state.sock"
_MAX_REQUEST = 256
_MAX_RESPONSE = 64 << 20


class StateServer:
    def __init__(self, path: Path, document: Callable[[], Optional[bytes]],
                 group: Optional[str] = "gpuwatch") -> None:
        self.path = path
        self._document = document
        self._group = group
        self._server: Optional[socketserver.ThreadingUnixStreamServer] = None
        self._thread: Optional[threading.Thread] = None
        self._inode: Optional[FileIdentity] = None

    def start(self) -> None:
        # A stale socket from a previous run: the caller makes sure no live server owns it (the
        # daemon holds the runtime directory's lock).
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        document = self._document

        class Handler(socketserver.StreamRequestHandler):
            timeout = 5

            def handle(self) -> None:
                try:
                    request = self.rfile.readline(_MAX_REQUEST).strip()
                except OSError:
                    return
                if request != b"status":
                    self.wfile.write(json.dumps(
                        {"error": f"unknown request {request[:40]!r}; known: status"}).encode())
                    return
                body = document()
                self.wfile.write(body if body is not None else
                                 b'{"error": "the daemon has not finished its first poll"}')

        old_umask = os.umask(0o117)  # created 0660, never briefly world-readable
        try:
            server = socketserver.ThreadingUnixStreamServer(str(self.path), Handler)
        finally:
            os.umask(old_umask)
        try:
            self._inode = file_identity(self.path)
        except BaseException:
            server.server_close()
            raise
        server.daemon_threads = True
        self._restrict_group()
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="state-socket",
                                        daemon=True)
        self._thread.start()

    def _restrict_group(self) -> None:
        if os.geteuid() != 0 or not self._group:
            return
        try:
            gid = grp.getgrnam(self._group).gr_gid
        except KeyError:
            log.info("group %r does not exist: state socket %s is for root only",
                     self._group, self.path)
            return
        os.chown(self.path, 0, gid)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        # Only the socket this server bound: whoever put another file at the path since owns it.
        inode, self._inode = self._inode, None
        unlink_if_same(self.path, inode)


class StateUnavailable(Exception):
    """No daemon answered at the state socket; the message says why, for the user."""


def fetch_status(path: Path, timeout: float = 3.0) -> dict[str, Any]:
    """Ask the daemon at `path` for its status document."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(path))
            s.sendall(b"status\n")
            chunks = []
            size = 0
            while True:
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                size += len(chunk)
                if size > _MAX_RESPONSE:
                    raise StateUnavailable(f"{path}: answer larger than {_MAX_RESPONSE} bytes")
                chunks.append(chunk)
    except FileNotFoundError:
        raise StateUnavailable(f"no daemon socket at {path}") from None
    except PermissionError:
        raise StateUnavailable(
            f"no permission on {path} (root or the gpuwatch group may read it)") from None
    except OSError as exc:
        raise StateUnavailable(f"{path}: {exc.strerror or exc}") from None
    try:
        doc = json.loads(b"".join(chunks))
    except ValueError:
        raise StateUnavailable(f"{path}: the answer is not JSON") from None
    if not isinstance(doc, dict) or "error" in doc:
        raise StateUnavailable(f"{path}: {doc.get('error') if isinstance(doc, dict) else doc}")
    return doc
