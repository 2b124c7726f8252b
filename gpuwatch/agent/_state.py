"""The agent's state: its settings, the per-process state a forked child must not inherit, and
the lock that reports and chores take. Every other module of the agent reads these as
`_state.<name>` at each use, never a copy: configure() rebinds the settings, and a forked child
gets a lock of its own.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable, Optional

from gpuwatch.agent._transport import Transport

DEFAULT_MIN_INTERVAL = 0.05
_OFF = frozenset({"0", "false", "no", "off"})


class _State:
    """Everything a forked child must not inherit; reset() gives the child its own."""

    __slots__ = ("chores_due", "discovered", "due", "finished", "last", "next_request",
                 "next_scan", "scanned_at", "scanner", "search_began", "search_until", "sent",
                 "seq", "sized_at", "statm", "tracer", "transport")

    def __init__(self) -> None:
        self.transport = Transport()
        self.statm = -1
        self.tracer: Any = None
        self.reset()

    def reset(self) -> None:
        self.transport.close()
        self.transport = Transport()
        # /proc/self is resolved when opened: a parent's descriptor would read the parent.
        statm, self.statm = self.statm, -1
        if statm >= 0:
            with contextlib.suppress(OSError):
                os.close(statm)
        tracer, self.tracer = self.tracer, None
        if tracer is not None:
            with contextlib.suppress(Exception):
                tracer.cancel()
        self.seq = 0
        # The newest (step, time) recorded, and the one the last step report carried: they differ
        # (by identity) while a step is still waiting for its report.
        self.last: Optional[tuple[Any, float]] = None
        self.sent: Optional[tuple[Any, float]] = None
        self.due = 0.0 if enabled else float("inf")
        self.chores_due = self.due
        self.sized_at = float("-inf")
        self.next_scan = self.next_request = 0.0
        self.scanned_at = float("-inf")
        #: A faster search asked for by the daemon runs until search_until (monotonic).
        self.search_began = float("-inf")
        self.search_until = 0.0
        self.scanner: Any = None
        #: The growers of the newest completed discovery pass, for the next step report only.
        self.discovered: Optional[dict[str, dict[str, int]]] = None
        self.finished = False


enabled = True
# None: GPUWATCH_AGENT_DISCOVERY decides, at first use.
discover_on: Optional[bool] = None
socket_path: Optional[str] = None
min_interval = DEFAULT_MIN_INTERVAL
st = _State()
# Reentrant: a graceful_shutdown cleanup that calls finished() runs in a signal handler, perhaps
# while the interrupted main thread holds this lock in the middle of a report.
lock = threading.RLock()
watched: dict[str, Any] = {}
used = False
exit_hook_installed = False
fork_hook_installed = False
cleanups: tuple[Callable[[], Any], ...] = ()
previous_sigint: Any = None
interrupted = False
#: tick_until_stepped() was called: forked children tick too, each from a thread of its own.
ticking = False
ticker: Optional[threading.Thread] = None


def _acquire() -> bool:
    # Bounded, so a report from a signal handler or the exit hook can never hang the program.
    return lock.acquire(timeout=1.0)


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in _OFF
