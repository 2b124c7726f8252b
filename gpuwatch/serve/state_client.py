"""The client half of the daemon's state socket (gpuwatch.serve.state_socket): one request line,
the status document back as JSON.

`gpuwatch status` with a daemon running is this and a render, so it imports only the standard
library's socket and json, and gpuwatch.runtime_dir.

The answer is believed only from the daemon: the runtime directory must be one no other user can
write (gpuwatch.runtime_dir.open_daemon_dir), and the process listening, as the kernel names it
(SO_PEERCRED), must run as root, as this user or as the directory's owner. Anyone else's
`state.sock` (a directory under /tmp another user made, a socket they serve) could name any
process as an orphan for `gpuwatch reap` to kill: it is refused, and the callers poll instead.
"""

from __future__ import annotations

import json
import socket
import struct
from pathlib import Path
from typing import Any, Optional

from gpuwatch.runtime_dir import daemon_peer_refusal

STATE_SOCKET_NAME = "state.sock"
#: The most of an answer read: four times what the daemon serves at most (document.py's
#: MAX_DOCUMENT_BYTES, 8 MiB; room for a daemon of another version), so that whatever answers
#: at the socket cannot make `status`, `reap` or an epilog hold more.
MAX_RESPONSE = 32 << 20


class StateUnavailable(Exception):
    """No daemon answered at the state socket; the message says why, for the user."""


def fetch_status(path: Path, timeout: float = 3.0) -> dict[str, Any]:
    """Ask the daemon at `path` for its status document."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(path))
            refusal = _peer_refusal(s, path)
            if refusal is not None:
                raise _Refused(refusal)
            s.sendall(b"status\n")
            chunks = []
            size = 0
            while True:
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_RESPONSE:
                    raise StateUnavailable(f"{path}: answer larger than {MAX_RESPONSE} bytes")
                chunks.append(chunk)
    except _Refused as refused:
        raise StateUnavailable(f"{path}: {refused}") from None
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


class _Refused(Exception):
    pass


def _peer_refusal(s: socket.socket, path: Path) -> Optional[str]:
    """Why the process listening at `path` is not believed to be the daemon (None: it is)."""
    creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    _, uid, _ = _UCRED.unpack(creds)
    return daemon_peer_refusal(path.parent, uid)


_UCRED = struct.Struct("iII")  # pid_t, uid_t, gid_t
