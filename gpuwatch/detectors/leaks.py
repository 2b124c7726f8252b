"""leak: a figure that grows every step (or steadily over time without an agent).

For an instrumented process the series are step-aligned: RSS, CUDA allocations and every watched
buffer from its reports, and NVML's GPU memory at each poll against the step reached by then. The
first `leak_warmup_steps` are ignored. A finding names the figure that grows, the buffer whose
growth explains it when one does (at least half of it), and projects the step and time of
running out against the tightest limit: the process's cgroup memory.max, a configured limit, or
the node's MemAvailable for host memory; the free memory of its GPUs for GPU memory.

Without an agent the same test runs on the poll samples, per second.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from statistics import median
from types import MappingProxyType
from typing import Any, Optional

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors.common import finding, is_protected
from gpuwatch.detectors.trend import Growth, growth, is_growing, may_grow
from gpuwatch.history import History, ProcessHistory, Series, StepSeries
from gpuwatch.model import Finding, HostProcess, MemoryLimit, NodeSnapshot

#: An item count must grow by at least this much per step, and by this share of itself, to call
#: a buffer leaking by items: a bounded queue or cache jitters around its capacity.
_MIN_ITEMS_PER_STEP = 1.0
_MIN_ITEMS_RELATIVE = 0.01
#: A leak expected to run out within this many seconds is critical.
_CRITICAL_WITHIN = 3600.0


def detect(snapshot: NodeSnapshot, history: History, config: DetectorConfig
           ) -> Iterator[Finding]:
    for p in snapshot.processes.values():
        if not p.in_procfs or p.state == "zombie" or is_protected(p, config):
            continue
        h = history.get(p.identity)
        if h is None:
            continue
        if h.steps is not None:
            found = _by_step(p, h.steps, snapshot, config)
        elif p.holds_gpu:
            found = _by_time(p, h, snapshot, config)
        else:
            found = None
        if found is not None:
            yield found


def _by_step(p: HostProcess, steps: StepSeries, snapshot: NodeSnapshot,
             config: DetectorConfig) -> Optional[Finding]:
    if not len(steps.times):
        return None
    after = steps.times.xs[0] + config.leak_warmup_steps

    def test(series: Series, min_slope: float, min_relative: float,
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
                if (g := test(s, _MIN_ITEMS_PER_STEP, _MIN_ITEMS_RELATIVE,
                              max(config.leak_min_points, 16)))}
    host = test(steps.rss, byte_min, relative)
    gpu = test(steps.gpu, byte_min, relative) or test(steps.cuda, byte_min, relative)

    # What grows, most consequential first: host memory, GPU memory, then a buffer alone.
    if host is not None:
        what, g, limit = "RSS", host, host_limit(p, snapshot, config)
        culprit = _culprit(g, by_bytes, by_items)
    elif gpu is not None:
        what, g, limit = "GPU memory", gpu, gpu_limit(p, snapshot)
        culprit = _culprit(g, by_bytes, by_items)
    elif by_bytes or by_items:
        culprit, g = max((by_bytes or by_items).items(), key=lambda kv: kv[1].slope)
        what = f"buffer `{culprit}`"
        limit = host_limit(p, snapshot, config) if by_bytes else None
    else:
        return None

    details: dict[str, Any] = {
        "series": what, "unit": "step", "window_steps": [int(g.first_x), int(g.last_x)],
        "culprit": culprit,
    }
    if culprit not in by_bytes and what.startswith("buffer"):
        details["culprit_items_per_step"] = round(g.slope, 3)
    else:
        details["growth_bytes_per_step"] = round(g.slope)
    if culprit in by_bytes:
        details["culprit_bytes_per_step"] = round(by_bytes[culprit].slope)
    if culprit in by_items:
        details["culprit_items_per_step"] = round(by_items[culprit].slope, 3)

    severity = "warning"
    if limit is not None and "growth_bytes_per_step" in details:
        steps_left = limit.available_bytes / g.slope
        details.update(limit_source=limit.source, limit_bytes=limit.limit_bytes,
                       available_bytes=limit.available_bytes,
                       projected_oom_step=int(g.last_x + steps_left))
        seconds_per_step = _seconds_per_step(steps, g)
        if seconds_per_step is not None:
            seconds_left = steps_left * seconds_per_step
            details["projected_oom_in_seconds"] = round(seconds_left)
            severity = "critical" if seconds_left <= _CRITICAL_WITHIN else "warning"
    else:
        limit = None
    reason = f"{what} grows every step"
    if culprit is not None and not what.startswith("buffer"):
        reason += f"; buffer `{culprit}` explains it"
    if limit is not None:
        reason += f"; runs out against the {limit.source} limit"
    return _with_details(finding("leak", severity, p, reason), details)


def _culprit(total: Growth, by_bytes: dict[str, Growth], by_items: dict[str, Growth]
             ) -> Optional[str]:
    """The buffer whose byte growth explains at least half of the total; else, when no buffer
    reports bytes, the one whose item count grows fastest."""
    explaining = {n: g for n, g in by_bytes.items() if g.slope >= 0.5 * total.slope}
    if explaining:
        return max(explaining.items(), key=lambda kv: kv[1].slope)[0]
    unsized = {n: g for n, g in by_items.items() if n not in by_bytes}
    if unsized:
        return max(unsized.items(), key=lambda kv: kv[1].slope)[0]
    return None


def _seconds_per_step(steps: StepSeries, g: Growth) -> Optional[float]:
    pts = [(x, t) for x, t in zip(steps.times.xs, steps.times.ys) if g.first_x <= x <= g.last_x]
    rates = [(t1 - t0) / (x1 - x0) for (x0, t0), (x1, t1) in zip(pts, pts[1:]) if x1 > x0]
    return median(rates) if rates else None


def _by_time(p: HostProcess, h: ProcessHistory, snapshot: NodeSnapshot,
             config: DetectorConfig) -> Optional[Finding]:
    after = h.first_seen + config.leak_warmup_seconds
    if not len(h.times) or h.times[-1] - max(after, h.times[0]) < config.leak_min_span_seconds:
        return None  # runs every poll for every GPU holder: leave early while nothing can show
    # Every poll's sample is kept, but a window of leak_window points spread over all of them
    # answers the question as well at a fraction of the cost.
    stride = max(1, len(h.times) // config.leak_window)
    times = h.times[::stride]
    for what, ys, limit_of in (("RSS", h.rss, host_limit), ("GPU memory", h.gpu_memory, None)):
        sampled = ys[::stride]
        if not may_grow(times, sampled, config.leak_window, config.leak_min_bytes_per_second):
            continue
        g = growth(times, sampled, after, config.leak_window, config.leak_min_points)
        if g is None or g.last_x - g.first_x < config.leak_min_span_seconds:
            continue
        if not is_growing(g, config.leak_min_bytes_per_second, 0.0):
            continue
        limit = limit_of(p, snapshot, config) if limit_of else gpu_limit(p, snapshot)
        details: dict[str, Any] = {"series": what, "unit": "second",
                                   "growth_bytes_per_second": round(g.slope)}
        severity = "warning"
        if limit is not None:
            seconds_left = limit.available_bytes / g.slope
            details.update(limit_source=limit.source, limit_bytes=limit.limit_bytes,
                           available_bytes=limit.available_bytes,
                           projected_oom_in_seconds=round(seconds_left),
                           projected_oom_at=round(snapshot.taken_at + seconds_left))
            severity = "critical" if seconds_left <= _CRITICAL_WITHIN else "warning"
        against = f"; runs out against the {limit.source} limit" if limit is not None else ""
        return _with_details(finding("leak", severity, p,
                                     f"{what} grows steadily (no agent){against}"), details)
    return None


def host_limit(p: HostProcess, snapshot: NodeSnapshot, config: DetectorConfig
               ) -> Optional[MemoryLimit]:
    """The tightest host-memory limit the process runs into, and how much of it is left."""
    limits = []
    if config.host_memory_limit_bytes and p.rss_bytes is not None:
        limits.append(MemoryLimit("configured", config.host_memory_limit_bytes,
                                  max(0, config.host_memory_limit_bytes - p.rss_bytes)))
    cg = snapshot.cgroup_memory.get(p.cgroup or "")
    if cg is not None and cg[0] is not None:
        limits.append(MemoryLimit("cgroup", cg[0], max(0, cg[0] - cg[1])))
    if snapshot.mem_available_bytes is not None:
        limits.append(MemoryLimit("node", None, snapshot.mem_available_bytes))
    return min(limits, key=lambda m: m.available_bytes) if limits else None


def gpu_limit(p: HostProcess, snapshot: NodeSnapshot) -> Optional[MemoryLimit]:
    indexes = {u.gpu_index for u in p.gpu_usage}
    free = [g for g in snapshot.gpus if g.index in indexes
            and g.memory_free_bytes is not None and g.memory_total_bytes is not None]
    if not free:
        return None
    g = min(free, key=lambda g: g.memory_free_bytes or 0)
    return MemoryLimit("GPU", g.memory_total_bytes, g.memory_free_bytes or 0)


def _with_details(f: Finding, details: dict[str, Any]) -> Finding:
    return replace(f, details=MappingProxyType(details))
