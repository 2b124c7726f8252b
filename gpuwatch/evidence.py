"""A finding's evidence beyond its reason: the figures that move while the finding stays open
(`Finding.details`), as typed values.

The detectors make them; the views, the exporter and the actions read their attributes; the
status document writes each as the JSON object docs/json.md describes and reads it back
(gpuwatch.sinks.details_doc), in one place.
"""

from __future__ import annotations

from typing import Optional, Union

from gpuwatch.frozen import frozen_dataclass as _frozen
from gpuwatch.vocabulary import FoundBy, GrowthUnit, LimitSource, Series, TraceStatus


@_frozen
class MemoryLimit:
    """A limit a process's memory runs into, and what is left of it."""

    source: LimitSource
    #: None for the node's MemAvailable, which is what is left, not a limit.
    limit_bytes: Optional[int]
    available_bytes: int


@_frozen
class Culprit:
    """What explains a leak, and how it was found."""

    #: A watched buffer's name, a discovered container's qualified name, or a traced `file:line`.
    name: str
    found_by: Optional[FoundBy]
    #: Its own growth, where measured.
    bytes_per_step: Optional[int] = None
    items_per_step: Optional[float] = None
    #: A tensor holding the autograd history of every step (found by autograd): the step its
    #: history began at, and the nodes its graph gains a step.
    since_step: Optional[int] = None
    graph_nodes_per_step: Optional[float] = None


@_frozen
class TracedSite:
    """One allocation site of a trace, per traced step."""

    #: `file:line`.
    site: str
    bytes_per_step: Optional[int]
    count_per_step: Optional[float]


@_frozen
class TraceSummary:
    """What became of the allocation trace asked of a leaking process."""

    status: TraceStatus
    #: Why it was refused or failed; empty otherwise.
    why: str = ""
    #: Steps asked for (requested) or traced (done).
    steps: Optional[int] = None
    #: The largest sites, largest first (done only).
    sites: tuple[TracedSite, ...] = ()
    #: `file:line` frames of the top site's allocation, oldest call first.
    traceback: tuple[str, ...] = ()


@_frozen
class OomProjection:
    """When a leak runs out against `limit`."""

    limit: MemoryLimit
    #: The training step (a leak measured by the step).
    step: Optional[int] = None
    #: Seconds from the finding's poll; None where the seconds a step takes are unknown.
    in_seconds: Optional[int] = None
    #: The moment, in seconds since the epoch (a leak measured over time).
    at: Optional[int] = None


@_frozen
class LeakEvidence:
    """A figure that grows: by the step (an instrumented process) or per second (any other)."""

    series: Series
    unit: GrowthUnit
    #: The buffer's name, where `series` is a buffer growing alone.
    buffer: Optional[str] = None
    #: The first and last step of the window the growth was measured over (by the step).
    window_steps: Optional[tuple[int, int]] = None
    growth_bytes_per_step: Optional[int] = None
    growth_bytes_per_second: Optional[int] = None
    culprit: Optional[Culprit] = None
    trace: Optional[TraceSummary] = None
    projection: Optional[OomProjection] = None

    @property
    def series_text(self) -> str:
        """The figure in words, as a reason, the document and the `series` label say it:
        "RSS", "GPU memory", "buffer `fetch_buffer`"."""
        if self.series == Series.BUFFER:
            return f"buffer `{self.buffer}`"
        return str(self.series)

    @property
    def found_by(self) -> Optional[FoundBy]:
        return self.culprit.found_by if self.culprit is not None else None


@_frozen
class CopyOnWrite:
    """Forked workers whose private memory grows while their RSS stays flat: the parent's pages
    copied for each of them (a leak finding on the parent)."""

    growth_bytes_per_second: int
    workers: int
    worker_pids: tuple[int, ...]
    #: How much the workers' private memory grew, together, over the window.
    private_growth_bytes: int
    uss_bytes_from: int
    uss_bytes_to: int


@_frozen
class HungAtExit:
    """A stall whose process began to exit and hangs (the history lets such a finding take over
    the reason of a step stall open on the same process)."""


#: What a finding's `details` can be: None where its reason says it all.
Details = Union[LeakEvidence, CopyOnWrite, HungAtExit]
