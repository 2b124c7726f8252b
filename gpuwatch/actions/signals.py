"""The one way gpuwatch signals a process: by identity, checked right before every signal.

A process is named by its PID and its start time (`ProcessRef`): a PID is reused as soon as the
kernel likes, and signalling a PID that now belongs to someone else's process is the one mistake a
reaper must never make. Every signal goes through `send`, which opens a pidfd first (Linux 5.3+),
checks the start time through /proc, and signals through the pidfd: the check and the signal then
name the same process even if it exits in between and its PID is handed out again. Without pidfds
it checks right before kill(), the best there is.

`terminate` is the whole ending: SIGTERM, a grace period, SIGKILL, and a wait. `reap`, the
daemon's auto-reap and the `run` supervisor all end processes through it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

from gpuwatch.sources.processes import ProcessSource

#: How long a SIGKILLed process may take to be gone before it counts as surviving it.
SETTLE = 5.0
_TICK = 0.05

#: What a process named by a ProcessRef is now.
SAME = "same"  # running (or stopped, sleeping...) as it was
ZOMBIE = "zombie"  # exited; its parent has yet to collect it
GONE = "gone"  # no such PID
OTHER = "other"  # the PID belongs to another process now


@dataclass(frozen=True)
class ProcessRef:
    """A process, not just a PID: `start_time` as gpuwatch reads it (seconds since the epoch,
    ProcessSource.stat), None only where it could not be read (then no reuse check is made)."""

    pid: int
    start_time: Optional[float]


@dataclass(frozen=True)
class Ending:
    """How `terminate` ended (or failed to end) a process."""

    #: "exited" (on SIGTERM, or already), "killed" (needed SIGKILL), "gone" (before any signal),
    #: "identity-changed" (the PID was reused: nothing sent), "unkillable" (in D state after
    #: SIGKILL), "still-running", "failed" (no permission)
    result: str
    detail: str
    #: The signals actually sent, in order: ("SIGTERM",), ("SIGTERM", "SIGKILL"), ...
    sent: tuple[str, ...] = ()

    @property
    def ended(self) -> bool:
        return self.result in ("exited", "killed", "gone")


class Signaller:
    """Sends signals to processes by identity. One per caller; it reads /proc, nothing else."""

    def __init__(self, procs: Optional[ProcessSource] = None) -> None:
        self._procs = procs or ProcessSource()

    def ref(self, pid: int) -> Optional[ProcessRef]:
        """The process on `pid` now, or None where there is none."""
        stat = self._procs.stat(pid)
        return ProcessRef(pid, stat.start_time) if stat is not None else None

    def state(self, ref: ProcessRef) -> str:
        stat = self._procs.stat(ref.pid)
        if stat is None:
            return GONE
        if ref.start_time is not None and stat.start_time != ref.start_time:
            return OTHER
        return ZOMBIE if stat.state in ("zombie", "dead") else SAME

    def send(self, ref: ProcessRef, signum: int) -> str:
        """Send `signum` to the process if it is still `ref`: returns SAME (sent), ZOMBIE (sent to
        an exited process: harmless), GONE or OTHER (nothing sent). PermissionError passes."""
        fd: Optional[int] = None
        try:
            fd = os.pidfd_open(ref.pid)
        except ProcessLookupError:
            return GONE
        except (AttributeError, OSError):
            pass  # no pidfds here: the check right before kill() below is the best there is
        try:
            now = self.state(ref)
            if now in (GONE, OTHER):
                return now
            if fd is not None:
                signal.pidfd_send_signal(fd, signum)
            else:
                os.kill(ref.pid, signum)
            return now
        except ProcessLookupError:
            return GONE
        finally:
            if fd is not None:
                os.close(fd)

    def ended(self, ref: ProcessRef) -> bool:
        return self.state(ref) != SAME

    def wait_ended(self, ref: ProcessRef, timeout: float) -> bool:
        """Whether the process exited (or its PID went to another) within `timeout`."""
        deadline = time.monotonic() + timeout
        while not self.ended(ref):
            if time.monotonic() >= deadline:
                return False
            time.sleep(_TICK)
        return True

    def wait_collected(self, ref: ProcessRef, timeout: float) -> bool:
        """Whether the process is gone for good within `timeout`: exited and collected by its
        parent, not only exited (a zombie)."""
        deadline = time.monotonic() + timeout
        while self.state(ref) in (SAME, ZOMBIE):
            if time.monotonic() >= deadline:
                return False
            time.sleep(_TICK)
        return True

    def terminate(self, ref: ProcessRef, grace: float) -> Ending:
        """SIGTERM, up to `grace` seconds for it to exit, then SIGKILL and up to SETTLE more."""
        now = self.state(ref)
        if now == GONE:
            return Ending("gone", "already gone")
        if now == OTHER:
            return Ending("identity-changed", "the PID now belongs to another process: "
                                              "nothing sent")
        if now == ZOMBIE:
            return Ending("exited", "already exited (its parent has yet to collect it)")
        try:
            if self.send(ref, signal.SIGTERM) in (GONE, OTHER):
                return Ending("gone", "exited before the signal")
            if self.wait_ended(ref, grace):
                return Ending("exited", "ended on SIGTERM", ("SIGTERM",))
            sent = self.send(ref, signal.SIGKILL)
        except PermissionError:
            return Ending("failed", "no permission to signal it")
        if sent == OTHER:
            return Ending("identity-changed", "the PID was reused before SIGKILL: not sent",
                          ("SIGTERM",))
        if sent == GONE:
            return Ending("exited", "ended on SIGTERM", ("SIGTERM",))
        if self.wait_ended(ref, SETTLE):
            return Ending("killed", f"ignored SIGTERM for {grace:g} s; ended on SIGKILL",
                          ("SIGTERM", "SIGKILL"))
        stat = self._procs.stat(ref.pid)
        if stat is not None and stat.state == "disk-sleep":
            return Ending("unkillable", "in uninterruptible sleep after SIGKILL",
                          ("SIGTERM", "SIGKILL"))
        return Ending("still-running", "still there after SIGKILL", ("SIGTERM", "SIGKILL"))
