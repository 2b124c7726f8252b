"""A listener's worker pool: one thread that runs jobs in order of priority, then of arrival."""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Any, Callable, Optional

from gpuwatch.threads import start_without_signals


class WorkPool:
    """One worker thread fed by a priority queue (lowest first, then first come); started when
    first used."""

    _STOP = -1  # ahead of any work

    def __init__(self, name: str, done: Callable[[int, Any], None]) -> None:
        self._name = name
        self._done = done
        # A heap under a condition: all queue.PriorityQueue does here, without the module.
        self._heap: list[tuple[int, int, int, Optional[Callable[[], Any]]]] = []
        self._ready = threading.Condition(threading.Lock())
        self._seq = itertools.count()
        self._thread: Optional[threading.Thread] = None

    def _put(self, item: tuple[int, int, int, Optional[Callable[[], Any]]]) -> None:
        with self._ready:
            heapq.heappush(self._heap, item)
            self._ready.notify()

    def _get(self) -> tuple[int, int, int, Optional[Callable[[], Any]]]:
        with self._ready:
            while not self._heap:
                self._ready.wait()
            return heapq.heappop(self._heap)

    def submit(self, cid: int, fn: Callable[[], Any], priority: int = 0) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
            start_without_signals(self._thread)
        self._put((max(priority, 0), next(self._seq), cid, fn))

    def _work(self) -> None:
        while True:
            _, _, cid, fn = self._get()
            if fn is None:
                return
            try:
                result: Any = fn()
            except BaseException as exc:
                result = exc
            self._done(cid, result)
            # Not kept alive while this thread waits for the next job: an answer holds a body
            # (half a MiB at 1,024 processes) that is the connection's alone from here.
            del fn, result

    def stop(self) -> None:
        if self._thread is not None:
            self._put((self._STOP, next(self._seq), 0, None))
            self._thread.join(5)
