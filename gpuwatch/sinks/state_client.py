"""The client half of the daemon's state socket (gpuwatch.sinks.state_socket): one request line,
the status document back as JSON.

`gpuwatch status` with a daemon running is this and a render, so it imports only the standard
library's socket and json.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

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
