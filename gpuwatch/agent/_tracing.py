"""Allocation tracing for a few training steps, on the daemon's request, with tracemalloc.

What is traced: every memory block Python's allocators hand out (objects, list and dict storage,
bytes and bytearray buffers) and NumPy array data (NumPy reports it to tracemalloc), with the
Python call stack that allocated it, up to `frames` deep. Memory a library allocates by other
means (CUDA, a torch tensor's storage, a C library's own malloc) is invisible to tracemalloc.

When it stops: `Tracer.start` begins at the newest step; `Tracer.on_step` ends it once `steps`
training steps have gone by, takes the final snapshot and turns it into the `trace` report body:
the lines whose live allocations grew over those steps (net: a block allocated and freed within
the window does not count), largest first, and the call stack of the largest. Tracing then stops
if this Tracer started it; a program that was tracing already keeps tracing, and the report is
then the difference from a snapshot taken when tracing began here.

What it costs (tests/test_agent_tracing.py prints the figures; these are from a 2-core x86 VM,
CPython 3.11): while tracing, every allocation and free goes through tracemalloc, which also
resolves the line of each of the `frames` innermost frames. A pure-Python step that does nothing
but allocate small objects (10.6 ms) took 70 ms with 1 frame and 212 ms with 16; a training
step that spends its time in compiled code and on the GPU slows far less. Each live traced block
costs about 50 bytes of tracemalloc's memory. The step that ends the trace pays for the snapshot
and its analysis: about 0.05 to 0.1 s per 100,000 live traced blocks, linear in their number
(0.9 s for 1,000,000), about twice that when the program traces already (start then takes a
snapshot too). Outside a trace nothing is hooked; during one, on_step is an integer comparison
(under 0.1 us).

Standard library only, like the rest of the agent. The caller serialises start/on_step; cancel
may be called from anywhere (a forked child, the exit hook).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

from gpuwatch.protocol import MAX_TRACE_FILE as MAX_FILE
from gpuwatch.protocol import MAX_TRACE_SITES as MAX_SITES
from gpuwatch.protocol import MAX_TRACE_STEPS as MAX_STEPS
from gpuwatch.protocol import MAX_TRACE_WHY as MAX_WHY
from gpuwatch.protocol import MAX_TRACEBACK as MAX_FRAMES

try:
    import tracemalloc
except ImportError:  # pragma: no cover - an interpreter without it (PyPy)
    tracemalloc = None  # type: ignore[assignment]

__all__ = ["MAX_BODY_BYTES", "MAX_FRAMES", "MAX_SITES", "MAX_STEPS", "Tracer"]

#: The JSON of a report body stays under this, whatever the file names hold, leaving room in a
#: 16,384-byte datagram for the report around it.
MAX_BODY_BYTES = 12288
# One file name as JSON, quotes and escapes included. With ensure_ascii a character takes up to
# 12 bytes (a surrogate pair); 8 sites and 16 frames of such names then stay near 10 KiB.
_MAX_FILE_JSON = 384
ENV = "GPUWATCH_AGENT_TRACING"
_OFF = frozenset({"0", "false", "no", "off"})
_ELLIPSIS = "..."

_AGENT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TRACEMALLOC_FILE = getattr(tracemalloc, "__file__", None) or "tracemalloc.py"
# Frames that say nothing about the program: this agent, tracemalloc itself, the import system.
_SKIP_NAMES = frozenset({
    "<unknown>", "<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>",
    os.path.abspath(_TRACEMALLOC_FILE),
})
_SKIP_SUFFIXES = (os.sep + "tracemalloc.py",
                  os.path.join("importlib", "_bootstrap.py"),
                  os.path.join("importlib", "_bootstrap_external.py"))


class Tracer:
    """Traces allocations over a number of training steps and reports where memory grew."""

    __slots__ = ("_active", "_begin", "_clock", "_cooldown", "_end", "_frames", "_last_end",
                 "_lock", "_rebase", "_start_snapshot", "_started", "_steps", "_top")

    def __init__(self, *, frames: int = 16, top: int = MAX_SITES, cooldown: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(frames, int) or frames < 1:
            raise ValueError(f"frames must be an int >= 1, got {frames!r}")
        if not isinstance(top, int) or not 1 <= top <= MAX_SITES:
            raise ValueError(f"top must be an int from 1 to {MAX_SITES}, got {top!r}")
        if not cooldown >= 0:
            raise ValueError(f"cooldown must be >= 0, got {cooldown!r}")
        self._frames = frames
        self._top = top
        self._cooldown = float(cooldown)
        self._clock = clock
        self._lock = threading.Lock()
        self._last_end: Optional[float] = None
        self._reset()

    def _reset(self) -> None:
        self._active = False
        # An empty window, so that on_step falls through to its slow path, which sees inactive.
        self._begin: Any = 1
        self._end: Any = 0
        self._steps = 0
        self._rebase = False
        self._started = False
        self._start_snapshot: Any = None

    @property
    def active(self) -> bool:
        """True from a start that returned None until the report (or cancel)."""
        return self._active

    def start(self, steps: int, step: Optional[int]) -> Optional[dict[str, Any]]:
        """Begin tracing `steps` (clamped to 1..100) training steps from `step`, the newest one
        (None when there was none yet: counting then starts at the next).

        Returns None when tracing began, else the report body to send at once: refused (why:
        "GPUWATCH_AGENT_TRACING=0", "busy" or "cooldown") or failed. Never raises."""
        try:
            if os.environ.get(ENV, "").strip().lower() in _OFF:
                return _refused(f"{ENV}=0")
            if self._active:
                return _refused("busy")
            if (self._last_end is not None
                    and self._clock() - self._last_end < self._cooldown):
                return _refused("cooldown")
            if tracemalloc is None:
                return _refused("tracemalloc is not available")
            if isinstance(steps, bool) or not isinstance(steps, int):
                return _refused(f"steps must be an int, got {type(steps).__name__}")
            if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
                return _refused(f"step must be an int, got {type(step).__name__}")
            k = min(max(steps, 1), MAX_STEPS)
            if tracemalloc.is_tracing():
                # Not ours to stop: the report is the difference from now.
                self._start_snapshot = tracemalloc.take_snapshot()
                self._started = False
            else:
                # Everything traced from here on was allocated in the window, so no start
                # snapshot is needed.
                tracemalloc.start(self._frames)
                self._started = True
                self._start_snapshot = None
            self._steps = k
            if step is None:
                self._rebase = True
                self._begin = self._end = float("-inf")
            else:
                self._rebase = False
                self._begin, self._end = step, step + k
            self._active = True
            return None
        except Exception as e:
            self._stop()
            return _failed(e)

    def on_step(self, step: int) -> Optional[dict[str, Any]]:
        """Note training step `step`; once the traced steps have gone by, stop and return the
        `trace` report body (done or failed), else None. Never raises."""
        try:
            if self._begin <= step < self._end:
                return None
        except TypeError:
            return None  # not a step number: nothing to count
        return self._slow_step(step)

    def cancel(self) -> None:
        """Stop tracing without a report (a forked child, exit). Does not start the cooldown."""
        # A lock held by another thread at fork time stays held in the child forever.
        self._lock = threading.Lock()
        self._stop(record=False)

    # ---- internals ------------------------------------------------------------------------------

    def _slow_step(self, step: int) -> Optional[dict[str, Any]]:
        if not self._active:
            return None
        if self._rebase:
            self._rebase = False
            self._begin, self._end = step, step + self._steps
            return None
        if not self._lock.acquire(False):
            return None  # another thread is finishing this trace
        try:
            if not self._active:
                return None
            begin = self._begin
            start_snapshot = self._start_snapshot
            try:
                if step < begin:
                    # A restarted count: how many steps went by is unknown, so no figure per step.
                    raise _StepWentBack(f"the step went back from {begin} to {step}")
                snapshot = tracemalloc.take_snapshot()
            finally:
                # Before the analysis: with tracing off it runs at full speed, and nothing
                # below can leave tracing on.
                self._stop()
            return self._body(snapshot, start_snapshot, step - begin)
        except Exception as e:
            return _failed(e)
        finally:
            self._lock.release()

    def _stop(self, record: bool = True) -> None:
        started = self._started
        self._reset()
        if record:
            self._last_end = self._clock()
        if started and tracemalloc is not None and tracemalloc.is_tracing():
            tracemalloc.stop()

    def _body(self, snapshot: Any, start_snapshot: Any, steps: int) -> dict[str, Any]:
        traces = _raw_traces(snapshot)
        growth = _by_line(traces)
        if start_snapshot is not None:
            for site, (size, count) in _by_line(_raw_traces(start_snapshot)).items():
                now_size, now_count = growth.get(site, (0, 0))
                growth[site] = (now_size - size, now_count - count)
        # Grouped first, so the exclusions run once per line rather than once per block.
        grown = [(site, size, count) for site, (size, count) in growth.items()
                 if size > 0 and not _skipped(site[0])]
        grown.sort(key=lambda g: g[1], reverse=True)
        del grown[self._top:]
        roots = _path_roots()
        sites = [{"file": _short(site[0], roots), "line": _line(site[1]), "bytes": size,
                  "count": max(count, 0)} for site, size, count in grown]
        frames: list[dict[str, Any]] = []
        if grown:
            stack = _largest_stack(traces, grown[0][0])
            kept = [f for f in stack if not _skipped(f[0])][-MAX_FRAMES:]
            frames = [{"file": _short(f[0], roots), "line": _line(f[1])} for f in kept]
        return _bounded({"status": "done", "steps": steps, "sites": sites, "traceback": frames})


class _StepWentBack(Exception):
    pass


def _refused(why: str) -> dict[str, Any]:
    return {"status": "refused", "why": _text(why, MAX_WHY)}


def _failed(error: BaseException) -> dict[str, Any]:
    why = str(error) if isinstance(error, _StepWentBack) else f"{type(error).__name__}: {error}"
    return {"status": "failed", "why": _text(why, MAX_WHY)}


def _raw_traces(snapshot: Any) -> Any:
    """The snapshot's traces as tracemalloc holds them: (domain, size, frames, ...) tuples, frames
    (filename, lineno) from the most recent. tracemalloc's own grouping does Python work per
    block that allocates (an int per sum): where the program traces too, each such allocation is
    traced, and grouping 200,000 blocks takes seconds instead of tens of milliseconds. The loops
    here allocate nothing per block. Where the private layout is not as expected, the same
    tuples are built from the public API (slower)."""
    raw = getattr(getattr(snapshot, "traces", None), "_traces", None)
    if isinstance(raw, (list, tuple)):
        if not raw:
            return raw
        first = raw[0]
        with contextlib.suppress(Exception):
            public = snapshot.traces[0]
            if (isinstance(first, tuple) and len(first) >= 3 and first[1] == public.size
                    and tuple(first[2]) == tuple((f.filename, f.lineno)
                                                 for f in reversed(public.traceback))):
                return raw
    return [(0, t.size, tuple((f.filename, f.lineno) for f in reversed(t.traceback)))
            for t in snapshot.traces]


def _by_line(traces: Any) -> dict[tuple[str, int], tuple[int, int]]:
    """(size, count) of the blocks by their most recent frame."""
    sizes: dict[tuple[str, int], list[int]] = {}
    for trace in traces:
        frames = trace[2]
        if frames:
            # Appending the existing size ints allocates (almost) nothing; summing per block would.
            group = sizes.get(frames[0])
            if group is None:
                sizes[frames[0]] = group = []
            group.append(trace[1])
    return {site: (sum(group), len(group)) for site, group in sizes.items()}


def _largest_stack(traces: Any, site: tuple[str, int]) -> list[tuple[str, int]]:
    """The call stack, oldest call first, holding the most bytes among those allocating at
    `site`."""
    sizes: dict[Any, list[int]] = {}
    for trace in traces:
        frames = trace[2]
        if frames and frames[0] == site:
            group = sizes.get(frames)
            if group is None:
                sizes[frames] = group = []
            group.append(trace[1])
    if not sizes:
        return []
    largest = max(sizes.items(), key=lambda item: sum(item[1]))[0]
    return list(reversed(largest))


def _skipped(filename: str) -> bool:
    return (filename in _SKIP_NAMES or filename.startswith(_AGENT_DIR)
            or filename.endswith(_SKIP_SUFFIXES))


def _line(lineno: Any) -> int:
    return lineno if isinstance(lineno, int) and lineno >= 0 else 0


def _path_roots() -> list[str]:
    """sys.path entries as directory prefixes, longest first: the first that a file name starts
    with is the longest containing it."""
    roots = set()
    for entry in sys.path:
        if not isinstance(entry, str):
            continue
        try:
            root = os.path.abspath(entry or os.curdir)
        except OSError:  # the working directory is gone
            continue
        root = root.rstrip(os.sep)
        if root:  # relative to "/" says nothing the absolute name does not
            roots.add(root + os.sep)
    return sorted(roots, key=len, reverse=True)


def _short(filename: str, roots: list[str]) -> str:
    if os.path.isabs(filename):
        for root in roots:
            if filename.startswith(root) and len(filename) > len(root):
                filename = filename[len(root):]
                break
    return _text(filename, MAX_FILE, _MAX_FILE_JSON)


def _text(text: str, max_chars: int, max_json: Optional[int] = None) -> str:
    """`text` as valid Unicode (file names can carry undecodable bytes as lone surrogates, which
    no UTF-8 encoder takes), at most `max_chars` characters and `max_json` bytes as JSON, keeping
    the tail: the end of a path names the file."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raw = text.encode("utf-8", "replace")
        text = raw.decode("utf-8", "replace")
    if len(text) > max_chars:
        text = _ELLIPSIS + text[len(text) - (max_chars - len(_ELLIPSIS)):]
    if max_json is not None and len(json.dumps(text)) > max_json:
        budget = max_json - 2 - len(_ELLIPSIS)  # the quotes and the ellipsis
        cut = len(text)
        while cut > 0:
            size = len(json.dumps(text[cut - 1])) - 2
            if size > budget:
                break
            budget -= size
            cut -= 1
        text = _ELLIPSIS + text[cut:]
    return text


def _bounded(body: dict[str, Any]) -> dict[str, Any]:
    """Drop the oldest frames, then the smallest sites, until the body fits MAX_BODY_BYTES. With
    the limits on each name it always fits already; this keeps the promise whatever changes."""
    while len(json.dumps(body, separators=(",", ":"))) > MAX_BODY_BYTES:
        if body["traceback"]:
            del body["traceback"][0]
        elif body["sites"]:
            del body["sites"][-1]
        else:
            break
    return body
