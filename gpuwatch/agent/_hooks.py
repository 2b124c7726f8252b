"""What the agent installs in the process: the fork and exit hooks on first use, the SIGINT
handler of graceful_shutdown, and the tick thread of a process loaded by the bootstrap that has
not stepped yet.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from gpuwatch.agent import _state
from gpuwatch.agent._chores import _discover
from gpuwatch.agent._exit import EXIT_CODE_INTERRUPTED, exit_now, leftovers, say
from gpuwatch.agent._reports import _flush_step, _report, _send
from gpuwatch.agent._state import _acquire, _env_on, _State

#: A process loaded by the bootstrap that has not stepped (a data worker, a helper, a trainer
#: still loading its data) reports a `tick` every TICK_INTERVAL seconds from a daemon thread,
#: with a discovery slice before each (SCAN_SHARE of the interval, at most SCAN_BUDGET_MAX), so
#: that its growth is tested too. Its first step ends the ticks.
TICK_INTERVAL = 1.0
_monotonic = time.monotonic


def _first_use() -> None:
    """Install the fork and exit hooks, once: the agent is in use from here on."""
    if _state.used:
        return
    _state.used = True
    if _state.discover_on is None:
        _state.discover_on = _env_on("GPUWATCH_AGENT_DISCOVERY")
    _install_fork_hook()
    if _state.exit_hook_installed:
        return
    _state.exit_hook_installed = True
    # threading atexit callbacks run last-registered first. The executors register theirs (which
    # join their workers) on import: importing them now puts our check before theirs, while the
    # workers are still alive. The process pool module is imported only where multiprocessing
    # already is, so a program that never uses it does not pay for it.
    try:
        import concurrent.futures.thread
        if "multiprocessing" in sys.modules:
            import concurrent.futures.process  # noqa: F401
    except Exception:
        pass
    # threading's exit callbacks run before the interpreter joins non-daemon threads, while what
    # would hold the exit is still alive; atexit callbacks run after that join.
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(_at_exit)
    except Exception:
        atexit.register(_at_exit)


def _install_fork_hook() -> None:
    if not _state.fork_hook_installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _state.fork_hook_installed = True


def _after_fork_in_child() -> None:
    """A forked child reports as itself: its own socket, seq from 0, no step until it takes one."""
    _state.lock = threading.RLock()  # the parent's may have been held by a thread that is not here
    _state.st.reset()
    _state.used = False  # the exit check is for children that use the agent themselves
    _state.interrupted = False
    if _state.ticking:
        with contextlib.suppress(Exception):
            _start_ticker()  # the parent's thread is not here
    # DataLoader workers and other forked children must not run the parent's cleanups on the
    # Ctrl+C the whole foreground process group receives.
    try:
        if signal.getsignal(signal.SIGINT) is _on_sigint:
            previous = _state.previous_sigint
            signal.signal(signal.SIGINT, previous if previous is not None
                          else signal.default_int_handler)
    except Exception:
        pass


def _at_exit() -> None:
    try:
        if not _state.used or not _state.enabled or not _acquire():
            return
        try:
            _flush_step()
            found = leftovers()
            if found is None:
                return
            body, lines = found
            last = _state.st.last
            now = _monotonic()
            data = _report("exit", last[0] if last is not None else None, now, {"exit": body})
            if data is not None:
                _send(data, now)
        finally:
            _state.lock.release()
        say(lines)
    except Exception:
        pass


def _on_sigint(signum: int, frame: Any) -> None:
    if _state.interrupted:
        os._exit(EXIT_CODE_INTERRUPTED)  # at once: not even a flush, which could block
    _state.interrupted = True
    cleanups = _state.cleanups
    say([f"gpuwatch: interrupted: running {len(cleanups)} cleanup"
          f"{'s' if len(cleanups) != 1 else ''} before exiting with status 130 "
          "(Ctrl+C again to exit at once)"])
    for cleanup in cleanups:
        try:
            cleanup()
        except BaseException:
            say([f"gpuwatch: cleanup {getattr(cleanup, '__qualname__', cleanup)!r} failed:",
                  traceback.format_exc().rstrip()])
    try:
        if _state.used and _state.lock.acquire(False):
            try:
                _flush_step()
            finally:
                _state.lock.release()
    except Exception:
        pass
    exit_now()


def _start_ticker() -> None:
    if not _state.enabled or _state.st.last is not None:
        return
    ticker = _state.ticker
    if ticker is not None and ticker.is_alive():
        return  # one ticker a process (after a fork, the parent's is not alive here)
    # A daemon thread: it never keeps the program alive, and it ends at the first step.
    _state.ticker = threading.Thread(target=_tick_loop, args=(_state.st,),
                                     name="gpuwatch-agent-tick", daemon=True)
    start_without_signals(_state.ticker)


def start_without_signals(thread: threading.Thread) -> None:
    """Start `thread` with every signal blocked in it (a new thread takes its creator's mask,
    which is put back once it runs). The kernel hands a signal sent to the process to any thread
    that does not block it, and passes over the main thread while one is pending there already
    (a SIGCONT it has not run since, a first Ctrl+C); Python runs the handler in the main thread
    alone, when that thread next runs bytecode. A program asleep in signal.pause() or a long
    time.sleep() would sleep on through a SIGTERM the agent's thread took. (The daemon's
    threads start the same way through gpuwatch.threads, which the agent does not import: it
    takes of gpuwatch only the protocol and the launch variables.)"""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:
        thread.start()
        return
    old = mask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        thread.start()
    finally:
        mask(signal.SIG_SETMASK, old)


def _tick_loop(st: _State) -> None:
    count = 0
    try:
        while True:
            time.sleep(TICK_INTERVAL)
            # Stepped, or a forked child's state is not this one's: this thread is done.
            if st is not _state.st or st.last is not None or st.finished or not _state.enabled:
                return
            count += 1
            _tick(st, count)
    except Exception:
        return


def _tick(st: _State, count: int) -> None:
    if not _state.lock.acquire(timeout=TICK_INTERVAL):
        return
    try:
        if st.last is not None:
            return
        if not _state.used:
            _first_use()
        now = _monotonic()
        if _state.discover_on and now >= st.next_scan:
            _discover(count, now)
        if now < st.due:
            return  # no daemon a moment ago: the backoff holds for ticks too
        data = _report("tick", None, now)
        if data is not None:
            _send(data, now)
    finally:
        _state.lock.release()
