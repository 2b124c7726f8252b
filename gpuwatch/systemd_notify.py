"""sd_notify(3) without libsystemd: readiness, status, reload, stop and watchdog pings.

systemd passes the address of its notification socket in ``$NOTIFY_SOCKET``: a file-system path,
or a name in the abstract namespace written with a leading ``@``. Each message is one datagram of
newline-separated ``KEY=VALUE`` assignments.

Outside systemd (``$NOTIFY_SOCKET`` unset) every function returns False and does nothing. No
function raises: a notification that cannot be delivered is logged at debug level and reported
as False, because monitoring must go on whatever happens to its supervisor.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping

__all__ = [
    "notify",
    "ready",
    "reloading",
    "status",
    "stopping",
    "watchdog_interval",
    "watchdog_ping",
]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_sock: socket.socket | None = None
_sock_pid: int | None = None


def _reset_after_fork() -> None:
    # A fork taken while another thread held the lock would leave the child's copy locked for
    # ever; the child also must not send through (or close) a descriptor its parent still uses.
    global _lock, _sock, _sock_pid
    _lock = threading.Lock()
    _sock = None
    _sock_pid = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _socket() -> socket.socket:
    global _sock, _sock_pid
    pid = os.getpid()
    with _lock:
        # The pid check covers forks that bypass the at-fork hook (a raw fork(2) from C code).
        if _sock is None or _sock_pid != pid:
            _sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            _sock_pid = pid
        return _sock


def _address(value: str) -> bytes | None:
    if value.startswith("@"):
        return b"\0" + os.fsencode(value[1:])
    if value.startswith("/"):
        return os.fsencode(value)
    return None  # vsock: and other transports of newer systemd versions are not for a host daemon


def notify(message: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """Send `message` to the service manager; True once the datagram was handed to the kernel."""
    env = os.environ if environ is None else environ
    target = env.get("NOTIFY_SOCKET")
    if not target:
        return False
    try:
        address = _address(target)
        if address is None:
            log.debug("NOTIFY_SOCKET=%r is neither a path nor an abstract name; not notifying",
                      target)
            return False
        # Never wait on PID 1: a full notification queue costs one message, not a stalled poll.
        flags = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
        _socket().sendto(message.encode("utf-8"), flags, address)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte inside a path
        log.debug("sd_notify to %r failed: %s", target, exc)
        return False
    return True


def _one_line(text: str) -> str:
    # A newline would start a new assignment: a status text must not be able to send READY=1.
    return " ".join(text.splitlines())


def ready(status: str | None = None) -> bool:
    """Start-up (or a reload) is complete; systemd moves the unit to 'active'."""
    message = "READY=1"
    if status is not None:
        message += "\nSTATUS=" + _one_line(status)
    return notify(message)


def stopping() -> bool:
    """Shutdown has begun; systemd stops expecting watchdog pings and waits for the exit."""
    return notify("STOPPING=1")


def _monotonic_usec() -> int:
    if hasattr(time, "clock_gettime_ns") and hasattr(time, "CLOCK_MONOTONIC"):
        return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return time.monotonic_ns() // 1000


def reloading() -> bool:
    """A configuration reload has begun; ready() ends it.

    MONOTONIC_USEC lets systemd 253+ match this message to the reload it requested; older
    versions ignore the field.
    """
    return notify(f"RELOADING=1\nMONOTONIC_USEC={_monotonic_usec()}")


def status(text: str) -> bool:
    """The one-line status `systemctl status` shows."""
    return notify("STATUS=" + _one_line(text))


def watchdog_ping() -> bool:
    """Tell systemd the main loop is alive (WatchdogSec=)."""
    return notify("WATCHDOG=1")


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between watchdog pings: half of $WATCHDOG_USEC, as sd_watchdog_enabled(3) advises.

    None when no watchdog is armed, or when $WATCHDOG_PID names another process (the variables
    were inherited from a parent that systemd watches, not meant for us).
    """
    env = os.environ if environ is None else environ
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid_text = env.get("WATCHDOG_PID")
    if pid_text:
        try:
            if int(pid_text) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 2 / 1_000_000
