"""Why a process will not exit, said at exit: what the interpreter is about to wait for.

At interpreter exit, before non-daemon threads are joined, the agent looks for what would hold the
exit: live non-daemon threads, executors never shut down, a torch.distributed process group never
destroyed. Each gets one line on stderr, and the daemon gets an `exit` report.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Optional

from gpuwatch.protocol import MAX_EXIT_THREADS as MAX_THREAD_NAMES
from gpuwatch.protocol import MAX_POOL_THREAD_NAMES, MAX_THREAD_NAME

__all__ = ["EXIT_CODE_INTERRUPTED", "exit_now", "leftovers", "say"]

EXIT_CODE_INTERRUPTED = 130


def leftovers() -> Optional[tuple[dict[str, Any], list[str]]]:
    """What is still alive that holds the exit: the `exit` body and one stderr line per item."""
    executor_lines, executor_threads, pools = executors()
    lines = list(executor_lines)
    main, current = threading.main_thread(), threading.current_thread()
    threads = []
    for t in threading.enumerate():
        if t is main or t is current or t.daemon or not t.is_alive() or t in executor_threads:
            continue
        threads.append(t.name[:MAX_THREAD_NAME])
        lines.append(f"gpuwatch: at exit, non-daemon thread {t.name!r} is still running: "
                     "the process will not exit until it stops")
    process_group = False
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        with contextlib.suppress(Exception):
            process_group = bool(dist.is_available() and dist.is_initialized())
    if process_group:
        lines.append("gpuwatch: at exit, the torch.distributed process group was never destroyed: "
                     "call torch.distributed.destroy_process_group() when training ends, or the "
                     "exit can hang and the other ranks wait on this one")
    if not lines:
        return None
    body = {"threads": threads[:MAX_THREAD_NAMES], "executors": len(executor_lines),
            "process_group": process_group}
    if pools:
        body["thread_pools"] = pools[:MAX_THREAD_NAMES]
    return body, lines


def executors() -> tuple[list[str], set[threading.Thread], list[dict[str, Any]]]:
    """Executors never shut down, found through the registries the executors' own exit hooks
    use; their threads are returned so they are not listed again one by one, and each thread
    pool as the `exit` report's `thread_pools` has it (its live workers, a few of their names).

    Thread pool workers that share a work queue belong to one executor; a process pool has one
    manager thread. Where these private registries are missing, the same threads still show up
    as non-daemon threads.
    """
    lines: list[str] = []
    seen: set[threading.Thread] = set()
    described: list[dict[str, Any]] = []
    thread_mod = sys.modules.get("concurrent.futures.thread")
    pools: dict[int, list[threading.Thread]] = {}
    for t, q in list(getattr(thread_mod, "_threads_queues", {}).items()):
        if t.is_alive():
            pools.setdefault(id(q), []).append(t)
    for workers in pools.values():
        seen.update(workers)
        described.append({"workers": len(workers),
                          "threads": [t.name[:MAX_THREAD_NAME]
                                      for t in workers[:MAX_POOL_THREAD_NAMES]]})
        names = ", ".join(repr(t.name) for t in workers[:4]) + (", ..." if len(workers) > 4
                                                                else "")
        lines.append(f"gpuwatch: at exit, a ThreadPoolExecutor with {len(workers)} live worker "
                     f"thread{'s' if len(workers) != 1 else ''} ({names}) was never shut down: "
                     "the process will not exit until its running and queued tasks finish")
    process_mod = sys.modules.get("concurrent.futures.process")
    for t in list(getattr(process_mod, "_threads_wakeups", {})):
        if t.is_alive():
            seen.add(t)
            lines.append("gpuwatch: at exit, a ProcessPoolExecutor was never shut down: the "
                         "process will not exit until its running and queued tasks finish")
    return lines, seen, described


def say(lines: list[str]) -> None:
    err = sys.stderr
    if err is None:
        return
    try:
        for line in lines:
            print(line, file=err)
        err.flush()
    except Exception:
        pass


def exit_now() -> None:
    # os._exit, not SystemExit: an exception raised in the interrupted code can be caught and
    # swallowed by it, and a clean interpreter exit waits for every non-daemon thread (a NCCL
    # heartbeat, a prefetcher) - "Ctrl+C exits" would not hold. Output is flushed by hand since
    # nothing else runs after this.
    if "logging" in sys.modules:
        with contextlib.suppress(Exception):
            sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass
    os._exit(EXIT_CODE_INTERRUPTED)
