"""What an instrumented process reported, by training step: the step-aligned series the
history keeps of it (StepSeries), each a bounded run of packed doubles (Series).

What agent reports make the history keep is charged to the reporting user in the agent memory
budget (gpuwatch.agent_budget), at the size each series can reach, when it is created
(STEP_BYTES for a process's step series, PAIR_BYTES for each buffer's or discovered
container's): a series the budget refuses is not kept (and counted).

An instrumented process's RSS series is the kernel's figure (/proc) at each poll, against the
step it had reached, as its GPU memory is NVML's: the RSS its agent reports is its own word,
which any process can make up (docs/security.md, rule 4).
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from typing import Optional

from gpuwatch.agent_budget import AgentBudget
from gpuwatch.model import NO_DISCOVERY, BufferSize, DiscoveredSize, StepPoint
from gpuwatch.protocol import MAX_BUFFERS  # buffer names followed per process

_NAN = math.nan
#: Step points kept per instrumented process for its step, RSS, CUDA and GPU series: the leak
#: test's window and then some, and the seconds per step over a long stretch.
STEP_POINTS = 512
#: Points kept per watched buffer and per discovered container, two series each (items, bytes).
#: The leak test reads at most the newest 2 x detectors.leak_window points of a series (128 at
#: the default window of 64); these are most of what a process with many buffers costs.
SERIES_POINTS = 160


def series_bytes(capacity: int) -> int:
    """Memory of a Series filled to `capacity`: two arrays of doubles (8 bytes a point, and
    the array's over-allocation) and the object (measured with tracemalloc: 17.2 a point)."""
    return 96 + 18 * capacity


#: A StepSeries with its four step-aligned series full, its dictionaries and the object.
STEP_BYTES = 640 + 4 * series_bytes(STEP_POINTS)
#: One buffer's or discovered container's two series (items, bytes) and their entries.
PAIR_BYTES = 160 + 2 * series_bytes(SERIES_POINTS)
#: Names a StepSeries remembers as refused, so that each is counted once.
_REFUSED_NAMES = 256


class Series:
    """A bounded, step- or time-aligned run of one figure: parallel packed arrays."""

    __slots__ = ("capacity", "xs", "ys")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.xs = array("d")
        self.ys = array("d")

    def add(self, x: float, y: Optional[float]) -> None:
        self.xs.append(x)
        self.ys.append(_NAN if y is None else float(y))
        if len(self.xs) > self.capacity:
            del self.xs[0]
            del self.ys[0]

    def __len__(self) -> int:
        return len(self.xs)


#: Discovered containers followed per process. The agent names its current top growers (8 at a
#: time), and those change over a run; the least recently reported are dropped beyond this.
MAX_DISCOVERED = 32


class StepSeries:
    """What an instrumented process reported, by training step (docs/agent-protocol.md).

    Discovered containers' series hold a point only at the steps of reports that followed a
    discovery pass: they are sparse, each point a fresh measurement.

    With a `budget`, every buffer's and discovered container's pair of series is charged to
    `uid` (PAIR_BYTES) before it is created, and not created when the budget refuses; the
    caller charges STEP_BYTES for the rest. `release()` gives all of it back.
    """

    __slots__ = ("budget", "buffer_bytes", "buffer_items", "capacity", "charged", "cuda",
                 "discovered_bytes", "discovered_items", "discovered_latest", "gpu",
                 "refused_names", "rss", "series_points", "ticking", "times", "uid")

    def __init__(self, capacity: int, budget: Optional[AgentBudget] = None, uid: int = 0,
                 charged: int = 0, series_points: int = SERIES_POINTS) -> None:
        self.capacity = capacity
        self.series_points = series_points
        self.budget = budget
        self.uid = uid
        #: Bytes charged to the budget for this process, STEP_BYTES included.
        self.charged = charged
        self.refused_names: set[str] = set()
        self.times = Series(capacity)  # step -> receive time, for seconds per step
        #: The kernel's RSS (/proc) at each poll, against the step reached by then: never the
        #: agent's own figure (docs/design-notes.md, "RSS from /proc").
        self.rss = Series(capacity)
        #: torch's allocated bytes: what tensors hold, which a GPU leak is decided on.
        self.cuda = Series(capacity)
        #: NVML's figure at each poll, against the step the process had reached by then.
        self.gpu = Series(capacity)
        self.buffer_items: dict[str, Series] = {}
        self.buffer_bytes: dict[str, Series] = {}
        # Least recently reported first, in both.
        self.discovered_items: OrderedDict[str, Series] = OrderedDict()
        self.discovered_bytes: OrderedDict[str, Series] = OrderedDict()
        #: The names in the newest report that carried a discovery pass: what grows now.
        self.discovered_latest: frozenset[str] = frozenset()
        #: Its points are `tick` reports (a process that has not stepped): every series is by
        #: the time received, not by step. Its first step report starts the series afresh.
        self.ticking = False

    @property
    def last_report_at(self) -> float:
        """When the newest step point was received (0 before any)."""
        return self.times.ys[-1] if len(self.times) else 0.0

    def _reserve(self, name: str) -> bool:
        """Charge a new pair of series, or count it refused (once per name)."""
        if self.budget is None:
            return True
        reason = self.budget.grant(self.uid, "history", PAIR_BYTES)
        if reason is None:
            self.charged += PAIR_BYTES
            self.refused_names.discard(name)
            return True
        if name not in self.refused_names and len(self.refused_names) < _REFUSED_NAMES:
            self.refused_names.add(name)
            self.budget.refused("series", reason)
        return False

    def _unreserve(self) -> None:
        if self.budget is not None:
            self.budget.release(self.uid, "history", PAIR_BYTES)
            self.charged -= PAIR_BYTES

    def release(self) -> int:
        """Give back everything charged for this process; the bytes."""
        charged, self.charged = self.charged, 0
        if self.budget is not None:
            self.budget.release(self.uid, "history", charged)
        return charged

    def add(self, point: StepPoint) -> None:
        if point.ticked:
            self.ticking = True
            step = point.at
        else:
            step = float(point.step)
        self.times.add(step, point.at)
        self.cuda.add(step, point.cuda_allocated_bytes)
        items, sizes = self.buffer_items, self.buffer_bytes
        for name, size in point.buffers.items():
            item_series = items.get(name)
            if item_series is None:
                if len(items) >= MAX_BUFFERS or not self._reserve(name):
                    continue
                item_series = items[name] = Series(self.series_points)
                sizes[name] = Series(self.series_points)
            item_series.add(step, size.items)
            sizes[name].add(step, size.bytes)
        if point.discovered is not NO_DISCOVERY:
            self._add_discovered(step, point.discovered, not point.ticked)

    def _add_discovered(self, step: float, discovered: Mapping[str, BufferSize],
                        stepped: bool) -> None:
        """Each container at the step the agent counted it at, where it said (a stepping
        process's) and that step lies after the container's last point and at most at the
        report's: a pass spans steps, and the report that carries it comes at a later one.
        Otherwise at the report's step."""
        self.discovered_latest = frozenset(discovered)
        items, sizes = self.discovered_items, self.discovered_bytes
        for name, size in discovered.items():
            if name in items:
                items.move_to_end(name)
                sizes.move_to_end(name)
            elif self._reserve(name):
                items[name] = Series(self.series_points)
                sizes[name] = Series(self.series_points)
            else:
                continue
            series = items[name]
            at = step
            if stepped and type(size) is DiscoveredSize and size.step is not None and (
                    size.step <= step and (not len(series) or size.step > series.xs[-1])):
                at = float(size.step)
            series.add(at, size.items)
            sizes[name].add(at, size.bytes)
        while len(items) > MAX_DISCOVERED:
            items.popitem(last=False)
            sizes.popitem(last=False)
            self._unreserve()

    def add_gpu(self, step: int, gpu_memory: Optional[int]) -> None:
        if len(self.gpu) and self.gpu.xs[-1] >= step:
            return  # no step since the last poll: nothing new to align
        self.gpu.add(float(step), gpu_memory)

    def add_rss(self, step: int, rss: Optional[int]) -> None:
        """The kernel's RSS of the process at a poll, against the step it had reached."""
        if len(self.rss) and self.rss.xs[-1] >= step:
            return
        self.rss.add(float(step), rss)
