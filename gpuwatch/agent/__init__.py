"""The in-process agent: a training program tells the gpuwatch daemon its step and buffer sizes.

    from gpuwatch import agent
    for global_step, batch in enumerate(loader):
        ...
        agent.step(global_step)
    agent.finished()

With nothing else, the agent reports the step, RSS and (where the program uses CUDA) the caching
allocator's figures, and looks for containers that grow by itself (`_discovery`). `watch()` names
a buffer to report on every report; the daemon can ask for allocation sites (`_tracing`).

Reports are JSON datagrams on the daemon's Unix socket (docs/agent-protocol.md). The daemon takes
the sender's PID from the kernel, so nothing here names the process. This package uses the
standard library only and imports nothing else from gpuwatch: it runs inside training processes
that never install the daemon's dependencies. Importing it has no side effects: the socket, the
fork and exit hooks appear on first use (watch, step, finished), the SIGINT handler only with
graceful_shutdown, tracemalloc only when the daemon asks for a trace.

What one `step()` call may do, cheapest first: record the step (every call); send a report when
one is due (at most every `min_interval`; buffers and CUDA figures are measured for at most one
report in SIZE_INTERVAL); then at most one round of chores when due: a discovery slice (at most
0.9% of the time, in slices of at most SCAN_BUDGET_MAX seconds; SEARCH_SHARE for a bounded time
when the daemon asks for a faster search), a look for a daemon request every REQUEST_INTERVAL,
and while a trace runs, its step count.

Loaded by the bootstrap (gpuwatch.agent._auto), a process that has not stepped reports on a
timer instead (tick_until_stepped: a `tick` report every TICK_INTERVAL from a daemon thread,
after a discovery slice), until its first step.

This module is the public API; the state it shares with the rest is in `_state`, the reports are
built and sent by `_reports`, the chores done by `_chores`, and the hooks and the tick thread
installed by `_hooks`.
"""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any, Callable, Optional, Union

from gpuwatch.agent import _state
from gpuwatch.agent._chores import REQUEST_INTERVAL as REQUEST_INTERVAL
from gpuwatch.agent._chores import SCAN_BUDGET as SCAN_BUDGET
from gpuwatch.agent._chores import SCAN_BUDGET_MAX as SCAN_BUDGET_MAX
from gpuwatch.agent._chores import SCAN_INTERVAL as SCAN_INTERVAL
from gpuwatch.agent._chores import SCAN_SHARE as SCAN_SHARE
from gpuwatch.agent._chores import SEARCH_BUDGET_MAX as SEARCH_BUDGET_MAX
from gpuwatch.agent._chores import SEARCH_COOLDOWN as SEARCH_COOLDOWN
from gpuwatch.agent._chores import SEARCH_SHARE as SEARCH_SHARE
from gpuwatch.agent._chores import _chore_round
from gpuwatch.agent._exit import EXIT_CODE_INTERRUPTED
from gpuwatch.agent._hooks import TICK_INTERVAL as TICK_INTERVAL
from gpuwatch.agent._hooks import _first_use, _install_fork_hook, _on_sigint, _start_ticker
from gpuwatch.agent._reports import SIZE_INTERVAL as SIZE_INTERVAL
from gpuwatch.agent._reports import _report, _send, _send_once_only
from gpuwatch.agent._sizing import SAMPLES
from gpuwatch.agent._state import DEFAULT_MIN_INTERVAL, _acquire, _env_on
from gpuwatch.agent._transport import BACKOFF_FIRST, BACKOFF_MAX
from gpuwatch.protocol import BUFFER_NAME_PATTERN, MAX_BUFFERS, MAX_SEARCH_SECONDS

__all__ = ["configure", "finished", "graceful_shutdown", "step", "unwatch", "watch"]

__all__ += ["BACKOFF_FIRST", "BACKOFF_MAX", "EXIT_CODE_INTERRUPTED", "MAX_SEARCH_SECONDS",
            "SAMPLES"]

_NAME = re.compile(BUFFER_NAME_PATTERN)
_monotonic = time.monotonic
# One object for the life of the process (a forked child's is emptied, not replaced): the
# fast path of step() reads it as a global of this module.
_st = _state.st


# ---- public API --------------------------------------------------------------------------------


