"""Where `gpuwatch top` gets its reports, and the samples it keeps of each process.

Reports are read (gpuwatch.sinks.document.from_json, by the screen's producer) from the status
documents of gpuwatch.app.status: the running daemon's, or, when none answers (or `--poll`),
top's own polls with one History kept across them. The daemon is asked again on
every refresh, so top switches to it as soon as one starts.

A thread produces the reports: a poll or a slow daemon never holds up the keys. The screen takes
the newest report when it is ready (`Feed.take`); nothing else is shared between the two.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

from gpuwatch.model import NodeReport, gpu_memory
from gpuwatch.threads import start_without_signals

#: How many refreshes of each process the sparklines and the details' figures go back.
SAMPLES_PER_PROCESS = 120


@dataclass(frozen=True)
class Update:
    """What the feed produced last: a report, or why the last refresh failed (the screen keeps
    showing the previous report then)."""
    generation: int
    report: Optional[NodeReport]
    error: Optional[str] = None


Producer = Callable[[], NodeReport]


class Feed:
    """Refreshes every `interval` seconds in a thread of its own; `refresh_now` cuts the wait
    short (after a reap, the user wants to see it at once)."""

    def __init__(self, produce: Producer, interval: float,
                 close: Optional[Callable[[], None]] = None) -> None:
        self._produce = produce
        self._close = close
        self.interval = interval
        self._lock = threading.Lock()
        self._update: Optional[Update] = None
        self._generation = 0
        self._taken = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuwatch-top-feed", daemon=True)

    def start(self) -> None:
        start_without_signals(self._thread)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop refreshing. A poll under way is not interrupted: after `timeout` the thread is
        left to finish it (a daemon thread, it cannot keep the process alive)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def refresh_now(self) -> None:
        self._wake.set()

    def take(self) -> Optional[Update]:
        """The newest update, once: None when nothing new came since the last call."""
        with self._lock:
            update = self._update
            if update is None or update.generation == self._taken:
                return None
            self._taken = update.generation
            return update

    def _publish(self, report: Optional[NodeReport], error: Optional[str]) -> None:
        with self._lock:
            self._generation += 1
            self._update = Update(self._generation, report, error)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                # Cleared before, not after, producing: a refresh_now() during a poll is then
                # still owed one.
                self._wake.clear()
                try:
                    self._publish(self._produce(), None)
                except Exception as exc:  # shown in the header; the next refresh tries again
                    self._publish(None, f"{type(exc).__name__}: {exc}")
                self._wake.wait(max(0.0, self.interval - (time.monotonic() - started)))
        finally:
            if self._close is not None:
                self._close()


class Sample(NamedTuple):
    at: float
    rss_bytes: Optional[int]
    gpu_memory_bytes: Optional[int]


class Samples:
    """RSS and GPU memory of each process at each refresh since top started: a bounded ring per
    process, forgotten when the process leaves the report. A PID reused by a new process
    starts a new ring (the start time tells them apart)."""

    def __init__(self, capacity: int = SAMPLES_PER_PROCESS) -> None:
        self.capacity = capacity
        self._rings: dict[int, tuple[Optional[float], deque[Sample]]] = {}
        self._last_taken_at: Optional[float] = None

    def record(self, report: NodeReport) -> None:
        snapshot = report.snapshot
        taken_at = snapshot.wall(snapshot.taken_at)
        blind = snapshot.blind_gpus
        # A daemon polling slower than top refreshes answers the same snapshot twice: one
        # sample per snapshot, or a flat line would stand for time that was never measured.
        # (An earlier time is a new snapshot too: the wall clock was set back.)
        if taken_at == self._last_taken_at:
            return
        self._last_taken_at = taken_at
        rings: dict[int, tuple[Optional[float], deque[Sample]]] = {}
        for p in snapshot.processes.values():
            pid, start = p.pid, snapshot.wall_or_none(p.start_time)
            kept = self._rings.get(pid)
            ring = kept[1] if kept is not None and kept[0] == start else deque(
                maxlen=self.capacity)
            ring.append(Sample(taken_at, p.rss_bytes, gpu_memory(p, blind)))
            rings[pid] = (start, ring)
        self._rings = rings

    def of(self, pid: int) -> list[Sample]:
        kept = self._rings.get(pid)
        return list(kept[1]) if kept is not None else []

    def pids(self) -> Iterable[int]:
        return self._rings.keys()
