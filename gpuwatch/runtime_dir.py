"""The runtime directory: one daemon owns it, and the files in it are that daemon's.

`daemon.lock` is flock-ed by the daemon for its whole life, so a second daemon started on the
same directory (by hand, while the service runs) refuses instead of taking over `state.sock` and
`agent.sock` from the CLI and the agents. `daemon.json` tells the CLI, the demo and tests where
the live daemon serves; each daemon removes only the one it wrote.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Optional

#: Written to the runtime directory so that the CLI, the demo and tests find the live daemon.
DAEMON_INFO_NAME = "daemon.json"
#: flock-ed by the daemon for its whole life: one daemon per runtime directory. Holds its PID.
LOCK_NAME = "daemon.lock"
#: sysexits' EX_TEMPFAIL: another daemon holds the runtime directory. Not 78: systemd restarts on
#: it, so the service gets its directory back once a daemon started by hand there is stopped.
EXIT_ALREADY_RUNNING = 75


#: A file as the kernel names it: (st_dev, st_ino). Whoever created a path records it, so that on
#: the way out it removes its own file and not one another process has put there since.
FileIdentity = tuple[int, int]


def file_identity(path: Path) -> FileIdentity:
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def unlink_if_same(path: Path, identity: Optional[FileIdentity]) -> None:
    """Remove `path` only if it is still the file that had `identity` (a daemon started since
    may have put its own socket there). Callers forget the identity once checked: after the
    unlink its inode number may be given to someone else's file."""
    try:
        current = file_identity(path)
    except OSError:
        return
    if identity is not None and current == identity:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class AlreadyRunning(Exception):
    """Another daemon holds the runtime directory; the message names it, for the user."""


def lock_runtime_dir(runtime_dir: Path) -> int:
    """Take the runtime directory for this process: the descriptor holding its lock.

    flock rather than a PID file alone: the kernel releases the lock however its holder dies
    (SIGKILL, the OOM killer, a crash), so a dead daemon never blocks the next one. The PID
    written into the file is only read to name the holder in the refusal.
    """
    path = runtime_dir / LOCK_NAME
    try:
        # O_NOFOLLOW: the file is truncated and written; a link planted there must not redirect it.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if isinstance(exc, PermissionError):
            refuse_if_held(path, runtime_dir)
        raise OSError(f"daemon.runtime_dir {runtime_dir}: cannot create the lock file {path}: "
                      f"{exc.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AlreadyRunning(_held_by(path, runtime_dir)) from None
        # The file mode, whatever the umask (the unit's is 0077): any user who runs a second
        # daemon by mistake is told which PID holds the directory.
        with contextlib.suppress(PermissionError):
            os.fchmod(fd, 0o644)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise OSError(f"daemon.runtime_dir {runtime_dir}: cannot lock {path}: "
                      f"{exc.strerror}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def refuse_if_held(path: Path, runtime_dir: Path) -> None:
    """Raise AlreadyRunning if a daemon holds `path`, which this user may not write: the
    service's directory seen by someone else deserves "already running", not "permission denied".
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        # A shared lock is enough to learn whether an exclusive one is held.
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise AlreadyRunning(_held_by(path, runtime_dir)) from None
    except OSError:
        return
    finally:
        os.close(fd)


def _held_by(path: Path, runtime_dir: Path) -> str:
    """The refusal for a second daemon, naming the one that holds the lock at `path`."""
    # The holder writes its PID just after taking the lock: give it that moment.
    deadline = time.monotonic() + 1.0
    pid = _pid_in(path)
    while pid is None and time.monotonic() < deadline:
        time.sleep(0.01)
        pid = _pid_in(path)
    serving = ""
    try:
        info = json.loads((runtime_dir / DAEMON_INFO_NAME).read_text())
    except (OSError, ValueError):
        info = None
    # daemon.json may be a dead daemon's, or not written yet: only the holder's own is quoted.
    if isinstance(info, dict) and pid is not None and info.get("pid") == pid \
            and isinstance(info.get("metrics_url"), str):
        serving = f", serving {info['metrics_url']}"
    holder = f"PID {pid}" if pid is not None else "PID unknown"
    return (f"another gpuwatch daemon ({holder}{serving}) already runs on the runtime directory "
            f"{runtime_dir}: stop it, or pass another --runtime-dir")


def _pid_in(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def remove_own_daemon_info(path: Path) -> None:
    """Remove daemon.json only if this process wrote it (the PID inside says so)."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if isinstance(info, dict) and info.get("pid") == os.getpid():
        path.unlink(missing_ok=True)