def watch(name: str, obj: Any) -> None:
    """Report the size of `obj` under `name` with every report.

    `obj` is anything with len() (items; bytes too when it holds bytes, arrays or tensors, sampled),
    a queue with qsize(), or a callable returning an int (items) or such an object. Raises
    ValueError for a name the protocol refuses or a 65th name: call it at setup.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"gpuwatch agent: buffer name {name!r} must be 1 to 64 characters of "
                         "A-Z a-z 0-9 _ . : / -")
    with _state.lock:
        if name not in _state.watched and len(_state.watched) >= MAX_BUFFERS:
            raise ValueError(f"gpuwatch agent: at most {MAX_BUFFERS} watched buffers; "
                             f"unwatch one before watching {name!r}")
        _state.watched[name] = obj
        _first_use()


def unwatch(name: str) -> None:
    """Stop reporting `name`; unknown names are ignored."""
    with _state.lock:
        _state.watched.pop(name, None)


def step(n: int) -> None:
    """Record training step `n` (an int). Never blocks, never raises.

    A report goes out only when `min_interval` has passed since the last one, and carries the
    newest step; otherwise this stores the step and returns. At most every 0.25 s a call also
    does a slice of discovery (at most 5 ms, 0.9% of the time since the last) or looks for a request
    from the daemon (one non-blocking read).
    """
    try:
        now = _monotonic()
        st = _st
        st.last = (n, now)
        if now >= st.due:
            _send_step(now)
        if now >= st.chores_due:
            _chore_round(now)
    except Exception:
        pass


def finished() -> None:
    """Training is done: tell the daemon now, so whatever of the job stays alive is a leftover."""
    try:
        if not _state.enabled or not _acquire():
            return
        try:
            _first_use()
            st = _st
            if st.finished:
                return
            st.finished = True
            last = st.last
            now = _monotonic()
            data = _report("finished", last[0] if last is not None else None, now)
            st.sent = last
            if data is not None:
                _send_once_only(data, now)
        finally:
            _state.lock.release()
    except Exception:
        pass


def configure(socket_path: Union[str, os.PathLike[str], None] = None,
              min_interval: float = DEFAULT_MIN_INTERVAL, enabled: bool = True,
              discovery: Optional[bool] = None) -> None:
    """Set where reports go (default `$GPUWATCH_RUNTIME_DIR/agent.sock`, read when first needed),
    the least time between step reports, whether the agent reports at all, and whether it looks
    for growing containers (None: unless GPUWATCH_AGENT_DISCOVERY is 0, false, no or off)."""
    interval = float(min_interval)
    if not interval >= 0:
        raise ValueError(f"gpuwatch agent: min_interval must be >= 0, got {min_interval!r}")
    with _state.lock:
        _state.socket_path = os.fspath(socket_path) if socket_path is not None else None
        _state.min_interval = interval
        _state.enabled = bool(enabled)
        _state.discover_on = (_env_on("GPUWATCH_AGENT_DISCOVERY") if discovery is None
                              else bool(discovery))
        st = _st
        st.transport.path = st.transport.target = st.transport.private = None
        st.transport.backoff = 0.0
        st.due = st.chores_due = 0.0 if _state.enabled else float("inf")


def graceful_shutdown(*cleanups: Callable[[], Any]) -> None:
    """On the first SIGINT (Ctrl+C), run `cleanups` in order, then exit with status 130; a second
    SIGINT while they run exits at once. Call it from the main thread (Python delivers signals
    there only); a later call replaces the cleanups. It takes SIGINT even where the process
    started with it ignored (a `cmd &` in a script); forked children get back what was there."""
    for cleanup in cleanups:
        if not callable(cleanup):
            raise TypeError(f"gpuwatch agent: cleanup {cleanup!r} is not callable")
    previous = signal.signal(signal.SIGINT, _on_sigint)
    if previous is not _on_sigint:
        _state.previous_sigint = previous
    _state.cleanups = tuple(cleanups)
    _install_fork_hook()


def _send_step(now: float) -> None:
    if not _state.lock.acquire(False):
        return  # another thread is reporting; this step stays in _st.last for the next report
    try:
        st = _st
        if now < st.due:
            return
        if not _state.used:
            _first_use()
        last = st.last
        if last is None:
            return
        # Moved on before building, so that nothing going wrong below can make every following
        # step build a report again.
        st.due = now + _state.min_interval
        data = _report("step", last[0], now)
        st.sent = last
        if data is not None:
            _send(data, now)
    finally:
        _state.lock.release()


def tick_until_stepped() -> None:
    """Report on a timer until the first step (and in every forked child until its own): the
    bootstrap's call, for processes that may never step. Never raises."""
    try:
        _state.ticking = True
        _install_fork_hook()
        _start_ticker()
    except Exception:
        pass


def _stats() -> dict[str, int]:
    """Counters for tests: reports sent, send attempts, failed (no daemon, or a socket refused),
    dropped (full) and sockets refused (docs/security.md, rule 3)."""
    t = _st.transport
    return {"attempts": t.attempts, "sent": t.sent, "failed": t.failed, "dropped": t.dropped,
            "refused": t.refused, "seq": _st.seq}
