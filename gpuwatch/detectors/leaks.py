"""leak: a figure that grows every step (or steadily over time without an agent).

For an instrumented process the series are step-aligned: CUDA allocations and every watched
buffer from its reports, and the kernel's RSS and NVML's GPU memory at each poll against the step
reached by then (the RSS a report claims is never used: docs/security.md, rule 4). The
first `leak_warmup_steps` are ignored. Where the process reports torch's allocated bytes, a GPU
leak is decided on those alone: the caching allocator grows NVML's figure (and torch's reserved
one) without anything leaking. A finding names the figure that grows and projects the step and
time of running out against the tightest limit: the process's cgroup memory.max, a configured
limit, or the node's MemAvailable for host memory; the free memory of its GPUs for GPU memory.

It also names the culprit when it can, the first of:
1. `watched`: a buffer given to agent.watch() whose growth explains at least half of the leak
   (or, when no watched buffer is sized, the one whose item count grows fastest);
2. `discovered`: a container the agent's newest discovery pass names, with the same rule over
   its sparse measurements;
3. `autograd`: a tensor the agent's discovery found holding an autograd graph that grows every
   step (`total_loss += loss`), on the agent's word that it is one (a discovered name ending in
   protocol.AUTOGRAD_SUFFIX) and the daemon's own measurements of its nodes: the history since
   the step its nodes per step put its start at is held, and all it saved for backward;
4. `traced`: for host memory, the top allocation site of a trace the process sent after the leak
   opened, when its growth per step explains at least half of the leak.
The reason says which ("buffer `x` explains it (watched)"); `details` carry the culprit, how it
was found and, while a trace is asked for or once one came, the trace.

An autograd history is also a leak on its own, whatever its bytes, while no memory grows: a
tensor the agent names for it whose exact node counts rose steadily at every report for at
least 10 steps (`total_loss += loss` after backward(): a few KB of nodes a step), which
gpuwatch.detectors.leak_culprits finds with the culprits above.

Without an agent the same test runs on the poll samples, per second: for GPU holders, and for
every other member of a GPU job (a data loader's worker, a launcher, a helper), whose RSS counts
as much as the trainer's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from typing import NamedTuple, Optional

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors.common import Evidence, finding, is_protected
from gpuwatch.detectors.leak_culprits import (
    MIN_ITEMS_PER_STEP,
    MIN_ITEMS_RELATIVE,
    autograd,
    discovered,
    explains,
    explains_publicly,
    growing_history,
    make_culprit,
    slope,
    trace_of,
    trace_summary,
    traced,
    watched,
)
from gpuwatch.detectors.trend import Growth, growth, is_growing, may_grow, median
from gpuwatch.evidence import (
    CopyOnWrite,
    Culprit,
    LeakEvidence,
    MemoryLimit,
    OomProjection,
    TraceSummary,
)
from gpuwatch.history import History, ProcessHistory, StepSeries
from gpuwatch.history import Series as Points
from gpuwatch.model import Finding, HostProcess, Kind, NodeSnapshot
from gpuwatch.vocabulary import (
    FoundBy,
    GrowthUnit,
    LimitSource,
    ProcState,
    Series,
    Severity,
    TraceStatus,
)

#: The kinds of finding this detector reports (a test runs it over scenarios and checks).
EMITS = frozenset({Kind.LEAK})

#: A leak expected to run out within this many seconds is critical.
_CRITICAL_WITHIN = 3600.0


def detect(snapshot: NodeSnapshot, history: History, config: DetectorConfig
           ) -> Iterator[Finding]:
    flagged: set[int] = set()
    windows: dict[int, Optional[_Window]] = {}
    for p in snapshot.processes.values():
        if not p.in_procfs or p.state == ProcState.ZOMBIE or is_protected(p, config):
            continue
        h = history.get(p.identity)
        if h is None:
            continue
        steps = h.steps
        if steps is not None and steps.ticking:
            # An agent that has not stepped, reporting on a timer: tested by time, whatever
            # its job, with the containers its discovery names for culprits.
            found = _by_time(p, h, snapshot, config, windows, steps)
        elif steps is not None and len(steps.times):
            found = _by_step(p, steps, snapshot, history, config)
        elif p.holds_gpu or _in_gpu_job(p, history):
            found = _by_time(p, h, snapshot, config, windows)
        else:
            found = None
        if found is not None:
            flagged.add(p.pid)
            yield found
    yield from _copy_on_write(snapshot, history, config, flagged)


def _in_gpu_job(p: HostProcess, history: History) -> bool:
    """Whether `p` is a member of a job that has had a trainer (a GPU holder): a data loader's
    worker, a launcher, a helper. Their memory counts as much as the trainer's; processes
    outside GPU jobs are none of the detector's business."""
    job = history.job_of(p)
    return job is not None and job.had_trainer


