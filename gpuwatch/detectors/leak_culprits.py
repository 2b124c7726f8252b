"""What explains a leak: the culprit a leak finding names (gpuwatch.detectors.leaks), the first of
a watched buffer, a container the agent's discovery names, a growing autograd history, and the
top allocation site of a trace, each from the agent's reports and the daemon's measurements of
them; and the words a finding says of it.
"""

from __future__ import annotations

import math
from typing import Optional

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors.trend import Growth, growth, is_growing
from gpuwatch.evidence import Culprit, TracedSite, TraceSummary
from gpuwatch.history import History, StepSeries
from gpuwatch.history import Series as Points
from gpuwatch.model import Finding, HostProcess, Kind, NodeSnapshot, TraceReport
from gpuwatch.protocol import AUTOGRAD_SUFFIX
from gpuwatch.vocabulary import FoundBy, TraceStatus

#: An item count must grow by at least this much per step, and by this share of itself, to call
#: a buffer leaking by items: a bounded queue or cache jitters around its capacity.
MIN_ITEMS_PER_STEP = 1.0
MIN_ITEMS_RELATIVE = 0.01
#: Discovery passes that must show a container growing before it is named.
DISCOVERED_POINTS = 4
#: Allocation sites of a trace shown in a finding's details.
TRACE_SITES_SHOWN = 5


def make_culprit(name: str, found_by: FoundBy, bytes_per_step: Optional[float],
             items_per_step: Optional[float]) -> Culprit:
    """The culprit with its own growth as findings carry it: whole bytes, items to 3 places."""
    return Culprit(name, found_by,
                   round(bytes_per_step) if bytes_per_step is not None else None,
                   round(items_per_step, 3) if items_per_step is not None else None)


def explains(c: Culprit) -> str:
    if c.found_by == FoundBy.AUTOGRAD:
        return (f"`{c.name}` holds the graph of every step since step {c.since_step}: "
                "use `loss.item()` or `.detach()` (autograd)")
    if c.found_by == FoundBy.TRACED:
        return f"allocations at `{c.name}` explain it (traced)"
    if c.found_by == FoundBy.DISCOVERED:
        return f"`{c.name}` explains it (discovered)"
    return f"buffer `{c.name}` explains it (watched)"


def explains_publicly(c: Culprit) -> str:
    """explains(), by the kind of culprit alone."""
    if c.found_by == FoundBy.AUTOGRAD:
        return ("a tensor holds the autograd graph of every step: use `loss.item()` or "
                "`.detach()` (autograd)")
    if c.found_by == FoundBy.TRACED:
        return "an allocation site explains it (traced)"
    if c.found_by == FoundBy.DISCOVERED:
        return "a container the agent found explains it (discovered)"
    return "a watched buffer explains it (watched)"


def slope(g: Optional[Growth]) -> Optional[float]:
    return g.slope if g is not None else None


def watched(total: Growth, by_bytes: dict[str, Growth], by_items: dict[str, Growth]
             ) -> Optional[Culprit]:
    """The buffer whose byte growth explains at least half of the total; else, when no buffer
    reports bytes, the one whose item count grows fastest."""
    explaining = {n: g for n, g in by_bytes.items() if g.slope >= 0.5 * total.slope}
    if explaining:
        name = max(explaining.items(), key=lambda kv: kv[1].slope)[0]
    else:
        unsized = {n: g for n, g in by_items.items() if n not in by_bytes}
        if not unsized:
            return None
        name = max(unsized.items(), key=lambda kv: kv[1].slope)[0]
    return make_culprit(name, FoundBy.WATCHED, slope(by_bytes.get(name)),
                    slope(by_items.get(name)))


