"""Threads that leave the process's signals to its main thread.

The kernel hands a signal sent to a process to any of its threads that does not block it, and
passes over the main thread while a signal is pending there already (a SIGHUP not yet handled, a
first Ctrl+C). CPython notes a signal in whichever thread took it, but runs the handler in the
main thread alone, when that thread next runs bytecode. The daemon's main thread sleeps between
polls in a wait that only its `stop()` or the timeout ends: a SIGTERM one of its listener
threads took would be handled up to an interval late. So every thread the daemon starts blocks
every signal, and only the main thread takes them. (The agent, which imports nothing of this
module, starts its threads the same way: gpuwatch/agent/_hooks.py, start_without_signals.)
"""

from __future__ import annotations

import signal
import threading


def start_without_signals(thread: threading.Thread) -> None:
    """Start `thread` with every signal blocked in it: a new thread takes its creator's mask,
    which is blocked around the start and put back at once."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:  # not a POSIX system
        thread.start()
        return
    old = mask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        thread.start()
    finally:
        mask(signal.SIG_SETMASK, old)