def _by_step(p: HostProcess, steps: StepSeries, snapshot: NodeSnapshot, history: History,
             config: DetectorConfig) -> Optional[Finding]:
    if not len(steps.times):
        return None
    after = steps.times.xs[0] + config.leak_warmup_steps

    def test(series: Points, min_slope: float, min_relative: float,
             min_points: int = config.leak_min_points) -> Optional[Growth]:
        """Growing over the window that ends now and over the one that ended a point earlier:
        one unlucky arrangement of noise is not enough."""
        if not may_grow(series.xs, series.ys, config.leak_window, min_slope):
            return None
        g = growth(series.xs, series.ys, after, config.leak_window, min_points)
        if not is_growing(g, min_slope, min_relative):
            return None
        earlier = growth(series.xs[:-1], series.ys[:-1], after, config.leak_window, min_points)
        return g if is_growing(earlier, min_slope, min_relative) else None

    byte_min, relative = config.leak_min_bytes_per_step, config.leak_min_relative
    by_bytes = {n: g for n, s in steps.buffer_bytes.items()
                if (g := test(s, byte_min, relative))}
    # Item counts are small integers that noise moves in large relative jumps (a queue's
    # depth): they get a verdict only from four full blocks.
    by_items = {n: g for n, s in steps.buffer_items.items()
                if (g := test(s, MIN_ITEMS_PER_STEP, MIN_ITEMS_RELATIVE,
                              max(config.leak_min_points, 16)))}
    host = test(steps.rss, byte_min, relative)
    # PyTorch's caching allocator keeps freed blocks reserved for reuse, so NVML's figure and
    # torch's reserved one grow in steps while what tensors hold stays flat: where the process
    # reports what is allocated, that alone decides.
    if _reports(steps.cuda, config.leak_window):
        gpu = test(steps.cuda, byte_min, relative)
    else:
        gpu = test(steps.gpu, byte_min, relative)

    # What grows, most consequential first: host memory, GPU memory, then a buffer alone.
    culprit: Optional[Culprit]
    buffer: Optional[str] = None
    trace = None
    if host is not None or gpu is not None:
        if host is not None:
            series, g, limit = Series.RSS, host, host_limit(p, snapshot, config)
        else:
            assert gpu is not None
            series, g, limit = Series.GPU_MEMORY, gpu, gpu_limit(p, snapshot)
        trace = trace_of(p, g, steps, snapshot, history)
        culprit = (watched(g, by_bytes, by_items)
                   or discovered(g, steps, config)
                   or autograd(steps, config)
                   # Python's allocations are host memory: they cannot explain a GPU's.
                   or (traced(g, trace) if series == Series.RSS else None))
    elif (by_bytes or by_items) and not _rss_unjudged(steps.rss, after,
                                                       config.leak_min_points):
        name, g = max((by_bytes or by_items).items(), key=lambda kv: kv[1].slope)
        series, buffer = Series.BUFFER, name
        limit = host_limit(p, snapshot, config) if by_bytes else None
        culprit = make_culprit(name, FoundBy.WATCHED, slope(by_bytes.get(name)),
                               slope(by_items.get(name)))
    # (A buffer growing while the RSS is unjudged yet waits: the kernel's RSS comes a point a
    # poll, and for a process stepping faster than the daemon polls a buffer can show growing
    # before RSS can. Named now, the leak would keep "buffer `x` grows every step" for its
    # reason when it is RSS that runs out.)
    elif (held := growing_history(steps)) is not None:
        # An autograd history that grows every step is the leak whatever its bytes: after
        # backward() a step's graph keeps only its nodes, too few bytes to show in RSS for
        # hours, and a backward through it later walks them all.
        g, culprit = held
        series, limit = Series.AUTOGRAD, None
    else:
        return None

    # A buffer counted by its items alone, or an autograd history, grows by items, not bytes:
    # no projection then.
    by_items_only = series == Series.AUTOGRAD or (series == Series.BUFFER and not by_bytes)
    requested = snapshot.traces_pending.get(p.pid)
    evidence = LeakEvidence(
        series=series, unit=GrowthUnit.STEP, buffer=buffer,
        window_steps=(int(g.first_x), int(g.last_x)),
        growth_bytes_per_step=None if by_items_only else round(g.slope),
        culprit=culprit,
        trace=(TraceSummary(TraceStatus.REQUESTED, steps=requested) if requested is not None
               else trace_summary(trace) if trace is not None else None))

    severity = Severity.WARNING
    if limit is not None and not by_items_only:
        steps_left = limit.available_bytes / g.slope
        seconds_per_step = _seconds_per_step(steps, g)
        seconds_left = steps_left * seconds_per_step if seconds_per_step is not None else None
        evidence = replace(evidence, projection=OomProjection(
            limit, step=int(g.last_x + steps_left),
            in_seconds=round(seconds_left) if seconds_left is not None else None))
        if seconds_left is not None:
            severity = _by_time_left(seconds_left)
    else:
        limit = None
    # The summary says what kind of figure grows and what kind of culprit explains it, never
    # the name a program gave a buffer nor a traced source file (detectors.common).
    what = evidence.series_text
    reason = f"{what} grows every step"
    summary = f"{'a watched buffer' if buffer is not None else what} grows every step"
    if culprit is not None and buffer is None:
        reason += "; " + explains(culprit)
        summary += "; " + explains_publicly(culprit)
    if limit is not None:
        reason += f"; runs out against the {limit.source} limit"
        summary += f"; runs out against the {limit.source} limit"
    return replace(finding(Kind.LEAK, severity, p, Evidence(reason, summary)), details=evidence)