def discovered(total: Growth, steps: StepSeries, config: DetectorConfig
                ) -> Optional[Culprit]:
    """Among the containers the agent's newest discovery pass named, the one whose byte growth
    explains at least half of the total; else, when none of them is sized, the one whose item
    count grows fastest.

    The agent names its top growers without knowing what a leak is: a cache filling up to its
    capacity is one for a while. Its own measurements decide, over the last few passes (four
    points suffice: they are exact and sparse, not one per step)."""
    names = [n for n in steps.discovered_latest
             if n in steps.discovered_items and not n.endswith(AUTOGRAD_SUFFIX)]
    if not names:
        return None

    def rising(series: Points, min_slope: float, min_relative: float) -> Optional[Growth]:
        g = growth(series.xs, series.ys, -math.inf, config.leak_window, DISCOVERED_POINTS,
                   exact=True)
        return g if is_growing(g, min_slope, min_relative) else None

    sized = [n for n in names if not math.isnan(steps.discovered_bytes[n].ys[-1])]
    if sized:
        by_bytes = {n: g for n in sized
                    if (g := rising(steps.discovered_bytes[n], 0.5 * total.slope,
                                    config.leak_min_relative))}
        if not by_bytes:
            return None
        name, g = max(by_bytes.items(), key=lambda kv: kv[1].slope)
        items = rising(steps.discovered_items[name], 0.0, 0.0)
        return make_culprit(name, FoundBy.DISCOVERED, g.slope, slope(items))
    by_items = {n: g for n in names
                if (g := rising(steps.discovered_items[n], MIN_ITEMS_PER_STEP,
                                MIN_ITEMS_RELATIVE))}
    if not by_items:
        return None
    name, g = max(by_items.items(), key=lambda kv: kv[1].slope)
    return make_culprit(name, FoundBy.DISCOVERED, None, g.slope)


def autograd(steps: StepSeries, config: DetectorConfig) -> Optional[Culprit]:
    """Among the tensors the agent's newest discovery pass names for their growing autograd
    history, the one whose graph gains the most nodes per step, at least one a step over the
    last 4 passes. Its history began where its nodes and their rate put it: the step reached
    less nodes / nodes per step."""
    best: Optional[tuple[str, Growth]] = None
    for name in steps.discovered_latest:
        series = steps.discovered_items.get(name) if name.endswith(AUTOGRAD_SUFFIX) else None
        if series is None:
            continue
        g = growth(series.xs, series.ys, -math.inf, config.leak_window, DISCOVERED_POINTS,
                   exact=True)
        if g is not None and is_growing(g, MIN_ITEMS_PER_STEP, 0.0) and (
                best is None or g.slope > best[1].slope):
            best = (name, g)
    if best is None:
        return None
    name, g = best
    since = max(0, min(int(g.last_x), round(g.last_x - g.last_y / g.slope)))
    return Culprit(name[:-len(AUTOGRAD_SUFFIX)], FoundBy.AUTOGRAD,
                   graph_nodes_per_step=round(g.slope, 3), since_step=since)


#: An autograd history is a leak on its own when it has grown every step for at least this many
#: steps, over at least _HISTORY_POINTS of the agent's counts, each above the one before.
_HISTORY_STEPS = 10
_HISTORY_POINTS = 3
#: "Roughly linear": the nodes gained per step between any two counts within this factor of the
#: rate over all of them (one step's graph is the same size every step).
_HISTORY_LINEAR = 2.0
#: A history whose count and rate put its start this many steps before the process's first
#: reported step is no steady accumulation from there (its start is not known): only the steps
#: it has been seen growing count.
_HISTORY_SLACK = 2


