"""The daemon's clock: seconds since the epoch that never jump.

Every duration gpuwatch judges (an orphan's age, a zombie's or a D-state's time, a stalled step,
a leftover's grace, how long a finding has been open before auto-reap) is the difference of two
times it read. Read on the wall clock, an NTP step or a VM resumed after hours moves all of them
at once: an hour forward flags every trainer as stalled and makes every finding old enough to
reap; an hour back hides them all for an hour. So the times gpuwatch stores and compares come
from a clock that reads the wall clock once, when it is made, and from then on advances with
CLOCK_BOOTTIME, which steps never move (and which, unlike CLOCK_MONOTONIC, counts a suspend, as
process start times in /proc do).

What users see is on the wall clock: `step()` is how far the wall clock has moved from this
clock since it was made, and sinks add it to every time they show (NodeSnapshot.wall).
"""

from __future__ import annotations

import time
from typing import Callable

_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def _boottime() -> float:
    return time.clock_gettime(_BOOTTIME)


class SteadyClock:
    """Wall-clock seconds as of when it was made, advancing with CLOCK_BOOTTIME."""

    __slots__ = ("_offset", "_steady", "_wall")

    def __init__(self, wall: Callable[[], float] = time.time,
                 steady: Callable[[], float] = _boottime) -> None:
        self._wall = wall
        self._steady = steady
        self._offset = wall() - steady()

    def __call__(self) -> float:
        return self._offset + self._steady()

    def step(self) -> float:
        """How far the wall clock has stepped from this clock since it was made (seconds, signed;
        0 to within a millisecond or so while nobody sets the clock)."""
        return self._wall() - self()