def _by_time_left(seconds: float) -> Severity:
    return Severity.CRITICAL if seconds <= _CRITICAL_WITHIN else Severity.WARNING


def _rss_unjudged(rss: Points, after: float, min_points: int) -> bool:
    """Whether the RSS series is known yet lacks the points after the warm-up that the leak
    test needs (its window, and the one a point earlier)."""
    if not len(rss) or math.isnan(rss.ys[-1]):
        return False
    known = sum(1 for x, y in zip(rss.xs, rss.ys) if x >= after and not math.isnan(y))
    return known < max(min_points, 6) + 1


def _reports(series: Points, window: int) -> bool:
    """Whether any of the newest `window` points of `series` is known."""
    return any(not math.isnan(y) for y in series.ys[-window:])


def _seconds_per_step(steps: StepSeries, g: Growth) -> Optional[float]:
    pts = [(x, t) for x, t in zip(steps.times.xs, steps.times.ys) if g.first_x <= x <= g.last_x]
    rates = [(t1 - t0) / (x1 - x0) for (x0, t0), (x1, t1) in zip(pts, pts[1:]) if x1 > x0]
    return median(rates) if rates else None


class _Window(NamedTuple):
    """The time-based test's window for a process with so many samples (the same for every
    process with as many: the newest of the history's sample times, gpuwatch.history.samples):
    one sample in `stride`, at most leak_window of them, from the oldest to sample `last`."""

    #: When each of the samples was taken (the SampleClock's newest, as many).
    taken: memoryview
    stride: int
    last: int
    #: Seconds from the window's first point to its last.
    run: float
    #: Half the least rise over `run` that matters: trend.may_grow's pre-check.
    least_rise: float


