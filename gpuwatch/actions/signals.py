"""The one way gpuwatch signals a process: by identity, checked right before every signal.

A process is named by its PID and its start time (`ProcessRef`): a PID is reused as soon as the
kernel likes, and signalling a PID that now belongs to someone else's process is the one mistake a
reaper must never make. Every signal goes through `send`, which opens a pidfd first (Linux 5.3+),
checks the start time through /proc, and signals through the pidfd: the check and the signal then
name the same process even if it exits in between and its PID is handed out again. Without pidfds
it checks right before kill(), the best there is.

`terminate_all` is the whole ending of a batch: SIGTERM to every process first, one grace period
for all of them, SIGKILL to those left, and a wait; it reports each process's ending the moment it
is known. `reap`, the daemon's auto-reap and `gpuwatch top` end processes through it; the `run`
supervisor signals through `send`.

A ref may carry a veto (`ProcessRef.veto`: the reaper's check that the process is no service's,
nor the daemon's): asked after the identity check, right before each signal, with the pidfd held;
a reason from it stops the signal (`Vetoed`), and `terminate_all` ends that process's turn as
`VETOED`, nothing more sent.

Whether a process may signal other users' processes at all is the kernel's rule, asked of
/proc/self/status (`may_signal_other_users`): CAP_KILL in the effective set, not uid 0.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from gpuwatch.sources.processes import ProcessSource
from gpuwatch.vocabulary import ProcState, ReapOutcome

#: How long a SIGKILLed process may take to be gone before it counts as surviving it.
SETTLE = 5.0
#: How long after a signal `terminate_all` says which processes are still there: a process that
#: ends on its signal at once is known by its ending, every other one by then (a reaper records
#: either). None: the first look after the signal, so that the record of a signal never waits.
WAITING = 0.0
_TICK = 0.05

#: What a process named by a ProcessRef is now.
SAME = "same"  # running (or stopped, sleeping...) as it was
ZOMBIE = ProcState.ZOMBIE  # exited; its parent has yet to collect it
GONE = "gone"  # no such PID
OTHER = "other"  # the PID belongs to another process now
#: The result of a signal its ref's veto stopped (Ending.result).
VETOED = "vetoed"
#: The endings after which the process is no longer there (Ending.ended).
ENDED = frozenset({ReapOutcome.EXITED, ReapOutcome.KILLED, ReapOutcome.GONE})

#: capabilities(7): the one that lets a process signal processes of any user.
CAP_KILL = 5


def may_signal_other_users(status: Path = Path("/proc/self/status")) -> bool:
    """Whether this process holds CAP_KILL in its effective set: what kill(2) checks before it
    lets a process signal another user's. Root without it (a container's bounded root) may not;
    an account given it (the systemd unit's `gpuwatch`) may. Unreadable: no."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_KILL & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


@dataclass(frozen=True)
class ProcessRef:
    """A process, not just a PID: `start_time` as gpuwatch reads it (seconds since the epoch,
    ProcessSource.stat), None only where it could not be read (then no reuse check is made)."""

    pid: int
    start_time: Optional[float]
    #: Asked with the PID right before each signal, once the identity is checked: a reason in
    #: words means the process must not be signalled (send raises Vetoed), None that it may.
    veto: Optional[Callable[[int], Optional[str]]] = field(default=None, compare=False,
                                                           repr=False)


class Vetoed(Exception):
    """A signal that its ref's veto stopped: nothing was sent. The message is the reason."""


@dataclass(frozen=True)
class Ending:
    """How `terminate` ended (or failed to end) a process."""

    #: "exited" (on SIGTERM, or already), "killed" (needed SIGKILL), "gone" (before any signal,
    #: or after SIGTERM with its PID now another process's), "identity-changed" (the PID was
    #: reused before the first signal: nothing sent), "unkillable" (in D state after SIGKILL),
    #: "still-running", "failed" (no permission), VETOED (its ref's veto stopped a signal: the
    #: SIGTERM, nothing sent; or the SIGKILL after a SIGTERM)
    result: str
    detail: str
    #: The signals actually sent, in order: ("SIGTERM",), ("SIGTERM", "SIGKILL"), ...
    sent: tuple[str, ...] = ()
    #: When each of `sent` was sent (seconds since the epoch).
    sent_at: tuple[float, ...] = ()

    @property
    def ended(self) -> bool:
        return self.result in ENDED


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
        return ZOMBIE if stat.state in (ProcState.ZOMBIE, ProcState.DEAD) else SAME

    def send(self, ref: ProcessRef, signum: int) -> str:
        """Send `signum` to the process if it is still `ref`: returns SAME (sent), ZOMBIE (sent to
        an exited process: harmless), GONE or OTHER (nothing sent). Raises Vetoed (nothing sent)
        when the ref's veto gives a reason, asked after the identity check with the pidfd held.
        PermissionError passes."""
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
            if ref.veto is not None:
                why = ref.veto(ref.pid)
                if why is not None:
                    raise Vetoed(why)
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
        return self.terminate_all([ref], grace)[0]

    def terminate_all(self, refs: Sequence[ProcessRef], grace: float,
                      on_end: Optional[Callable[[int, Ending], None]] = None,
                      on_waiting: Optional[Callable[[int, Ending], None]] = None
                      ) -> list[Ending]:
        """End every process of `refs` together: SIGTERM to each first, then one grace period of
        `grace` seconds for all of them, then SIGKILL to those still there and up to SETTLE more.
        A process that ignores SIGTERM delays no other's.

        `on_end(index, ending)` is called the moment each one's ending is known, and
        `on_waiting(index, so_far)` (result "waiting", the signals sent so far) for each one
        still there WAITING seconds after a signal: every signal is then known to its caller
        within WAITING seconds of being sent, from its ending or from this call. Both are called
        from this thread. Returns the endings in the order of `refs`."""
        endings: list[Optional[Ending]] = [None] * len(refs)

        def end(i: int, ending: Ending) -> None:
            endings[i] = ending
            if on_end is not None:
                on_end(i, ending)

        term_at: dict[int, float] = {}
        for i, ref in enumerate(refs):
            now = self.state(ref)
            if now == GONE:
                end(i, Ending(ReapOutcome.GONE, "already gone"))
            elif now == OTHER:
                end(i, Ending(ReapOutcome.IDENTITY_CHANGED,
                              "the PID now belongs to another process: nothing sent"))
            elif now == ZOMBIE:
                end(i, Ending(ReapOutcome.EXITED,
                              "already exited (its parent has yet to collect it)"))
            else:
                try:
                    sent = self.send(ref, signal.SIGTERM)
                except PermissionError:
                    end(i, Ending(ReapOutcome.FAILED, "no permission to signal it"))
                    continue
                except Vetoed as why:
                    end(i, Ending(VETOED, f"{why}: nothing sent"))
                    continue
                if sent == GONE:
                    end(i, Ending(ReapOutcome.GONE, "exited before the signal"))
                elif sent == OTHER:
                    end(i, Ending(ReapOutcome.GONE, "exited before the signal; its PID now "
                                                    "belongs to another process: nothing sent"))
                else:
                    term_at[i] = time.time()

        def after_sigterm(i: int, now: str) -> Ending:
            if now == OTHER:
                # Ended between two looks, and the PID went to a new process: what ended it
                # (the SIGTERM, or something else) cannot be told; the newcomer gets nothing.
                return Ending(ReapOutcome.GONE, "gone after SIGTERM; its PID now belongs to "
                                                "another process, which is not signalled",
                              ("SIGTERM",), (term_at[i],))
            return Ending(ReapOutcome.EXITED, "ended on SIGTERM", ("SIGTERM",), (term_at[i],))

        def waiting_after_sigterm(i: int) -> Ending:
            return Ending(ReapOutcome.WAITING, f"SIGTERM sent; SIGKILL if it is still there "
                                               f"after {grace:g} s", ("SIGTERM",), (term_at[i],))

        waiting = self._wait_all(refs, list(term_at), grace, lambda i, now: end(
            i, after_sigterm(i, now)), on_waiting and (lambda i: on_waiting(
                i, waiting_after_sigterm(i))))

        kill_at: dict[int, float] = {}
        for i in waiting:
            try:
                sent = self.send(refs[i], signal.SIGKILL)
            except PermissionError:
                end(i, Ending(ReapOutcome.FAILED, "no permission to send SIGKILL", ("SIGTERM",),
                              (term_at[i],)))
                continue
            except Vetoed as why:
                end(i, Ending(VETOED, f"{why}: SIGTERM sent, SIGKILL not", ("SIGTERM",),
                              (term_at[i],)))
                continue
            if sent in (GONE, OTHER):
                end(i, after_sigterm(i, sent))
            else:
                kill_at[i] = time.time()

        def killed(i: int, result: str, detail: str) -> Ending:
            return Ending(result, detail, ("SIGTERM", "SIGKILL"), (term_at[i], kill_at[i]))

        waiting = self._wait_all(
            refs, list(kill_at), SETTLE, lambda i, now: end(i, killed(
                i, ReapOutcome.KILLED, f"ignored SIGTERM for {grace:g} s; ended on SIGKILL")),
            on_waiting and (lambda i: on_waiting(i, killed(
                i, ReapOutcome.WAITING,
                f"SIGKILL sent after {grace:g} s; waiting up to {SETTLE:g} s"))))
        for i in waiting:
            stat = self._procs.stat(refs[i].pid)
            if stat is not None and stat.state == ProcState.DISK_SLEEP:
                end(i, killed(i, ReapOutcome.UNKILLABLE, "in uninterruptible sleep after SIGKILL"))
            else:
                end(i, killed(i, ReapOutcome.STILL_RUNNING, "still there after SIGKILL"))
        assert all(e is not None for e in endings)
        return [e for e in endings if e is not None]

    def _wait_all(self, refs: Sequence[ProcessRef], indexes: list[int], timeout: float,
                  ended: Callable[[int, str], None],
                  still_there: Optional[Callable[[int], None]]) -> list[int]:
        """Look at the processes `indexes` of `refs` every tick for up to `timeout` seconds:
        `ended(index, state)` for each as it ends, `still_there(index)` once for each still
        there after WAITING seconds. The indexes of those left at the end."""
        waiting = list(indexes)
        started = time.monotonic()
        told = False
        while waiting:
            for i in list(waiting):
                now = self.state(refs[i])
                if now != SAME:
                    waiting.remove(i)
                    ended(i, now)
            elapsed = time.monotonic() - started
            if still_there is not None and not told and waiting and elapsed >= min(WAITING,
                                                                                   timeout):
                told = True
                for i in waiting:
                    still_there(i)
            if not waiting or elapsed >= timeout:
                break
            time.sleep(min(_TICK, max(0.0, timeout - elapsed)))
        return waiting