def growing_history(steps: StepSeries) -> Optional[tuple[Growth, Culprit]]:
    """The tensor the agent's newest discovery pass names for its autograd history, whose
    graph has grown steadily every step for at least _HISTORY_STEPS steps: its newest counts
    (at least _HISTORY_POINTS, exact, sparse) each above the one before, gaining nodes at a
    rate within _HISTORY_LINEAR of their overall rate. The steps of growth are those since the
    start its count and rate put it at (the count includes the growth before the agent named
    it), or only those it was seen growing over where that start would come before the
    process's first step. The fastest growing such tensor, with its growth over the counts seen
    and its culprit (found by autograd); None if there is none.

    No warm-up: the counts are the agent's exact figures of a graph, not memory that a first
    step's allocations and caches move."""
    first_step = steps.times.xs[0] if len(steps.times) else math.inf
    best: Optional[tuple[Growth, Culprit]] = None
    for name in steps.discovered_latest:
        series = steps.discovered_items.get(name) if name.endswith(AUTOGRAD_SUFFIX) else None
        if series is None or not len(series):
            continue
        xs, ys = series.xs, series.ys
        # The newest run of counts each above the one before.
        i = len(xs) - 1
        if math.isnan(ys[i]):
            continue
        while i > 0 and not math.isnan(ys[i - 1]) and xs[i - 1] < xs[i] and ys[i - 1] < ys[i]:
            i -= 1
        points = len(xs) - i
        last_x, last_y = xs[-1], ys[-1]
        if points < _HISTORY_POINTS:
            continue
        rate = (last_y - ys[i]) / (last_x - xs[i])
        if rate < MIN_ITEMS_PER_STEP:
            continue
        if any(not rate / _HISTORY_LINEAR <= (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j])
               <= rate * _HISTORY_LINEAR for j in range(i, len(xs) - 1)):
            continue
        since = last_x - last_y / rate
        if since < first_step - _HISTORY_SLACK:
            since = xs[i]  # its start is not where its rate puts it: only what was seen
        if last_x - since < _HISTORY_STEPS:
            continue
        if best is not None and rate <= best[0].slope:
            continue
        g = Growth(slope=rate, consistency=1.0, recent_slope=(last_y - ys[-2]) / (
            last_x - xs[-2]), min_rise=min(ys[j + 1] - ys[j] for j in range(i, len(xs) - 1)),
            spread=0.0, points=points, first_x=xs[i], last_x=last_x, last_y=last_y)
        best = (g, Culprit(name[:-len(AUTOGRAD_SUFFIX)], FoundBy.AUTOGRAD,
                           graph_nodes_per_step=round(rate, 3),
                           since_step=max(0, min(int(last_x), round(since)))))
    return best


def trace_of(p: HostProcess, g: Growth, steps: StepSeries, snapshot: NodeSnapshot,
              history: History) -> Optional[TraceReport]:
    """The process's newest trace report, if it speaks about this leak: it came after the leak
    opened, or while the growth the test found went on (a leak that closed for a poll and
    opened again keeps the trace it asked for)."""
    agent = snapshot.agents.get(p.pid)
    trace = agent.trace if agent is not None else None
    if trace is None:
        return None
    start = time_at(steps, g.first_x)
    opened = history.findings.open_since(Finding.identity_of(Kind.LEAK, p.pid, p.start_time))
    if opened is not None:
        start = min(start, opened)
    return trace if trace.received_at >= start else None


def time_at(steps: StepSeries, step: float) -> float:
    """When the process reported `step` (or the first step after it)."""
    xs, ys = steps.times.xs, steps.times.ys
    i = len(xs)
    while i > 0 and xs[i - 1] >= step:
        i -= 1
    return ys[i] if i < len(ys) else math.inf


def traced(total: Growth, trace: Optional[TraceReport]) -> Optional[Culprit]:
    """The top allocation site of a finished trace, when its growth per step explains at least
    half of the total."""
    if trace is None or trace.status != TraceStatus.DONE or not trace.steps or not trace.sites:
        return None
    top = max(trace.sites, key=lambda s: s.bytes)
    per_step = top.bytes / trace.steps
    if per_step < 0.5 * total.slope:
        return None
    return make_culprit(f"{top.file}:{top.line}", FoundBy.TRACED, per_step, None)


def trace_summary(trace: TraceReport) -> TraceSummary:
    steps = trace.steps or 0
    sites = sorted(trace.sites, key=lambda s: s.bytes, reverse=True)[:TRACE_SITES_SHOWN]
    return TraceSummary(
        status=trace.status, why=trace.why, steps=trace.steps,
        sites=tuple(TracedSite(
            site=f"{s.file}:{s.line}",
            bytes_per_step=round(s.bytes / steps) if steps else None,
            count_per_step=round(s.count / steps, 3) if steps else None) for s in sites),
        traceback=tuple(f"{file}:{line}" for file, line in trace.traceback))