def _window(h: ProcessHistory, config: DetectorConfig,
            windows: dict[int, Optional[_Window]]) -> Optional[_Window]:
    """`h`'s window, worked out once a detection for each number of samples; None where it
    would hold one point (nothing can grow)."""
    n = len(h)
    if n in windows:
        return windows[n]
    # Every poll's sample is kept, but a window of leak_window points spread over all of them
    # answers the question as well at a fraction of the cost.
    # (Rounded up, so that the window's points spread over every sample kept: rounded down, the
    # newest leak_window of them could cover half the samples, and less than the span.)
    stride = max(1, -(-n // config.leak_window))
    last = (n - 1) // stride * stride if n else 0
    window = None
    if last > 0:
        taken = h.times
        run = taken[last] - taken[0]
        window = _Window(taken, stride, last, run, 0.5 * config.leak_min_bytes_per_second * run)
    windows[n] = window
    return window


def _by_time(p: HostProcess, h: ProcessHistory, snapshot: NodeSnapshot,
             config: DetectorConfig, windows: dict[int, Optional[_Window]],
             ticks: Optional[StepSeries] = None) -> Optional[Finding]:
    """The leak test per second on the poll's samples; `ticks`: what the process's agent
    reported on its timer (it has not stepped), by time, where a culprit may be found."""
    # Whether a series grows depends on the samples and the settings alone, and most polls
    # take no sample (gpuwatch.config.sample_spacing): a test that found no growth stands until
    # the next sample.
    sampled = h.sampled
    if h.quiet is not None and h.quiet[0] == sampled and h.quiet[1] is config:
        return None
    found = _growing_by_time(p, h, snapshot, config, windows, ticks)
    h.quiet = (sampled, config) if found is None else None
    return found


def _growing_by_time(p: HostProcess, h: ProcessHistory, snapshot: NodeSnapshot,
                     config: DetectorConfig, windows: dict[int, Optional[_Window]],
                     ticks: Optional[StepSeries]) -> Optional[Finding]:
    # (This runs at every sample for every GPU holder: most leave at one of the next checks.)
    w = _window(h, config, windows)
    if w is None:
        return None
    after = h.first_seen + config.leak_warmup_seconds
    taken = w.taken
    if taken[-1] - max(after, taken[0]) < config.leak_min_span_seconds:
        return None
    # The window is taken[::stride], at most leak_window points, so trend.may_grow's pre-check
    # compares its first point, the oldest sample, with its last, sample `last`: read in place
    # here, and the window copied only for a process that passes.
    run, least = w.run, w.least_rise
    rss_rise, gpu_rise = h.rises(w.last)
    # (A NaN rise, an unknown figure at either end, compares false: the full test decides.)
    if run > 0 and rss_rise < least and gpu_rise < least:
        return None
    times = taken[::w.stride]
    for series, rise, every, limit_of in (
            (Series.RSS, rss_rise, h.rss_every, host_limit),
            (Series.GPU_MEMORY, gpu_rise, h.gpu_memory_every, None)):
        if run > 0 and rise < least:
            continue
        sampled = every(w.stride)
        g = growth(times, sampled, after, config.leak_window, config.leak_min_points)
        if g is None or g.last_x - g.first_x < config.leak_min_span_seconds:
            continue
        if not is_growing(g, config.leak_min_bytes_per_second, 0.0):
            continue
        limit = limit_of(p, snapshot, config) if limit_of else gpu_limit(p, snapshot)
        evidence = LeakEvidence(series=series, unit=GrowthUnit.SECOND,
                                growth_bytes_per_second=round(g.slope))
        severity = Severity.WARNING
        if limit is not None:
            seconds_left = limit.available_bytes / g.slope
            evidence = replace(evidence, projection=OomProjection(
                limit, in_seconds=round(seconds_left),
                at=round(snapshot.taken_at + seconds_left)))
            severity = _by_time_left(seconds_left)
        against = f"; runs out against the {limit.source} limit" if limit is not None else ""
        if ticks is None:
            return replace(finding(Kind.LEAK, severity, p, Evidence.public(
                f"{series} grows steadily (no agent){against}")), details=evidence)
        # Discovery's figures are by the time received, as the growth is: per second both. The
        # culprit's own growth is per second then, kept out of its per-step figures.
        found = discovered(g, ticks, config)
        reason = summary = f"{series} grows steadily (not stepping)"
        if found is not None:
            culprit = Culprit(found.name, found.found_by)
            evidence = replace(evidence, culprit=culprit)
            reason += "; " + explains(culprit)
            summary += "; " + explains_publicly(culprit)
        return replace(finding(Kind.LEAK, severity, p, Evidence(
            reason + against, summary + against)), details=evidence)
    return None


#: The words of a copy-on-write finding's reason, after how many workers it is about.
COPY_ON_WRITE = ("copy-on-write after fork: touch-once data in a Dataset; workers' private "
                 "memory grows as they touch the parent's pages")


def _copy_on_write(snapshot: NodeSnapshot, history: History, config: DetectorConfig,
                   flagged: set[int]) -> Iterator[Finding]:
    """Workers forked from one parent (a DataLoader's, with the fork start method) whose private
    memory (USS) grows steadily while their RSS stays flat: the parent's pages they write to,
    Python objects whose reference counts they touch as they read a Dataset, are copied for
    each of them. One `leak` finding on the parent, which holds the data and where the fix is
    (arrays rather than lists of objects, or less in the parent before the fork), saying by how
    much the node's private memory grew across how many workers; none where the parent has a
    leak of its own (that one is reported), nor for a worker whose RSS grows as fast (its own
    leak, judged on RSS)."""
    procs = snapshot.processes
    forked: dict[int, list[HostProcess]] = {}
    for p in procs.values():
        parent = procs.get(p.ppid) if p.ppid else None
        if (parent is None or p.uss_bytes is None or not p.in_procfs or p.state == ProcState.ZOMBIE
                or p.pid in flagged or is_protected(p, config)):
            continue
        # Forked without an exec: it runs what its parent runs (a spawned worker execs anew
        # and shares nothing).
        if p.cmdline and p.cmdline == parent.cmdline and _in_gpu_job(p, history):
            forked.setdefault(parent.pid, []).append(p)
    for parent_pid, workers in forked.items():
        parent = procs[parent_pid]
        if parent_pid in flagged or is_protected(parent, config):
            continue
        growing: list[tuple[HostProcess, Growth, float]] = []
        for p in workers:
            h = history.get(p.identity)
            uss = _over_time(h, "uss", config) if h is not None else None
            if uss is None:
                continue
            g, first = uss
            rss = _over_time(h, "rss", config) if h is not None else None
            if rss is not None and rss[0].slope >= 0.5 * g.slope:
                continue  # RSS grows as much: its own leak, not pages copied
            growing.append((p, g, first))
        if not growing:
            continue
        grown = sum(max(0.0, g.last_y - first) for _, g, first in growing)
        evidence = CopyOnWrite(
            growth_bytes_per_second=round(sum(g.slope for _, g, _ in growing)),
            workers=len(growing),
            worker_pids=tuple(p.pid for p, _, _ in sorted(growing, key=lambda w: w[0].pid)),
            private_growth_bytes=round(grown),
            uss_bytes_from=round(min(first for _, _, first in growing)),
            uss_bytes_to=round(max(g.last_y for _, g, _ in growing)))
        n = len(growing)
        # A count and gpuwatch's words: public as they are.
        reason = (f"private memory of {n} forked worker{'s' if n != 1 else ''} grows while "
                  f"their RSS stays flat: {COPY_ON_WRITE}")
        yield replace(finding(Kind.LEAK, Severity.WARNING, parent, Evidence.public(reason)),
                      details=evidence)


def _over_time(h: ProcessHistory, what: str, config: DetectorConfig
               ) -> Optional[tuple[Growth, float]]:
    """The time-based leak test (as _by_time runs it) on the history's `what` series ("rss",
    "uss"): its growth when growing, with the first point of its window."""
    ys = getattr(h, what)
    after = h.first_seen + config.leak_warmup_seconds
    taken = h.times
    if ys is None or not len(taken) or (
            taken[-1] - max(after, taken[0]) < config.leak_min_span_seconds):
        return None
    stride = max(1, -(-len(taken) // config.leak_window))
    times, sampled = taken[::stride], ys[::stride]
    if not may_grow(times, sampled, config.leak_window, config.leak_min_bytes_per_second):
        return None
    g = growth(times, sampled, after, config.leak_window, config.leak_min_points)
    if g is None or g.last_x - g.first_x < config.leak_min_span_seconds:
        return None
    if not is_growing(g, config.leak_min_bytes_per_second, 0.0):
        return None
    first = next((y for x, y in zip(times, sampled) if x >= g.first_x and not math.isnan(y)),
                 g.last_y)
    return g, first


def host_limit(p: HostProcess, snapshot: NodeSnapshot, config: DetectorConfig
               ) -> Optional[MemoryLimit]:
    """The tightest host-memory limit the process runs into, and how much of it is left."""
    limits = []
    if config.host_memory_limit_bytes and p.rss_bytes is not None:
        limits.append(MemoryLimit(LimitSource.CONFIGURED, config.host_memory_limit_bytes,
                                  max(0, config.host_memory_limit_bytes - p.rss_bytes)))
    cg = snapshot.cgroup_memory.get(p.cgroup or "")
    if cg is not None and cg[0] is not None:
        limits.append(MemoryLimit(LimitSource.CGROUP, cg[0], max(0, cg[0] - cg[1])))
    if snapshot.mem_available_bytes is not None:
        limits.append(MemoryLimit(LimitSource.NODE, None, snapshot.mem_available_bytes))
    return min(limits, key=lambda m: m.available_bytes) if limits else None


def gpu_limit(p: HostProcess, snapshot: NodeSnapshot) -> Optional[MemoryLimit]:
    indexes = {u.gpu_index for u in p.gpu_usage}
    free = [g for g in snapshot.gpus if g.index in indexes
            and g.memory_free_bytes is not None and g.memory_total_bytes is not None]
    if not free:
        return None
    g = min(free, key=lambda g: g.memory_free_bytes or 0)
    return MemoryLimit(LimitSource.GPU, g.memory_total_bytes, g.memory_free_bytes or 0)
